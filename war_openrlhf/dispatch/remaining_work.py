"""How many turns a running trajectory has left, from its GRPO siblings.

A synchronous step lasts as long as its slowest trajectory, so a scheduler that runs the
longest first (Seer, arXiv 2511.14617: learn a group's lengths from a sibling, then longest
first) needs each trajectory's remaining work. Two predictors of a trajectory's remaining
turns, given that it is alive after ``k`` turns:

* :class:`SurvivalPrior`: the workload's survival curve alone, ``E[T - k | T > k]`` over the
  turn counts of finished trajectories (what WAR's dispatcher used so far);
* :class:`SiblingPredictor`: the samples of one prompt share its difficulty. Turn counts are
  modelled as ``T = mu_group + noise`` (between-group variance ``var_b``, within-group
  ``var_w``, fitted from finished groups by the method of moments); the group's ``mu`` is
  estimated from its finished siblings' totals and its running siblings (each known to be
  longer than ``k``: its expected total given that, a fixed-point iteration), shrunk towards
  the workload mean; the trajectory's own total is then the normal mean truncated below at
  ``k`` (it is still running). With no sibling information it is the prior with the same
  truncation.

``tools/bench_remaining_work.py`` measures both on a trace's halves (fit on the tuning tasks,
error on the validation tasks).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import numpy as np

__all__ = ["SurvivalPrior", "SiblingPredictor", "SiblingRecords", "truncated_normal_mean"]


def truncated_normal_mean(mu: float, sd: float, lower: float) -> float:
    """``E[X | X > lower]`` for ``X ~ N(mu, sd^2)``."""
    if sd <= 0:
        return max(mu, lower)
    a = (lower - mu) / sd
    tail = 0.5 * math.erfc(a / math.sqrt(2.0))  # 1 - Phi(a)
    if tail < 1e-12:  # far in the tail: the mean is just above the bound
        return lower + sd / max(a, 1e-6)
    pdf = math.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
    return mu + sd * pdf / tail


class SurvivalPrior:
    """The workload's survival curve of turn counts: the expected remaining turns of a
    trajectory alive after ``k`` turns, with no other information."""

    def __init__(self, totals: Iterable[int]) -> None:
        t = np.asarray(sorted(int(x) for x in totals), dtype=np.float64)
        if t.size == 0:
            raise ValueError("SurvivalPrior: needs the turn counts of finished trajectories")
        self.totals = t

    def remaining(self, k: int) -> float:
        alive = self.totals[self.totals > k]
        if alive.size == 0:  # longer than anything seen: one more turn at least
            return 1.0
        return float(alive.mean() - k)


class SiblingPredictor:
    """Remaining turns from the trajectory's GRPO siblings (see the module docstring)."""

    def __init__(self, mean: float, var_between: float, var_within: float) -> None:
        if var_within <= 0 or var_between < 0:
            raise ValueError(f"SiblingPredictor: variances must be positive, got between={var_between}, "
                             f"within={var_within}")
        self.mean, self.var_b, self.var_w = float(mean), float(var_between), float(var_within)

    @classmethod
    def fit(cls, groups: Mapping[str, Sequence[int]]) -> "SiblingPredictor":
        """Method of moments over finished groups (each: its members' turn counts)."""
        sizes = [len(g) for g in groups.values() if len(g) >= 2]
        if not sizes:
            raise ValueError("SiblingPredictor.fit: needs groups of at least two finished trajectories")
        within = [np.var(np.asarray(g, dtype=np.float64), ddof=1) for g in groups.values() if len(g) >= 2]
        var_w = max(float(np.mean(within)), 1e-6)
        means = np.asarray([np.mean(g) for g in groups.values() if len(g) >= 1], dtype=np.float64)
        everyone = np.concatenate([np.asarray(g, dtype=np.float64) for g in groups.values()])
        n_bar = float(np.mean(sizes))
        var_b = max(float(np.var(means, ddof=1)) - var_w / n_bar, 0.0) if means.size >= 2 else 0.0
        return cls(float(everyone.mean()), var_b, var_w)

    def group_mean(self, k: int, finished: Sequence[int], running: int, iterations: int = 8) -> tuple[float, float]:
        """The group's mean turn count and its posterior variance, from ``finished`` siblings'
        totals and ``running`` siblings alive after ``k`` turns."""
        if self.var_b <= 0:
            return self.mean, 0.0
        n = len(finished) + running
        post_var = 1.0 / (1.0 / self.var_b + n / self.var_w)
        total_finished = float(sum(finished))
        mu = self.mean
        for _ in range(iterations if running else 1):
            # a running sibling counts as its expected total given it is longer than k
            censored = running * truncated_normal_mean(mu, math.sqrt(self.var_w), k + 0.5) if running else 0.0
            mu = post_var * (self.mean / self.var_b + (total_finished + censored) / self.var_w)
        return mu, post_var

    def remaining(self, k: int, finished: Sequence[int] = (), running: int = 0) -> float:
        """Expected turns left of a trajectory alive after ``k`` turns whose group has the
        ``finished`` siblings (their totals) and ``running`` other siblings alive."""
        mu, post_var = self.group_mean(k, finished, running)
        total = truncated_normal_mean(mu, math.sqrt(self.var_w + post_var), k + 0.5)
        return max(total - k, 1.0)


