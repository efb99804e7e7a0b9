"""The controller at the step boundary: the control channel (the store of requests and epochs),
its records, drains, the controller and its leader's decisions, the trainer protocol it needs,
and the events it reports."""
