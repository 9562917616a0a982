"""tools/bench_step_scale.py refuses bad arguments before any engine starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_step_scale  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--episodes", "0"], "--episodes: must be >= 1"),
    (["--episodes", "100", "--group", "8"], "must be a multiple of --group"),
    (["--agent-runners", "thread,process"], "--agent-runners: \\['process'\\] not among thread, loop"),
    (["--agent-runners", ","], "--agent-runners: empty"),
])
def test_bad_arguments_are_refused_by_name(argv, message, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray started before the arguments were checked"))
    with pytest.raises(SystemExit, match=message):
        bench_step_scale.main(argv)
