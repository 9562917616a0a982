"""war_openrlhf.cpu: the pure-torch flash-attn padding helpers against plain
references (values and gradients), the gloo weight-sync path, and - in subprocesses, so
no patch reaches the other tests' OpenRLHF imports - that apply_cpu_support makes
OpenRLHF's PPO modules importable and CPU-safe, is idempotent, installs itself in Ray
workers, and changes nothing when CUDA is available."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from war_openrlhf import cpu
from war_openrlhf.cpu import openrlhf_patches, torch_on_cpu, weight_sync

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("WAR_TINY_MODEL_DIR", ROOT / ".cache" / "war_tiny_llama"))


# ---------------------------------------------------------------------- references
def ref_unpad(hidden, mask, unused=None):
    """Row by row: keep the tokens whose mask (or unused mask) is set."""
    batch, seqlen = mask.shape
    keep = mask.bool() if unused is None else (mask + unused).bool()
    rows, indices, lens = [], [], []
    for b in range(batch):
        n = 0
        for s in range(seqlen):
            if keep[b, s]:
                rows.append(hidden[b, s])
                indices.append(b * seqlen + s)
                n += 1
        lens.append(n)
    out = torch.stack(rows) if rows else hidden.reshape(batch * seqlen, *hidden.shape[2:])[:0]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    used = [int(mask[b].sum()) for b in range(batch)]
    return out, indices, cu, max(lens), used


def ref_pad(values, indices, batch, seqlen):
    out = torch.zeros(batch * seqlen, *values.shape[1:], dtype=values.dtype)
    for row, i in zip(values, indices):
        out[i] = row
    return out.reshape(batch, seqlen, *values.shape[1:])


@st.composite
def padded_batches(draw, with_unused=False):
    batch = draw(st.integers(1, 5))
    seqlen = draw(st.integers(1, 9))
    tail = draw(st.sampled_from([(1,), (3,), (2, 2)]))  # flash-attn needs a feature dim (OpenRLHF unsqueezes)
    bits = draw(st.lists(st.booleans(), min_size=batch * seqlen, max_size=batch * seqlen))
    mask = torch.tensor(bits, dtype=torch.long).reshape(batch, seqlen)
    mask[draw(st.integers(0, batch - 1)), draw(st.integers(0, seqlen - 1))] = 1  # at least one token
    unused = None
    if with_unused:  # allocated-but-unused slots, disjoint from the mask
        ubits = draw(st.lists(st.booleans(), min_size=batch * seqlen, max_size=batch * seqlen))
        unused = torch.tensor(ubits, dtype=torch.long).reshape(batch, seqlen) * (1 - mask)
    seed = draw(st.integers(0, 2**16))
    hidden = torch.randn(batch, seqlen, *tail, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return hidden, mask, unused


# ---------------------------------------------------------------------- bert_padding
@settings(max_examples=60, deadline=None)
@given(padded_batches(with_unused=True))
def test_unpad_input_matches_a_row_by_row_reference(data):
    hidden, mask, unused = data
    for um in (None, unused):
        out, indices, cu, maxlen, used = cpu.unpad_input(hidden, mask, um)
        r_out, r_idx, r_cu, r_max, r_used = ref_unpad(hidden, mask, um)
        assert torch.equal(out, r_out)
        assert indices.tolist() == r_idx and indices.dtype == torch.long
        assert cu.tolist() == r_cu and cu.dtype == torch.int32
        assert maxlen == r_max and isinstance(maxlen, int)
        assert used.tolist() == r_used and used.dtype == torch.int32


def test_unpad_input_like_flash_attn_rejects_inputs_without_a_feature_dim():
    with pytest.raises(AssertionError, match="at least 2 dims"):
        cpu.unpad_input(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.long))


@settings(max_examples=60, deadline=None)
@given(padded_batches())
def test_pad_input_inverts_unpad_and_zeroes_padding(data):
    hidden, mask, _ = data
    batch, seqlen = mask.shape
    out, indices, *_ = cpu.unpad_input(hidden, mask)
    padded = cpu.pad_input(out, indices, batch, seqlen)
    assert torch.equal(padded, ref_pad(out, indices.tolist(), batch, seqlen))
    expect = hidden * mask.reshape(batch, seqlen, *([1] * (hidden.ndim - 2)))
    assert torch.equal(padded, expect)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.sampled_from([(1,), (3,), (2, 3)]), st.data())
def test_index_first_axis_and_index_put_match_indexing_with_gradients(rows, tail, data):
    idx = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows, unique=True))
    indices = torch.tensor(idx)
    x = torch.randn(rows, *tail, dtype=torch.float64, requires_grad=True)
    w = torch.randn(len(idx), *tail, dtype=torch.float64)
    ours = cpu.index_first_axis(x, indices)
    assert torch.equal(ours, x[indices])
    (g,) = torch.autograd.grad((ours * w).sum(), x)
    (g_ref,) = torch.autograd.grad((x[indices] * w).sum(), x)
    assert torch.equal(g, g_ref)

    v = torch.randn(len(idx), *tail, dtype=torch.float64, requires_grad=True)
    put = cpu.index_put_first_axis(v, indices, rows)
    ref = torch.zeros(rows, *tail, dtype=torch.float64).index_copy(0, indices, v)
    assert torch.equal(put, ref)
    w2 = torch.randn(rows, *tail, dtype=torch.float64)
    (gv,) = torch.autograd.grad((put * w2).sum(), v)
    (gv_ref,) = torch.autograd.grad((ref * w2).sum(), v)
    assert torch.equal(gv, gv_ref)


def test_index_first_axis_residual_returns_the_input_and_adds_both_gradients():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    indices = torch.tensor([4, 0, 2])
    out, residual = cpu.index_first_axis_residual(x, indices)
    assert torch.equal(out, x[indices]) and torch.equal(residual, x.detach())
    w1, w2 = torch.randn(3, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    (g,) = torch.autograd.grad((out * w1).sum() + (residual * w2).sum(), x)
    expect = w2.clone()
    expect[indices] += w1
    assert torch.allclose(g, expect)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.data())
def test_unpad_for_concatenated_sequences_matches_a_reference(batch, seqlen, data):
    lengths = []
    for _ in range(batch):  # each row: packed sample lengths then zeros, total <= seqlen
        row, room = [], seqlen
        while room and data.draw(st.booleans()):
            n = data.draw(st.integers(1, room))
            row.append(n)
            room -= n
        lengths.append(row or [1])
    mask_in_length = torch.zeros(batch, seqlen, dtype=torch.int32)
    for b, row in enumerate(lengths):
        mask_in_length[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    hidden = torch.randn(batch, seqlen, 2, dtype=torch.float64)
    out, indices, cu, maxlen = cpu.unpad_input_for_concatenated_sequences(hidden, mask_in_length)
    ref_idx = [b * seqlen + s for b, row in enumerate(lengths) for s in range(sum(row))]
    ref_cu = [0]
    for row in lengths:
        for n in row:
            ref_cu.append(ref_cu[-1] + n)
    assert indices.tolist() == ref_idx
    assert cu.tolist() == ref_cu and maxlen == max(n for row in lengths for n in row)
    assert torch.equal(out, hidden.reshape(batch * seqlen, 2)[ref_idx])


# ---------------------------------------------------------------------- weight sync over gloo
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _run_ranks(fns):
    errors, threads = [], []

    def wrap(fn):
        try:
            fn()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    for fn in fns:
        threads.append(threading.Thread(target=wrap, args=(fn,)))
        threads[-1].start()
    for t in threads:
        t.join(60)
    assert not errors, errors


class _FakeWorker(SimpleNamespace):
    """The vLLM worker attributes CpuWorkerWrap uses."""

    def reload_weights(self, weights_iterator=None, is_checkpoint_format=True):
        self.reloads.append((list(weights_iterator), is_checkpoint_format))


def test_cpu_worker_extension_receives_weights_over_gloo_and_reloads_them_at_the_last_one():
    """The trainer's side (rank 0, GlooBroadcastGroup as stateless_init_process_group
    returns it) broadcasts two parameters as OpenRLHF's broadcast_to_vllm does
    (empty_cache=True on the last), one in float32 (the CPU trainer's dtype) and one in
    bf16; CpuWorkerWrap.update_weight receives each in the dtype it was sent (another size
    would hang the broadcast) and hands both, in the engine's bf16, to vLLM's reload_weights
    once, after the last."""
    port = _free_port()
    params = {"q": torch.randn(4, 6), "k": torch.randn(3).to(torch.bfloat16)}
    worker = _FakeWorker(model_config=SimpleNamespace(dtype=torch.bfloat16), _model_update_with_ray=False, reloads=[])
    after_first = []

    def trainer():
        group = weight_sync._stateless_init_process_group_gloo("127.0.0.1", port, 0, 2, device=torch.device("cpu"))
        for p in params.values():
            group.broadcast(p, src=0, stream=None)

    def engine():
        worker._model_update_group = cpu.GlooBroadcastGroup("127.0.0.1", port, 1, 2)
        cpu.CpuWorkerWrap.update_weight(worker, "q", torch.float32, params["q"].shape, empty_cache=False)
        after_first.append(len(worker.reloads))
        cpu.CpuWorkerWrap.update_weight(worker, "k", torch.bfloat16, params["k"].shape, empty_cache=True)

    _run_ranks([trainer, engine])
    assert after_first == [0] and len(worker.reloads) == 1
    loaded, checkpoint_format = worker.reloads[0]
    assert checkpoint_format is True and [name for name, _ in loaded] == ["q", "k"]
    for name, tensor in loaded:
        assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
        assert torch.equal(tensor, params[name].to(torch.bfloat16))
    assert worker._war_pending_weights == []
    with pytest.raises(RuntimeError, match="update_weight_cuda_ipc: CUDA IPC handles need CUDA"):
        cpu.CpuWorkerWrap.update_weight_cuda_ipc(worker, "w", torch.bfloat16, (2,))
    with pytest.raises(ValueError, match="GlooBroadcastGroup.rank: 3 is outside world_size=2"):
        cpu.GlooBroadcastGroup("127.0.0.1", port, 3, 2)


def test_torch_stand_in_maps_cuda_to_cpu_and_keeps_everything_else():
    t = torch_on_cpu._TORCH_ON_CPU
    assert t.device(f"cuda:{t.cuda.current_device()}") == torch.device("cpu")
    assert t.device("cuda") == torch.device("cpu") and t.device(0) == torch.device("cpu")
    assert t.device("cpu") == torch.device("cpu") and t.device("meta").type == "meta"
    assert isinstance(torch.device("cpu"), t.device)
    assert t.tensor([1], device=t.cuda.current_device()).device.type == "cpu"
    assert t.cuda.synchronize() is None and t.cuda.empty_cache() is None and t.cuda.set_device(0) is None
    with t.cuda.stream(t.cuda.Stream()):
        pass
    assert t.cuda.current_stream() is None and t.cuda.memory_allocated() == 0
    assert t.cuda.is_available() is torch.cuda.is_available()
    assert t.Tensor is torch.Tensor and t.no_grad is torch.no_grad
    import pickle

    assert pickle.loads(pickle.dumps(t)) is t  # Ray ships it by value: the stand-in comes back


def test_rollout_actor_init_swaps_in_the_cpu_worker_extension_only_without_cuda(monkeypatch):
    import asyncio

    seen = {}

    async def openrlhf_init(self, *args, **kwargs):
        seen.clear()
        seen.update(kwargs)

    init = openrlhf_patches._rollout_actor_init(openrlhf_init)
    asyncio.run(init(object(), model="m", worker_extension_cls=cpu.OPENRLHF_WORKER_WRAP, seed=3))
    assert seen == {"model": "m", "worker_extension_cls": cpu.CPU_WORKER_EXTENSION, "seed": 3}
    asyncio.run(init(object(), worker_extension_cls="my.Ext"))
    assert seen == {"worker_extension_cls": "my.Ext"}  # someone else's extension is left alone
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asyncio.run(init(object(), worker_extension_cls=cpu.OPENRLHF_WORKER_WRAP))
    assert seen == {"worker_extension_cls": cpu.OPENRLHF_WORKER_WRAP}


# ---------------------------------------------------------------------- Ray arguments
def test_ray_init_kwargs_declare_logical_gpus_and_the_setup_hook(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kw = cpu.ray_init_kwargs(num_gpus=3, runtime_env={"env_vars": {"A": "1"}})
    assert kw == {"num_gpus": 3, "runtime_env": {"env_vars": {"A": "1"},
                                                  "worker_process_setup_hook": cpu.SETUP_HOOK}}
    assert cpu.ray_init_kwargs()["num_gpus"] == (os.cpu_count() or 1)
    with pytest.raises(ValueError, match=r"ray_init_kwargs.num_gpus: must be an int >= 1"):
        cpu.ray_init_kwargs(num_gpus=0)
    with pytest.raises(ValueError, match=r"worker_process_setup_hook is already 'x.y'"):
        cpu.ray_init_kwargs(runtime_env={"worker_process_setup_hook": "x.y"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu.ray_init_kwargs() == {}
    assert cpu.ray_init_kwargs(runtime_env={"env_vars": {"A": "1"}}) == {"runtime_env": {"env_vars": {"A": "1"}}}


# ---------------------------------------------------------------------- apply (subprocesses)
def _run_python(code: str, timeout: int = 240) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line prefixed ``RESULT``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(ROOT))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


PPO_MODULES = [
    "openrlhf.models.actor",
    "openrlhf.models.model",
    "openrlhf.trainer.ppo_utils.experience_maker",
    "openrlhf.trainer.ppo_utils.replay_buffer",
    "openrlhf.trainer.ppo_utils.samples_generator",
    "openrlhf.trainer.ray.ppo_actor",
    "openrlhf.trainer.ray.ppo_critic",
    "openrlhf.trainer.ray.launcher",
    "openrlhf.trainer.ray.vllm_engine",
    "openrlhf.trainer.ray.vllm_worker_wrap",
    "openrlhf.trainer.ppo_trainer",
    "openrlhf.trainer.ppo_trainer_async",
    "openrlhf.cli.train_ppo_ray",
]


def test_openrlhf_ppo_modules_import_and_run_their_cuda_paths_on_cpu_after_apply():
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(MODEL_DIR)
    code = f"""
import importlib, json, sys, torch
from war_openrlhf.cpu import apply_cpu_support, applied_patches, CPU_WORKER_EXTENSION
applied = apply_cpu_support()
mods = {PPO_MODULES!r}
for m in mods:
    importlib.import_module(m)
import openrlhf.trainer.ppo_utils.replay_buffer as rb
import openrlhf.trainer.ray.ppo_actor as pa
import openrlhf.utils.deepspeed.deepspeed as ds
import openrlhf.utils.distributed_util as du
from openrlhf.models import Actor
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
from flash_attn.bert_padding import pad_input, unpad_input
import transformers.utils.import_utils as iu
buf = rb.NaiveReplayBuffer(2)
pa.torch.cuda.synchronize(); pa.torch.cuda.empty_cache(); ds.torch.cuda.set_device(0)
mesh_type = None
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
mesh = ds.init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("dp", "sp", "tp"))
du.torch_dist_barrier_and_cuda_sync()
actor = Actor({str(model)!r})  # default attn_implementation="flash_attention_2"
import inspect, ray.cloudpickle as cloudpickle
shipped = cloudpickle.loads(cloudpickle.dumps(RolloutRayActor.__ray_metadata__.modified_class))  # as Ray ships it
init = shipped.__init__
print("RESULT " + json.dumps(dict(
    applied=applied,
    patches=applied_patches(),
    target_device=str(buf.target_device),
    mesh_device=mesh.device_type,
    attn=actor.model.config._attn_implementation,
    barrier_rebound=pa.torch_dist_barrier_and_cuda_sync is du.torch_dist_barrier_and_cuda_sync
                    and ds.torch_dist_barrier_and_cuda_sync is du.torch_dist_barrier_and_cuda_sync,
    sync_group=pa.stateless_init_process_group.__name__,
    shim=pad_input.__module__,
    fa2_available=iu.is_flash_attn_2_available(),
    torch_cuda_untouched=torch.cuda.synchronize.__module__,
    rollout_init=[init.__module__, inspect.unwrap(init).__module__],
)))
"""
    out = _run_python(code)
    assert out["applied"] is True
    assert out["target_device"] == "cpu" and out["mesh_device"] == "cpu"
    assert out["attn"] == "sdpa"
    assert out["barrier_rebound"] and out["sync_group"] == "_stateless_init_process_group_gloo"
    assert out["shim"] == "war_openrlhf.cpu.flash_attn_shim" and out["fa2_available"] is False
    assert out["torch_cuda_untouched"] == "torch.cuda"  # the real torch.cuda is never patched
    # the class Ray ships to the engine actor carries the patched __init__ around OpenRLHF's
    assert out["rollout_init"] == ["war_openrlhf.cpu.openrlhf_patches", "openrlhf.trainer.ray.vllm_engine"]
    targets = {p.split(":")[0] for p in out["patches"]}
    assert {"flash_attn", "openrlhf.trainer.ppo_utils.replay_buffer", "openrlhf.trainer.ray.ppo_actor",
            "openrlhf.utils.deepspeed.deepspeed", "openrlhf.trainer.ray.launcher", "openrlhf.trainer.ray.ppo_critic",
            "openrlhf.utils.distributed_util.torch_dist_barrier_and_cuda_sync",
            "openrlhf.trainer.ray.vllm_engine.RolloutRayActor.__init__"} <= targets


def test_apply_is_idempotent_and_patches_modules_imported_before_it():
    code = """
