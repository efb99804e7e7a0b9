"""What one rank's run of a job returns (megadyn/launch/run.py `main`), the same in every mode.

result = main(argv)          # a test in a spawned process, or tools that run a job
result.history               # the lm loss of each iteration this rank logged, in order
result.losses[10]            # ... by iteration
result.samples, result.events  # under live reconfiguration (else empty)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunResult:
    """One rank's run of a job (module docstring)."""

    losses: dict[int, float] = field(default_factory=dict)
    """The lm loss by iteration of every iteration this process logged (a last-stage rank's;
    a standby or earlier-stage process may have none)."""
    samples: list[int] = field(default_factory=list)
    """Under live reconfiguration: the global sample indices this process's data-parallel
    replica drew (tp 0, cp 0, first stage; the elastic tests check each is read once); empty
    otherwise."""
    events: list = field(default_factory=list)
    """The reconfiguration events this process took part in (empty without live
    reconfiguration)."""

    @property
    def history(self) -> list[float]:
        """The losses in iteration order."""
        return [self.losses[i] for i in sorted(self.losses)]
