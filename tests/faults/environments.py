"""An environment that breaks on purpose (imported by name by the faults tier)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from unirl.rollouts.environments.hidden_number import HiddenNumber


class Breaks(HiddenNumber):
    """The hidden-number tool, which raises (``how: raise``) or hangs (``how: hang``) at every
    step while the file ``flag`` exists."""

    def __init__(self, *, flag: str, how: str, **options: Any) -> None:
        super().__init__(**options)
        self.flag, self.how = Path(flag), how

    def step(self, turn: Any) -> Any:
        if self.flag.exists():
            if self.how == "raise":
                raise ValueError("the tool broke")
            time.sleep(60)
        return super().step(turn)
