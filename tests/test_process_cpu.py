"""CPU seconds by process kind: real processes named as Ray actors and vLLM's processes name
theirs, a vLLM process counted under the actor that owns it."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from war_openrlhf.metrics.process_cpu import cpu_delta, cpu_seconds_by_kind

CHILD = """
import setproctitle, subprocess, sys, time
setproctitle.setproctitle("ray::ProbeActor.run")
worker = subprocess.Popen([sys.executable, "-c",
    "import setproctitle, time; setproctitle.setproctitle('VLLM::Worker'); t = time.process_time()\\n"
    "while time.process_time() - t < 0.6: pass\\ntime.sleep(30)"])
print("ready", flush=True)
worker.wait()
"""


def test_a_vllm_process_counts_under_its_actor_and_the_driver_is_itself():
    actor = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert actor.stdout.readline().strip() == "ready"
        before = cpu_seconds_by_kind()
        t = time.process_time()
        while time.process_time() - t < 0.3:  # the driver burns CPU too
            pass
        deadline = time.time() + 20
        while time.time() < deadline:
            delta = cpu_delta(before, cpu_seconds_by_kind())
            if delta.get("ray::ProbeActor/VLLM::Worker", 0.0) > 0.3:
                break
            time.sleep(0.1)
        assert delta.get("ray::ProbeActor/VLLM::Worker", 0.0) > 0.3, delta
        assert delta.get("driver", 0.0) >= 0.25, delta
        assert "VLLM::Worker" not in delta  # always attributed to its owner
        assert all(v > 0 for v in delta.values())
    finally:
        for p in psutil.Process(actor.pid).children(recursive=True):
            p.kill()
        actor.kill()
        actor.wait()