import json, sys
import openrlhf.utils.distributed_util as du          # imported before apply: patched at once
from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync as early
from war_openrlhf import cpu as cs
from war_openrlhf.cpu.torch_on_cpu import _TORCH_ON_CPU
first = cs.apply_cpu_support()
second = cs.apply_cpu_support()
import openrlhf.trainer.ppo_utils.replay_buffer       # imported after: patched on import
third = cs.apply_cpu_support()
finders = [f for f in sys.meta_path if type(f).__name__ == "_PostImportPatcher"]
print("RESULT " + json.dumps(dict(
    calls=[first, second, third], patches=cs.applied_patches(), finders=len(finders),
    patched_now=du.torch_dist_barrier_and_cuda_sync.__name__,
    replay=sys.modules["openrlhf.trainer.ppo_utils.replay_buffer"].torch is _TORCH_ON_CPU,
)))
"""
    out = _run_python(code)
    assert out["calls"] == [True, True, True]
    assert out["finders"] == 1
    assert out["patched_now"] == "_barrier_without_cuda_sync" and out["replay"]
    assert len(out["patches"]) == len(set(out["patches"]))  # nothing applied twice
    assert sum(p.startswith("openrlhf.trainer.ppo_utils.replay_buffer") for p in out["patches"]) == 1


def test_cpu_training_runs_float32_with_torch_adamw_and_builds_no_jit_ops():
    """bf16 matmuls are ~10x slower than float32 on CPUs without bf16 units, and DeepSpeed's
    FusedAdam and shared-memory all-reduce are C++ JIT builds of a minute each on first
    start: on CPU the trainer loads and trains float32 with torch's AdamW and builds neither."""
    code = """
import json
from types import SimpleNamespace as NS
from war_openrlhf.cpu import apply_cpu_support, applied_patches
apply_cpu_support()
import sys
import deepspeed.comm.torch  # noqa: F401  (deepspeed.comm.torch the attribute is torch itself)
dct = sys.modules["deepspeed.comm.torch"]
import openrlhf.utils.deepspeed.deepspeed as ds
from openrlhf.utils.utils import convert_to_torch_dtype
import openrlhf.models.actor  # noqa: F401  (imports convert_to_torch_dtype inside Actor.__init__)
me = NS(adam_offload=False, stage=0, param_dtype="bf16", max_norm=1.0, zpg=1, grad_accum_dtype=None,
        overlap_comm=False, use_ds_universal_ckpt=False, deepcompile=False, ds_tensor_parallel_size=1,
        use_dynamic_batch=False, micro_train_batch_size=2, train_batch_size=4, ring_attn_size=1)
optim = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}}
train = ds.DeepspeedStrategy.get_ds_train_config(me, optim, max_norm=1.0)
evalc = ds.DeepspeedStrategy.get_ds_eval_config(me)
print("RESULT " + json.dumps(dict(
    dtype=str(convert_to_torch_dtype("bf16")), fp16=str(convert_to_torch_dtype("fp16")),
    train_bf16=train["bf16"]["enabled"], eval_bf16=evalc["bf16"]["enabled"],
    torch_adam=train["optimizer"]["params"].get("torch_adam"), lr=train["optimizer"]["params"]["lr"],
    shm=dct.build_shm_op(), patches=applied_patches())))
"""
    out = _run_python(code)
    assert out["dtype"] == out["fp16"] == "torch.float32"
    assert out["train_bf16"] is False and out["eval_bf16"] is False
    assert out["torch_adam"] is True and out["lr"] == 1e-3  # the user's optimizer settings kept
    assert out["shm"] is None
    assert any(p.startswith("deepspeed.comm.torch.build_shm_op") for p in out["patches"])


