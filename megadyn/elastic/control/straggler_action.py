"""What the elastic controller does with a straggler (--elastic-straggler-policy).

    action = StragglerAction(cfg, print_fn)                  # ElasticController.__init__
    state.update(action.state(trainer))                      # the leader's published state
    decision = action.decide(trainer, channel, resolve, epoch)  # the leader, after drains
    action.applied(rec, channel)                             # every process, in `apply`
    action.after_step(trainer)                               # members, every step boundary

Every member holds the same verdict (control/stragglers.py: the scores are all-gathered every
--log-interval), and the leader acts on it at its next decision. Under `exclude` the straggler
leaves the layout as a drained rank would (`resolve_exclusion`: a standby process takes its
place in the same layout where one waits, else the others go on under the layout for their
count), but it does not exit: it waits as a standby process. Under `rebalance` its replica
keeps its ranks and runs fewer micro batches (planning/straggler_rebalance.py). Either is an event
"straggler" of the controller's one path (plan, reshard, rebuild). The leader writes what it
saw to the control store (`straggler/<epoch>`: rank, host, GPU, score, the median step time
before); after the first log interval under the new layout the last member prints one line,
" elastic: straggler: excluded | epoch: ... | rank: 2 | ...", with the step times before and
after, and reports it to W&B and the metrics file. An action the layout rules refuse (fewer
members than --elastic-min-members, no layout for the rest, no gain) is said once per rank,
and the job goes on.
Under `log` the verdict is only printed (megadyn/training/straggler_log.py), and
`tools/elastic_ctl.py show` lists the scores under either policy.
"""

from __future__ import annotations

import json

from megadyn.core.hetero_layout import HeteroLayout
from megadyn.elastic.control.events import describe_layout, format_event
from megadyn.elastic.control.records import Reconfiguration, reconfiguration
from megadyn.elastic.control.stragglers import StragglerScores
from megadyn.elastic.planning.requests import replace_or_shrink
from megadyn.elastic.planning.straggler_rebalance import rebalanced_layout

EVENT = "straggler"
"""The Reconfiguration's event of an action on a straggler."""
ACTIONS = {"exclude": "excluded", "rebalance": "rebalanced"}
"""What the action line says was done, by policy."""


def _key(epoch: int) -> str:
    return f"straggler/{epoch}"


class StragglerAction:
    """The controller's side of --elastic-straggler-policy (module docstring)."""

    def __init__(self, cfg, print_fn=print):
        self.policy, self.print = cfg.elastic.straggler_policy, print_fn
        self.refused: set[int] = set()  # ranks whose exclusion was refused (said once)
        self.pending: dict | None = None  # an exclusion whose step time after is to come

    @staticmethod
    def state(trainer) -> dict:
        """The scores of the last interval, for the leader's published state."""
        scores = trainer.straggler_scores
        return {} if scores is None else {"stragglers": scores.to_dict()}

    def decide(self, trainer, channel, resolve, epoch: int) -> dict | None:
        """The leader: {"epoch": n} once the action on the verdict's straggler is published as
        reconfiguration `epoch` (`resolve(scores)` -> (layout, members):
        `resolve_straggler`); None otherwise."""
        if self.policy == "log":
            return None
        scores = trainer.straggler_scores
        if scores is None or scores.straggler is None:
            return None
        rank = scores.straggler
        if rank in self.refused:
            return None
        try:
            layout, members = resolve(scores)
        except ValueError as e:  # a LayoutError: the layout rules refuse it
            self.refused.add(rank)
            self.print(
                f" elastic: {self.policy} of straggler rank {rank} refused: {e}; training "
                f"continues on the old layout (--elastic-straggler-policy {self.policy})",
                flush=True,
            )
            return None
        figures = scores.ranks[[r.rank for r in scores.ranks].index(rank)]
        seen = {
            "straggler": ACTIONS[self.policy],
            "rank": rank,
            "host": figures.host,
            "gpu": figures.gpu,
            "score": round(max(scores.scores), 3),
            "before_step_s": round(scores.median_step_s, 6),
        }
        if isinstance(layout, HeteroLayout):  # rebalanced: the replicas' micro batches
            seen["micro_batches"] = "+".join(str(r.micro_batches) for r in layout.replicas)
        channel.store.set(_key(epoch), json.dumps(seen))
        rec = reconfiguration(trainer, epoch, layout, members, (), event=EVENT)
        channel.publish_epoch(rec)
        return {"epoch": rec.epoch}

    def applied(self, rec: Reconfiguration, channel) -> None:
        """Every process, once reconfiguration `rec` ran: an action's line is to come."""
        if rec.event != EVENT or channel is None:
            return
        seen = json.loads(channel.store.get(_key(rec.epoch)))
        self.pending = {
            "straggler": seen.pop("straggler"),
            "epoch": rec.epoch,
            "iteration": rec.iteration,
            "old": describe_layout(rec.old_layout),
            "new": describe_layout(rec.layout),
            **seen,
        }

    def after_step(self, trainer) -> None:
        """Members: after the new layout's first log interval, the action's line (on the
        last member), with the median step time before and after."""
        if self.pending is None or trainer.straggler_scores is None:
            return
        scores = trainer.straggler_scores
        event, self.pending = self.pending, None
        event["after_step_s"] = round(scores.median_step_s, 6)
        if trainer.groups.rank == trainer.groups.grid.members[-1]:
            self.print(format_event(event), flush=True)
            trainer.log_event(EVENT, event)


def resolve_straggler(scores: StragglerScores, model_cfg, cfg, groups, live, cost=None):
    """(layout, members) of --elastic-straggler-policy's action on `scores.straggler`."""
    if cfg.elastic.straggler_policy == "rebalance":
        layout = rebalanced_layout(scores, model_cfg, cfg, groups)
        return layout, list(layout.members)
    return resolve_exclusion(scores.straggler, model_cfg, cfg, groups, live, cost)


def resolve_exclusion(rank: int, model_cfg, cfg, groups, live: list[int], cost=None):
    """(layout, members) without member `rank`, which stays as a standby process: the first
    other standby process takes its place in the same layout, else the other members go on
    under the layout for their count (planning/requests.py `replace_or_shrink`; LayoutError to
    refuse, below --elastic-min-members say)."""
    members = list(groups.grid.members)
    waiting = [r for r in live if r not in members]
    return replace_or_shrink(groups, members, [rank], waiting, model_cfg, cfg, cost)
