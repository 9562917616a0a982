"""Rollouts turned into a replay workload, so that two rollout paths can be compared on the same work.

Why: a task rollout samples its text, so two runs of it generate different numbers of tokens,
turns and tool calls, and a ratio of their step times says which run drew the longest episode.
Recording one run's episodes and replaying them (every model turn forced to its recorded
length, the recorded environment text after it, the recorded tool time) gives every path the
same work while the model still samples its own text, which is what drafting acts on.

:func:`replay_rows` writes the rows ``examples/trace_replay/agent.py`` replays (the format of
``examples/trace_replay/dataset.py``): one row per GRPO group, its episodes as the trials.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Sequence

__all__ = ["replay_rows"]


def replay_rows(trajectories: Iterable[Any], decode: Callable[[Sequence[int]], str]) -> list[dict[str, str]]:
    """``{"prompt", "label"}`` rows replaying ``trajectories`` (the pool's
    :class:`~war_openrlhf.rollout.trajectory.Trajectory`: ``prompt``, ``group_id``,
    ``token_ids``, ``turns`` with ``start``/``end``/``tool_s``).

    Per episode: each turn's length (``end - start`` tokens), the environment's tokens between
    a turn and the next, decoded with ``decode`` (they are re-tokenized on replay: every path
    replays the same text), and the tool seconds after each turn (0 after the last). Episodes
    without a model turn have nothing to replay: each group's label counts them
    (``skipped_episodes``), and a group with none left raises ``ValueError`` naming it."""
    groups: dict[str, dict[str, Any]] = {}
    for t in trajectories:
        g = groups.setdefault(str(t.group_id), {"prompt": t.prompt, "trials": [], "empty": 0})
        turns = list(t.turns)
        if not turns:
            g["empty"] += 1
            continue
        lengths = [int(r.end - r.start) for r in turns]
        if min(lengths) < 1:
            raise ValueError(f"trajectory {t.trajectory_id!r}: turn of {min(lengths)} tokens (turns: {lengths})")
        observations = [decode(list(t.token_ids[a.end:b.start])) for a, b in zip(turns, turns[1:])]
        delays = [round(float(r.tool_s), 6) for r in turns[:-1]] + [0.0]
        g["trials"].append({"trial": len(g["trials"]), "lengths": lengths, "observations": observations,
                            "delays": delays, "trajectory_id": str(t.trajectory_id)})
    rows = []
    for gid, g in groups.items():
        if not g["trials"]:
            raise ValueError(f"group {gid!r}: none of its {g['empty']} episodes has a model turn to replay")
        label = {"task": gid, "trials": g["trials"], "skipped_episodes": g["empty"]}
        rows.append({"prompt": g["prompt"], "label": json.dumps(label)})
    return rows
