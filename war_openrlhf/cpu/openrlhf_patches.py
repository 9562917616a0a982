"""The OpenRLHF 0.11.2 patches for CPU machines, applied when each module is imported.

OpenRLHF assumes CUDA: its trainer calls ``torch.cuda.*`` unconditionally, builds a
``"cuda"`` device mesh, moves tensors to ``torch.cuda.current_device()``, syncs weights
to vLLM over NCCL and defaults to flash-attention. :func:`apply_cpu_support` installs
the flash-attn stand-in (:mod:`war_openrlhf.cpu.flash_attn_shim`) and patches each of
the OpenRLHF modules in :data:`_MODULE_PATCHES`: their module-level ``torch`` becomes
the stand-in of :mod:`war_openrlhf.cpu.torch_on_cpu`, the weight-sync functions and
the engine's worker extension those of :mod:`war_openrlhf.cpu.weight_sync`, and
flash-attention defaults become SDPA.

Module patches are applied when the module is imported (a ``sys.meta_path`` hook,
:class:`_PostImportPatcher`) or at once if it already is, so calling
:func:`apply_cpu_support` early costs nothing: no OpenRLHF, vLLM or DeepSpeed import
happens here. Every patch first checks (:func:`_need`) that the module still has what
it replaces, and fails naming OpenRLHF 0.11.2 otherwise; :func:`applied_patches` lists
what was patched, one line each.
"""

from __future__ import annotations

import functools
import os
import importlib.abc
import sys
import threading
import types
from typing import Any, Callable

import torch

from ..device import CLUSTER_DEVICE_ENV, cuda_available
from .flash_attn_shim import install_flash_attn_shim
from .torch_on_cpu import _TORCH_ON_CPU, _cpu_if_cuda
from .weight_sync import CPU_WORKER_EXTENSION, _barrier_without_cuda_sync, _stateless_init_process_group_gloo

__all__ = ["OPENRLHF_WORKER_WRAP", "apply_cpu_support", "applied_patches"]

#: The worker extension OpenRLHF's ``create_vllm_engines`` gives every engine: its
#: ``WorkerWrap`` (weight sync from the trainer; CUDA and NCCL only).
OPENRLHF_WORKER_WRAP = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"

_LOCK = threading.RLock()
_STATE: dict[str, Any] = {"applied": False, "finder": None}
_APPLIED: list[str] = []
_PATCHED_MARK = "_war_cpu_patched"


def _wraps(orig: Callable) -> Callable:
    """``functools.wraps`` keeping the wrapper's own ``__module__``/``__qualname__``: with
    OpenRLHF's, cloudpickle would ship the wrapper by reference to OpenRLHF's name and a
    Ray worker would load OpenRLHF's unpatched function instead."""
    return functools.wraps(orig, assigned=("__name__", "__doc__"))


def _need(mod: types.ModuleType, *names: str) -> None:
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise RuntimeError(
            f"war_openrlhf.cpu: {mod.__name__} has no {', '.join(missing)}; these patches are written for "
            "OpenRLHF 0.11.2 - install openrlhf==0.11.2 or update war_openrlhf/cpu/openrlhf_patches.py"
        )


def _use_torch_on_cpu(mod: types.ModuleType, callers: str) -> None:
    _need(mod, "torch")
    if mod.torch is not _TORCH_ON_CPU:
        if mod.torch is not torch:
            raise RuntimeError(f"war_openrlhf.cpu: {mod.__name__}.torch is not the torch module")
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
    # DeepSpeed's config: bf16 off (float32 training, see _patch_utils) and torch's AdamW
    # instead of FusedAdam, whose CPU build is a C++ JIT compile of about a minute on first use.
    for name in ("get_ds_train_config", "get_ds_eval_config"):
        orig = getattr(strategy, name)
        if getattr(orig, _PATCHED_MARK, False):
            continue

        def float32_config(self, *args, _orig=orig, **kwargs):
            return _float32_torch_adam(_orig(self, *args, **kwargs))

        patched = _wraps(orig)(float32_config)
        setattr(patched, _PATCHED_MARK, True)
        setattr(strategy, name, patched)
    _APPLIED.append(f"{mod.__name__}.DeepspeedStrategy.get_ds_train/eval_config: bf16 off (float32), "
                    "optimizer torch AdamW instead of the JIT-built FusedAdam")


def _float32_torch_adam(ds_config: dict) -> dict:
    for key in ("bf16", "fp16"):
        if isinstance(ds_config.get(key), dict):
            ds_config[key]["enabled"] = False
    optimizer = ds_config.get("optimizer")
    if isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        optimizer.setdefault("params", {})["torch_adam"] = True
    return ds_config


#: What the trainer computes in on CPU: float32 whatever --ds.param_dtype says. CPUs
#: without bf16 matrix units run bf16 matmuls an order of magnitude slower than float32
#: (a 4 x 180-token forward+backward of the demo's 1M-parameter policy: 2.0 s against
#: 0.2 s on one core here); engines on CPU then run float32 too (engine.dtype).
CPU_TRAIN_DTYPE = torch.float32


def _cpu_train_dtype(param_dtype: str) -> torch.dtype:
    if param_dtype not in ("bf16", "fp16"):
        raise ValueError(f"--ds.param_dtype: expected bf16 or fp16, got {param_dtype!r}")
    return CPU_TRAIN_DTYPE


def _patch_utils(mod: types.ModuleType) -> None:
    # Actor / get_llm_for_sequence_regression load the model in convert_to_torch_dtype(
    # --ds.param_dtype) (imported inside the functions, so the module attribute is what runs).
    _replace_function(mod, "convert_to_torch_dtype", _cpu_train_dtype, "bf16/fp16 -> float32 on CPU")


def _no_shm_comm_op():
    return None


def _patch_deepspeed_comm(mod: types.ModuleType) -> None:
    # TorchBackend.__init__ JIT-compiles DeepSpeed's shared-memory all-reduce op on CPU (about
    # a minute of C++ on first start); it serves multi-process CPU inference all-reduce only,
    # never the trainer's gloo collectives.
    _need(mod, "build_shm_op")
    mod.build_shm_op = _no_shm_comm_op
    _APPLIED.append(f"{mod.__name__}.build_shm_op: not built (shared-memory inference all-reduce; a JIT compile)")


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
        if kwargs.get("worker_extension_cls") == OPENRLHF_WORKER_WRAP and not torch.cuda.is_available():
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
    "openrlhf.utils.utils": _patch_utils,
    "deepspeed.comm.torch": _patch_deepspeed_comm,
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


def apply_cpu_support() -> bool:
    """Apply the CPU workarounds for OpenRLHF 0.11.2 in this process.

    Returns ``False`` and changes nothing when CUDA is available or the run is a GPU run
    (:data:`~war_openrlhf.device.CLUSTER_DEVICE_ENV` is ``cuda``); otherwise installs
    the flash-attn stand-in and the module patches (now for loaded OpenRLHF modules,
    at import for the others) and returns ``True``. Idempotent and thread-safe; it is
    also Ray's ``worker_process_setup_hook`` (see
    :func:`war_openrlhf.cpu.ray_setup.ray_init_kwargs`).
    """
    if cuda_available() or os.environ.get(CLUSTER_DEVICE_ENV, "").strip().lower() == "cuda":
        return False  # a GPU run's actors that hold no GPU stay unpatched too
    with _LOCK:
        if _STATE["applied"]:
            return True
        line = install_flash_attn_shim()
        if line is not None:
            _APPLIED.append(line)
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