def test_apply_is_a_no_op_when_cuda_is_available():
    code = """
import json, sys, torch
torch.cuda.is_available = lambda: True
from war_openrlhf import cpu as cs
result = cs.apply_cpu_support()
import openrlhf.trainer.ppo_utils.replay_buffer as rb
import openrlhf.utils.distributed_util as du
import importlib.util
print("RESULT " + json.dumps(dict(
    result=result, patches=cs.applied_patches(), flash_attn="flash_attn" in sys.modules,
    finders=sum(type(f).__name__ == "_PostImportPatcher" for f in sys.meta_path),
    replay_torch_is_torch=rb.torch is torch, barrier=du.torch_dist_barrier_and_cuda_sync.__name__,
    ray_kwargs=cs.ray_init_kwargs(), flash_attn_findable=importlib.util.find_spec("flash_attn") is not None,
)))
"""
    out = _run_python(code)
    assert out == dict(result=False, patches=[], flash_attn=False, finders=0, replay_torch_is_torch=True,
                       barrier="torch_dist_barrier_and_cuda_sync", ray_kwargs={}, flash_attn_findable=False)


def test_ray_workers_get_the_patches_and_gpu_bundles_schedule_on_cpu():
    """ray.init(**ray_init_kwargs()): a num_gpus=1 actor and a {"GPU": 1, "CPU": 1}
    placement group (what OpenRLHF requests) schedule, and the worker process has the
    patches from the setup hook, including for an actor with its own env_vars."""
    code = """
import json, sys, ray
from ray.util.placement_group import placement_group
from war_openrlhf.cpu import apply_cpu_support, ray_init_kwargs
apply_cpu_support()
ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, **ray_init_kwargs(num_gpus=3))
@ray.remote(num_gpus=1)
class Probe:
    def state(self):
        import openrlhf.trainer.ppo_utils.replay_buffer as rb
        from war_openrlhf.cpu import openrlhf_patches, torch_on_cpu
        return dict(applied=openrlhf_patches._STATE["applied"], flash_attn="flash_attn" in sys.modules,
                    replay=rb.torch is torch_on_cpu._TORCH_ON_CPU, gpus=len(ray.get_gpu_ids()))
pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK")
ready = ray.get(pg.ready(), timeout=60) is not None
a = Probe.remote()
b = Probe.options(runtime_env={"env_vars": {"WAR_PROBE": "1"}}).remote()
out = dict(ready=ready, plain=ray.get(a.state.remote(), timeout=120), own_env=ray.get(b.state.remote(), timeout=120))
ray.shutdown()
print("RESULT " + json.dumps(out))
"""
    out = _run_python(code)
    assert out["ready"]
    assert out["plain"] == dict(applied=True, flash_attn=True, replay=True, gpus=1)
    assert out["own_env"] == out["plain"]


