"""Idle engine sets stopped while another is measured (metrics/paused_engines.py), on a real busy
process."""

from __future__ import annotations

import pytest

def test_paused_processes_burn_no_cpu_and_continue_afterwards_even_on_an_error():
    """metrics/paused_engines.py: a busy process stopped for the body of ``paused`` gets no CPU
    there, and runs again after it, also when the body raised."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from war_openrlhf.metrics.paused_engines import paused

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        proc = psutil.Process(busy.pid)
        time.sleep(0.3)
        with pytest.raises(RuntimeError):
            with paused([busy.pid, 2**22 + 7]):  # a pid that does not exist is skipped
                time.sleep(0.1)
                assert proc.status() == psutil.STATUS_STOPPED
                before = sum(proc.cpu_times()[:2])
                time.sleep(0.5)
                assert sum(proc.cpu_times()[:2]) - before < 0.05
                raise RuntimeError("the run failed")
        time.sleep(0.1)
        assert proc.status() != psutil.STATUS_STOPPED
        before = sum(proc.cpu_times()[:2])
        time.sleep(0.5)
        assert sum(proc.cpu_times()[:2]) - before > 0.1  # it runs again
    finally:
        busy.send_signal(signal.SIGKILL)
        busy.wait()


def test_each_configuration_stops_the_other_engine_sets_and_never_its_own():
    """What bench_rollout stops while a configuration runs: every other engine set's processes,
    none of its own; configurations sharing one set (--same-engines) stop nothing of it."""
    from war_openrlhf.metrics.paused_engines import idle_while

    war, openrlhf, suffix = ["w0", "w1"], ["o0", "o1"], ["s0", "s1"]
    sets = {"war": war, "war_spec_on": war, "openrlhf": openrlhf, "openrlhf_vllm_suffix": suffix}
    trees = {id(war): [10, 11, 12], id(openrlhf): [20, 21], id(suffix): [30]}
    idle = idle_while(sets, trees)
    assert sorted(idle["war"]) == sorted(idle["war_spec_on"]) == [20, 21, 30]
    assert sorted(idle["openrlhf"]) == [10, 11, 12, 30] and sorted(idle["openrlhf_vllm_suffix"]) == [10, 11, 12, 20, 21]
    shared = idle_while({"war": war, "openrlhf": war}, {id(war): [10, 11]})
    assert shared == {"war": [], "openrlhf": []}
    assert idle_while(sets, {}) == dict.fromkeys(sets, [])  # --keep-idle-engines-running: nothing stopped
