"""The live trajectories' engine, turns done and tokens, as columns.

WAR's admission model projects each engine's KV footprint from every live trajectory on it
(turns done, tokens held) after almost every turn. Read from per-trajectory objects that is a
Python loop over all live trajectories per turn: at thousands of episodes in one step it was
most of the dispatcher's time (``tools/bench_step_scale.py``). Here the three numbers live in
arrays (a finished trajectory's row is reused), so one engine's rows are one vectorised
selection, in row order.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LiveTable"]


class LiveTable:
    """Rows of (engine, turns, tokens); ``engine == -1`` marks a free row."""

    __slots__ = ("engine", "turns", "tokens", "_free")

    def __init__(self, capacity: int = 64) -> None:
        self.engine = np.full(capacity, -1, dtype=np.int64)
        self.turns = np.zeros(capacity, dtype=np.int64)
        self.tokens = np.zeros(capacity, dtype=np.float64)
        self._free = list(range(capacity - 1, -1, -1))  # lowest row first

    @property
    def rows(self) -> int:
        """Rows in use."""
        return len(self.engine) - len(self._free)

    def add(self, engine: int, turns: int, tokens: float) -> int:
        if not self._free:
            n = len(self.engine)
            self.engine = np.concatenate([self.engine, np.full(n, -1, dtype=np.int64)])
            self.turns = np.concatenate([self.turns, np.zeros(n, dtype=np.int64)])
            self.tokens = np.concatenate([self.tokens, np.zeros(n, dtype=np.float64)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._free.pop()
        self.engine[row], self.turns[row], self.tokens[row] = engine, turns, tokens
        return row

    def remove(self, row: int) -> None:
        if self.engine[row] < 0:
            raise KeyError(f"row {row} is not in use")
        self.engine[row] = -1
        self._free.append(row)

    def of_engine(self, engine: int) -> tuple[np.ndarray, np.ndarray]:
        """(turns, tokens) of the trajectories live on ``engine``, in row order."""
        mask = self.engine == engine
        return self.turns[mask], self.tokens[mask]