TRAIN_AGENT = """
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turns = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turns += 1
        # continuous, so that a GRPO group's advantages are almost never all zero (a parity
        # reward tied a 2-sample group half the time and the test then saw no update)
        reward = torch.tensor(len(states["action_text"]) / 100.0)
        return {"rewards": reward, "scores": reward, "environment_feedback": " ok ", "done": self.turns >= 2,
                "sampling_params": states.get("sampling_params")}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


@pytest.mark.timeout(600)  # two PPO steps through OpenRLHF's Ray trainer
def test_openrlhfs_ray_ppo_trainer_runs_two_steps_on_cpu(tmp_path):
    """OpenRLHF's own train_ppo_ray entry point, unchanged, after apply_cpu_support and
    ray.init(**ray_init_kwargs()): a policy actor (DeepSpeed ZeRO-1 on gloo), one vLLM
    engine from create_vllm_engines, a 2-turn agent, 2 training steps, weight sync to
    the engine after each (over gloo, reloaded in place), and the trained model saved."""
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(MODEL_DIR)
    (tmp_path / "agent_func.py").write_text(TRAIN_AGENT)
    with open(tmp_path / "prompts.jsonl", "w") as fh:
        for i in range(4):
            fh.write(json.dumps({"input": f"<|im_start|>user\nWhat is {i} + {3 * i}?<|im_end|>\n"
                                          "<|im_start|>assistant\n", "label": str(4 * i)}) + "\n")
    out = tmp_path / "out"
    argv = [
        "train_ppo_ray", "--actor.model_name_or_path", str(model), "--actor.num_nodes", "1",
        "--actor.num_gpus_per_node", "1", "--algo.kl.init_coef", "0", "--vllm.num_engines", "1",
        "--vllm.tensor_parallel_size", "1", "--vllm.enforce_eager", "--vllm.enable_prefix_caching",
        "--train.agent_func_path", str(tmp_path / "agent_func.py"), "--algo.advantage.estimator", "group_norm",
        "--data.prompt_dataset", str(tmp_path / "prompts.jsonl"), "--data.input_key", "input",
        "--data.label_key", "label", "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2",
        "--train.batch_size", "4", "--train.micro_batch_size", "2", "--rollout.micro_batch_size", "2",
        "--data.max_len", "96", "--rollout.max_new_tokens", "32", "--ds.zero_stage", "1",
        "--actor.adam.lr", "1e-2", "--actor.lr_warmup_ratio", "0",
        "--ckpt.output_dir", str(out), "--ckpt.path", str(tmp_path / "ckpt"),
    ]
    code = f"""
