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
