"""The kernel's nbtool state: one Session, owned by the magics instance (no module globals)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Session:
    """What this kernel remembers between cells."""

    # recorded runs by name: a later run of the same line takes over its name, unless it never called
    # strategy.prepare and the earlier one did; a run of another line keeps its own (actions.run.run_name)
    runs: dict = field(default_factory=dict)
    last: object = None  # the newest RunRecords, failed runs included (for inspection)
    commbench: object = None  # the last CommbenchResult, whose link fit the planner uses
    # (Hardware, its run's name, that run): links and compute rate calibrated on the latest good run
    calibration: tuple | None = None
    versus: dict = field(default_factory=dict)  # run name -> its Versus, predicted before it was calibrated on
    advice: list = field(default_factory=list)  # nbtool.plan.advice.Suggestion of the latest run
