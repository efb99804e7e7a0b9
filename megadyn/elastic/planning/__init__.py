"""Which layout to run: the layout planner (a grid for a member count), the template planner
(pipelines of different depth), the length planner (a layout per sequence length), and operator
requests resolved into layouts."""
