"""Reading back the scalars a run wrote to TensorBoard.

One reader for every consumer (``war-summary``, the long-run, resume and soak tools, the
training tests), so that they agree on what a run logged: every scalar under a log directory's
event files, by its tag as written, with every (step, value) point, all kept (no sampling).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["read_scalars"]


def read_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` over every ``events.out.tfevents.*`` file under ``logdir``
    (files in name order, points sorted by step, stably); ``{}`` when there are none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})  # 0: keep every point
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, []).extend((int(e.step), float(e.value)) for e in acc.Scalars(tag))
    for points in out.values():
        points.sort(key=lambda p: p[0])
    return out
