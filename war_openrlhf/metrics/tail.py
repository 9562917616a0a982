"""The step's straggler in figures: how much of a rollout step its last trajectories take.

A synchronous step lasts as long as its slowest trajectory. ``tail10_share`` is the share of the
step's rollout time that passes after 90% of its trajectories have finished (the last 10%, at
least one trajectory: ``(T - f_k) / T`` with ``f`` the finish times since the batch started
sorted, ``T`` the last, ``k = max(1, floor(0.9 n))``); Seer (arXiv 2511.14617) reports tail
requests taking up to half of rollout time. ``trajectory_p99_s`` / ``p50``: trajectory wall
times (start to end of one episode).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["tail_figures"]


def tail_figures(finished_s: Sequence[float], wall_s: Sequence[float]) -> dict[str, float]:
    """``tail10_share``, ``trajectory_p99_s``, ``trajectory_p50_s`` of one batch: ``finished_s``,
    each trajectory's end in seconds since the batch started, ``wall_s`` its own duration.
    Empty input: zeros."""
    f = np.sort(np.asarray(finished_s, dtype=np.float64))
    w = np.asarray(wall_s, dtype=np.float64)
    if f.size == 0 or f[-1] <= 0:
        return {"tail10_share": 0.0, "trajectory_p99_s": 0.0, "trajectory_p50_s": 0.0}
    k = max(1, math.floor(0.9 * f.size))
    share = float((f[-1] - f[k - 1]) / f[-1])
    return {"tail10_share": share,
            "trajectory_p99_s": float(np.percentile(w, 99)) if w.size else 0.0,
            "trajectory_p50_s": float(np.percentile(w, 50)) if w.size else 0.0}
