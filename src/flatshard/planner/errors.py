"""The one error the planner raises for bad input."""

from __future__ import annotations


class PlanError(ValueError):
    """Bad planner input. The message says what was wrong and how to fix it.

    ``problem`` and ``fix`` are kept apart so the CLI can print them on two lines.
    """

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem = problem
        self.fix = fix
