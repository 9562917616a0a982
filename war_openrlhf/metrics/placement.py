"""Where a step's GRPO groups started: how many engines each group's samples began on.

Samples of one prompt run to similar lengths, so a group whose samples all start on one engine
adds a whole group's work to that engine: the engines' loads then differ by groups, and the step
waits for the engine with the long ones. ``group_engines`` is the mean, over groups, of the
number of distinct engines their first turns went to, and ``group_engines_max`` what that
number can be (a group's size, at most the engine count). Trajectories without turns (refused
before their first) are left out.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["group_engines"]


def group_engines(trajectories: Iterable[Any], num_engines: int) -> dict[str, float]:
    """``group_engines`` and ``group_engines_max`` of one batch (``group_id`` and ``turns``
    with ``engine`` per trajectory, as :class:`~war_openrlhf.rollout.trajectory.Trajectory`);
    zeros for a batch without turns."""
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    first: dict[str, list[int]] = {}
    for t in trajectories:
        if t.turns:
            first.setdefault(t.group_id, []).append(int(t.turns[0].engine))
    if not first:
        return {"group_engines": 0.0, "group_engines_max": 0.0}
    spans = [len(set(engines)) for engines in first.values()]
    caps = [min(len(engines), num_engines) for engines in first.values()]
    return {"group_engines": sum(spans) / len(spans), "group_engines_max": sum(caps) / len(caps)}