class SiblingRecords:
    """A step's GRPO groups as they run (alive members and their turns, finished members'
    totals) and the predictors fitted on earlier steps' finished groups: what longest-first
    turn priorities and longest-first admission ask, a trajectory's predicted remaining turns.

    The predictors are refitted at :meth:`start_batch` from the last ``history_groups``
    finished groups; before two such groups only the survival curve answers, before any
    finished trajectory nothing does (``None``)."""

    def __init__(self, history_groups: int = 512) -> None:
        self._alive: Dict[str, Dict[str, int]] = {}  # group -> alive trajectory -> turns done
        self._finished: Dict[str, List[int]] = {}  # group -> finished members' turn counts
        self._history: deque = deque(maxlen=history_groups)  # finished groups (fit data)
        self._sib: Optional[SiblingPredictor] = None
        self._prior: Optional[SurvivalPrior] = None

    def start_batch(self) -> None:
        """A new batch: the last batch's groups become fit data, the predictors are refitted."""
        self._history.extend(self._finished.values())
        self._alive.clear()
        self._finished.clear()
        groups = {str(i): g for i, g in enumerate(self._history) if len(g) >= 2}
        totals = [t for g in self._history for t in g]
        self._prior = SurvivalPrior(totals) if totals else None
        try:
            self._sib = SiblingPredictor.fit(groups) if len(groups) >= 2 else None
        except ValueError:
            self._sib = None

    def seed(self, groups: Iterable[Sequence[int]]) -> None:
        """Fit data from elsewhere (each item: one finished group's turn counts); refits."""
        for g in groups:
            self._history.append([int(t) for t in g])
        self.start_batch()

    def state_dict(self) -> dict:
        """The finished groups the predictors are fitted on (this step's included)."""
        return {"history": [list(g) for g in self._history] + [list(g) for g in self._finished.values()]}

    def load_state_dict(self, state: dict) -> None:
        self._history.clear()
        self._finished.clear()
        self._alive.clear()
        self.seed(state.get("history", []))

    def running(self, trajectory_id: str, group_id: str, turns_done: int) -> None:
        """The trajectory is alive with ``turns_done`` turns finished (or waits to start: 0)."""
        self._alive.setdefault(group_id, {})[trajectory_id] = int(turns_done)

    def remaining(self, trajectory_id: str, group_id: str, turns_done: int) -> Optional[float]:
        """Its expected remaining turns, this one included (None: nothing to predict from)."""
        members = self._alive.get(group_id, {})
        others = len(members) - (1 if trajectory_id in members else 0)
        if self._sib is not None:
            return self._sib.remaining(turns_done, self._finished.get(group_id, ()), others)
        if self._prior is not None:
            return self._prior.remaining(turns_done)
        return None

    def finished(self, trajectory_id: str, group_id: str, turns: int) -> None:
        """A trajectory ended after ``turns`` model turns."""
        self._alive.get(group_id, {}).pop(trajectory_id, None)
        self._finished.setdefault(group_id, []).append(int(turns))
