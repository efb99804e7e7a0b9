"""Elastic training: the training-state description, the reshard planner and its executor.

plan = plan_reshard(cfg, old_layout, old_members, new_layout, new_members,
                    old_distopt=DistOpt(), new_distopt=DistOpt())
new_state = execute_plan(plan, get_local, group=group, device=device)
"""

from megadyn.elastic.description import (
    DistOpt,
    HeldPiece,
    StateDescription,
    TensorInfo,
    describe,
)
from megadyn.elastic.executor import execute_plan, schedule_rounds
from megadyn.elastic.planner import Plan, PlanError, Transfer, plan_between, plan_reshard
from megadyn.elastic.regions import LocalRegion

__all__ = [
    "DistOpt",
    "HeldPiece",
    "LocalRegion",
    "Plan",
    "PlanError",
    "StateDescription",
    "TensorInfo",
    "Transfer",
    "describe",
    "execute_plan",
    "plan_between",
    "plan_reshard",
    "schedule_rounds",
]
