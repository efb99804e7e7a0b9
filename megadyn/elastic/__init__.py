"""Elastic training: every change of layout is one transition, plan -> move -> rebuild.

    transition.py  the spine: a Transition and the one function that runs it
    config.py      ElasticConfig, and what elastic reads of the job's config
    control/       the step boundary: channel, records, drains, controller, events
    planning/      which layout: layouts, hetero (the templates' planner), lengths, requests
    recovery/      a failed worker: agreement, decision, recovery, watched store
    reshard/       what moves: description, plan, executor

This package exports the reshard's names:

plan = plan_reshard(cfg, old_layout, old_members, new_layout, new_members,
                    old_distopt=DistOpt(), new_distopt=DistOpt())
new_state = execute_plan(plan, get_local, group=group, device=device)
"""

from megadyn.elastic.reshard.description import (
    DistOpt,
    HeldPiece,
    StateDescription,
    TensorInfo,
    describe,
)
from megadyn.elastic.reshard.executor import execute_plan, schedule_rounds
from megadyn.elastic.reshard.plan import Plan, PlanError, Transfer, plan_between, plan_reshard
from megadyn.elastic.reshard.regions import LocalRegion

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