import json, runpy, sys, time, ray
from war_openrlhf.cpu import apply_cpu_support, applied_patches, ray_init_kwargs
apply_cpu_support()
ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
         **ray_init_kwargs(num_gpus=4, runtime_env={{"env_vars": {{"VLLM_CPU_KVCACHE_SPACE": "1"}}}}))
sys.argv = {argv!r}
t0 = time.time()
runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
print("RESULT " + json.dumps(dict(seconds=time.time() - t0, patches=applied_patches())))
"""
    result = _run_python(code, timeout=420)
    from safetensors.torch import load_file

    trained, initial = load_file(str(out / "model.safetensors")), load_file(str(model / "model.safetensors"))
    assert set(trained) == set(initial)
    changed = [k for k in trained if not torch.equal(trained[k], initial[k].to(trained[k].dtype))]
    assert changed, "the saved policy equals the initial one: no optimizer step happened"
    assert any("RolloutRayActor" in p for p in result["patches"])


# ---------------------------------------------------------------------- coverage of OpenRLHF's CUDA calls
def test_every_openrlhf_module_calling_torch_cuda_is_patched_or_accounted_for():
    """A new OpenRLHF version that adds torch.cuda calls elsewhere fails here by name."""
    import importlib.util

    spec = importlib.util.find_spec("openrlhf")
    root = Path(spec.origin).parent
    # Handled without a module patch, and why:
    accounted = {
        # replaced by CpuWorkerWrap inside the engine (RolloutRayActor patch)
        "openrlhf.trainer.ray.vllm_worker_wrap",
        # get_physical_gpu_id: CUDA-IPC weight sync only, off once sync_backend is gloo
        "openrlhf.trainer.ray.utils",
        # already guarded: torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        "openrlhf.utils.loss_utils",
    }
    callers = set()
    for path in root.rglob("*.py"):
        text = path.read_text()
        if re.search(r"torch\.cuda\.|init_device_mesh\(\s*\"cuda\"|device=\"cuda\"", text):
            callers.add(".".join(path.relative_to(root.parent).with_suffix("").parts))
    missing = sorted(callers - set(openrlhf_patches._MODULE_PATCHES) - accounted)
    assert not missing, f"OpenRLHF modules calling CUDA without a CPU patch: {missing}"
