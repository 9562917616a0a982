"""The GPU path's contracts, checked on CPU: what WAR hands vLLM and Ray for OpenRLHF's
colocated, tensor-parallel and sleeping engines, every ``create_vllm_engines`` argument
honoured or refused, and the run's device decided by the cluster, not by an actor.

Each test is named after its contract (``colocate``, ``tensor_parallel``, ``sleep``,
``async_weight_sync`` (in test_rollout_pool.py), ``cluster_device``), so that
``pytest -k colocate`` runs one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from war_openrlhf.engine.config import EngineConfig, check_startup
from war_openrlhf.engine.rpc import WAR_OPENRLHF_WORKER_EXTENSION
from war_openrlhf.engine.launch import device_env_for_engine, gpu_engine_placement, vllm_engine_kwargs
from war_openrlhf.rollout import RolloutConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir():
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    return build_tiny_model(ROOT / ".cache" / "war_tiny_model")


def _settings(**kw):
    from war_openrlhf.integrations.openrlhf import engine_settings

    base = dict(pretrain="/m", seed=3, max_model_len=1024, enforce_eager=True)
    return engine_settings(RolloutConfig(), **{**base, **kw})


# ------------------------------------------------------------------ tensor parallel
def test_tensor_parallel_engine_gets_vllms_ray_executor_on_its_bundles():
    cfg = _settings(tensor_parallel_size=2, gpu_memory_utilization=0.6)
    args = vllm_engine_kwargs(cfg, cuda=True, openrlhf_worker=True)
    assert args["tensor_parallel_size"] == 2 and args["distributed_executor_backend"] == "ray"
    assert args["gpu_memory_utilization"] == 0.6 and args["seed"] == 3
    assert args["worker_extension_cls"] == WAR_OPENRLHF_WORKER_EXTENSION  # OpenRLHF's weight sync + WAR's hook
    one = vllm_engine_kwargs(_settings(), cuda=True)
    assert one["distributed_executor_backend"] == "uni" and one["tensor_parallel_size"] == 1
    # as OpenRLHF: the actor holds no GPU, vLLM's workers take bundles 2k, 2k+1 of engine k
    options, env = gpu_engine_placement(1, 2, colocated=False)
    assert options == {"num_cpus": 0, "num_gpus": 0, "bundle_index": 2}
    assert env == {"VLLM_RAY_PER_WORKER_GPUS": "1", "VLLM_RAY_BUNDLE_INDICES": "2,3"}
    options, env = gpu_engine_placement(0, 2, colocated=True, bundle_indices=[4, 5])
    assert options["bundle_index"] == 4 and env["VLLM_RAY_PER_WORKER_GPUS"] == "0.2"
    with pytest.raises(ValueError, match="bundle_indices: 1 bundles for tensor_parallel_size 2"):
        gpu_engine_placement(0, 2, colocated=False, bundle_indices=[0])
    # vLLM's Ray workers choose their devices: the engine process must not pin one
    assert device_env_for_engine(2, {"CUDA_VISIBLE_DEVICES": "0"}, [0]) == {
        "CUDA_VISIBLE_DEVICES": None, "ROCR_VISIBLE_DEVICES": None, "HIP_VISIBLE_DEVICES": None}


def test_tensor_parallel_on_cpu_is_refused_with_the_reason(model_dir):
    cfg = EngineConfig(model=str(model_dir), dtype="float32", max_model_len=512, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 on CPU"):
        check_startup(cfg, cuda=False)
    with pytest.raises(ValueError, match="tensor_parallel_size: must be an int >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_noset_visible_devices_pins_the_gpu_ray_gave_the_engine():
    """RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: Ray leaves CUDA_VISIBLE_DEVICES alone, so
    the engine pins its GPU itself (OpenRLHF's RolloutRayActor._configure_device_env)."""
    assert device_env_for_engine(1, {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, [3]) == {
        "CUDA_VISIBLE_DEVICES": "3"}
    assert device_env_for_engine(1, {}, [3]) == {}


# ------------------------------------------------------------------ colocate
def test_colocate_puts_engines_on_the_shared_group_with_a_fraction_of_a_gpu():
    options, env = gpu_engine_placement(1, 1, colocated=True)
    assert options == {"num_cpus": 0.2, "num_gpus": 0.2, "bundle_index": 1} and env == {}
    options, _ = gpu_engine_placement(1, 1, colocated=False)
    assert options["num_gpus"] == 1


_COLOCATE_SCRIPT = textwrap.dedent("""
    import json, ray
    from ray.util.placement_group import placement_group
    from war_openrlhf.device import detect_cluster_device
    from war_openrlhf.engine.actors import engine_actor_placement
    from war_openrlhf.engine.config import EngineConfig

    ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    out = {"device": detect_cluster_device()}  # logical GPUs of a CPU cluster are not CUDA
    # OpenRLHF's colocated group: one {"GPU": 1, "CPU": 1} bundle per GPU, the trainer's
    # actors take 0.2 GPU of each; WAR engines must land on the same bundles
    pg = placement_group([{"GPU": 1, "CPU": 1}] * 2, strategy="PACK")
    ray.get(pg.ready())

    @ray.remote
    class Probe:
        def where(self):
            ctx = ray.get_runtime_context()
            return ctx.get_placement_group_id(), ray.get_gpu_ids()

    trainer = [Probe.options(num_cpus=0.2, num_gpus=0.2, scheduling_strategy=ray.util.scheduling_strategies
               .PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)).remote()
               for i in range(2)]
    cfg = EngineConfig(model="/m")
    engines = []
    for i in range(2):
        opts = engine_actor_placement(i, cfg, cuda=True, pg=pg, colocated=True)
        opts.pop("max_concurrency"); opts.pop("runtime_env")
        out.setdefault("options", []).append({"num_gpus": opts["num_gpus"],
            "bundle": opts["scheduling_strategy"].placement_group_bundle_index})
        engines.append(Probe.options(**opts).remote())
    where = ray.get([a.where.remote() for a in trainer + engines], timeout=60)
    out["groups"] = sorted({w[0] for w in where})
    out["pg"] = pg.id.hex()
    out["gpus"] = [w[1] for w in where]
    print("RESULT " + json.dumps(out))
""")


def test_colocate_engines_share_the_trainers_gpus_on_a_logical_gpu_cluster():
    """On Ray with logical GPUs: the trainer's actors and the engines (as WAR places them with
    OpenRLHF's shared placement group) all fit on the group's two bundles, 0.2 GPU each,
    engine i on bundle i next to trainer rank i; the run's device is ``cpu``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("WAR_CLUSTER_DEVICE", None)
    proc = subprocess.run([sys.executable, "-c", _COLOCATE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    out = json.loads(line[0][len("RESULT "):])
    assert out["device"] == "cpu"
    assert out["options"] == [{"num_gpus": 0.2, "bundle": 0}, {"num_gpus": 0.2, "bundle": 1}]
    assert out["groups"] == [out["pg"]]
    assert out["gpus"][2] == out["gpus"][0] and out["gpus"][3] == out["gpus"][1]  # same GPU as the trainer rank


# ------------------------------------------------------------------ sleep
def test_sleep_mode_reaches_vllm_on_gpu_and_is_refused_on_cpu(model_dir):
    cfg = _settings(vllm_enable_sleep=True)
    assert cfg.enable_sleep_mode is True
    assert vllm_engine_kwargs(cfg, cuda=True)["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in vllm_engine_kwargs(_settings(), cuda=True)
    cpu_cfg = EngineConfig(model=str(model_dir), dtype="float32", max_model_len=512, enable_sleep_mode=True)
    with pytest.raises(ValueError, match="enable_sleep_mode: vLLM's sleep mode needs CUDA"):
        check_startup(cpu_cfg, cuda=False)


def test_sleep_without_sleep_mode_is_an_error_not_a_no_op(model_dir):
    """OpenRLHF calls ``sleep`` on its engines with --vllm.enable_sleep; a WAR engine started
    without sleep mode refuses it, naming the setting, instead of silently keeping its memory."""
    import asyncio

    from war_openrlhf.engine.engine import WarEngine

    eng = WarEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=512))
    with pytest.raises(RuntimeError, match=r"sleep\(\) needs EngineConfig.enable_sleep_mode"):
        asyncio.run(eng.sleep())


class _SleepyEngines:
    """Engines as vLLM 0.29's sleep mode treats requests: a request to a sleeping engine is held
    until it wakes (here: refused at once, naming the rollout, rather than held for the turn
    timeout). ``call`` stands in for OpenRLHF's ``batch_vllm_engine_call``."""

    def __init__(self, n: int) -> None:
        self.awake = [False] * n  # war_engine_factory puts them to sleep after start
        self.calls: list[str] = []

    def call(self, engines, method, *args, **kwargs):
        assert engines is self.handles
        self.calls.append(method)
        self.awake = [method == "wake_up"] * len(self.awake)

    def serve(self, what: str) -> None:
        if not all(self.awake):
            raise AssertionError(f"{what} sent to sleeping engines: vLLM would hold it until turn_timeout_s")

    @property
    def handles(self):
        return self.__dict__.setdefault("_handles", [object() for _ in self.awake])


def test_sleep_mode_engines_are_awake_for_warm_up_training_and_eval_rollouts(monkeypatch):
    """With --vllm.enable_sleep the engines start asleep; every rollout of the samples
    generator (the warm-up in the trainer's __init__, a training fill, an evaluation) wakes
    them first and puts them back to sleep after, as OpenRLHF's generator does."""
    import openrlhf.trainer.ray.vllm_engine as openrlhf_engines

    from war_openrlhf.training.samples_generator import WarSamplesGenerator

    engines = _SleepyEngines(2)
    monkeypatch.setattr(openrlhf_engines, "batch_vllm_engine_call", engines.call)
    gen = object.__new__(WarSamplesGenerator)
    gen.args = SimpleNamespace(rollout=SimpleNamespace(batch_size=1, n_samples_per_prompt=1,
                                                       vllm_generate_batch_size=None),
                               algo=SimpleNamespace(dynamic_filtering_enable=False),
                               vllm=SimpleNamespace(enable_sleep=True))
    gen.settings = RolloutConfig(warm_up=True)
    gen.vllm_engines = engines.handles
    gen._pending_metrics, gen._dataloader_iter, gen._sample_buffer, gen.metrics = {}, None, [], {}

    class Pool:
        async def warm_up_async(self, prompt, label):
            engines.serve("the warm-up")
            return 0.5

    gen.pool = Pool()
    gen.prompts_dataloader = SimpleNamespace(dataset=[(None, "p0", "l0", None)])
    assert gen.warm_up() == 0.5
    assert engines.calls == ["wake_up", "sleep"] and not any(engines.awake)

    def rollout(prompts, labels, **kw):
        engines.serve(f"rollout of {prompts}")
        return [SimpleNamespace(name=p, info={}) for p in prompts], 1

    gen._rollout = rollout
    gen.prompts_dataloader = [(None, ["p0"], ["l0"], [None])]
    out, *_ = gen.generate_samples()
    assert [e.name for e in out] == ["p0"] and not any(engines.awake)
    gen.eval_dataloader = [(None, ["e0"], ["l"], [None]), (None, ["e1"], ["l"], [None])]
    assert [e.name for e in gen.generate_eval_samples()] == ["e0", "e1"]
    assert engines.calls == ["wake_up", "sleep"] * 3 and not any(engines.awake)
    # a failing rollout still puts the engines back to sleep (the trainer needs the memory)
    gen._rollout = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("episode failed"))
    with pytest.raises(RuntimeError, match="episode failed"):
        gen.generate_eval_samples()
    assert engines.calls[-1] == "sleep" and not any(engines.awake)


# ------------------------------------------------------------------ flags
def test_every_create_vllm_engines_argument_is_honoured_or_refused():
    from war_openrlhf.integrations.openrlhf import OPENRLHF_OWNED, refuse_openrlhf_owned

    cfg = _settings(full_determinism=True, gpu_memory_utilization=0.5, logprobs_mode="processed_logprobs")
    assert cfg.full_determinism and cfg.gpu_memory_utilization == 0.5 and cfg.logprobs_mode == "processed_logprobs"
    args = vllm_engine_kwargs(cfg, cuda=True)
    assert args["logprobs_mode"] == "processed_logprobs" and args["max_logprobs"] == 1
    with pytest.raises(ValueError, match="remote reward model is not supported"):
        _settings(remote_rm_url=["http://rm"])
    assert _settings(remote_rm_url=["agent"]).model == "/m"  # what OpenRLHF sets for an agent file
    with pytest.raises(ValueError, match="vision-language rollouts are not supported"):
        _settings(max_images_per_prompt=2)
    with pytest.raises(ValueError, match="logprobs_mode: 'bogus'"):
        _settings(logprobs_mode="bogus")
    # the WAR settings cannot set what these OpenRLHF arguments define
    for key, flag in (("tensor_parallel_size", "vllm.tensor_parallel_size"),
                      ("enable_sleep_mode", "vllm.enable_sleep"),
                      ("gpu_memory_utilization", "vllm.gpu_memory_utilization")):
        assert OPENRLHF_OWNED[f"engine.{key}"] == flag
        with pytest.raises(ValueError, match=f"defined by OpenRLHF's --{flag}"):
            refuse_openrlhf_owned({"engine": {key: 1}}, "x.yaml")


def _openrlhf_args(**over):
    ns = lambda **kw: SimpleNamespace(**kw)  # noqa: E731
    args = ns(actor=ns(model_name_or_path="/m"), data=ns(max_len=1024), vllm=ns(
        num_engines=2, enforce_eager=True, tensor_parallel_size=1, gpu_memory_utilization=0.7, enable_sleep=False),
        train=ns(seed=1, agent_func_path="a.py", full_determinism_enable=True),
        rollout=ns(n_samples_per_prompt=4, temperature=1.0, top_p=1.0, max_new_tokens=None),
        algo=ns(advantage=ns(is_correction_level="token")), ds=ns(param_dtype="bf16"))
    for dotted, value in over.items():
        obj = args
        *path, last = dotted.split("__")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return args


def test_openrlhf_flags_reach_the_pools_settings():
    from war_openrlhf.integrations.openrlhf import merge_openrlhf_args

    merged = merge_openrlhf_args(RolloutConfig(max_new_tokens_per_turn=None), _openrlhf_args(rollout__max_new_tokens=48))
    assert merged.max_new_tokens_per_turn == 48
    assert merged.engine.gpu_memory_utilization == 0.7 and merged.engine.full_determinism
    assert merged.engine.logprobs_mode == "processed_logprobs"  # is_correction_level != off
    off = merge_openrlhf_args(RolloutConfig(), _openrlhf_args(algo__advantage__is_correction_level="off"))
    assert off.engine.logprobs_mode is None
    with pytest.raises(ValueError, match="--rollout.max_new_tokens 48 and the WAR setting max_new_tokens_per_turn 64"):
        merge_openrlhf_args(RolloutConfig(max_new_tokens_per_turn=64), _openrlhf_args(rollout__max_new_tokens=48))
    # a restarted engine could not join OpenRLHF's weight-sync group: refused, reinstate is fine
    with pytest.raises(ValueError, match="engine_recovery: 'restart'.*weight-sync group"):
        merge_openrlhf_args(RolloutConfig(engine_recovery="restart"), _openrlhf_args())
    assert merge_openrlhf_args(RolloutConfig(engine_recovery="reinstate"), _openrlhf_args()).engine_recovery == "reinstate"


# ------------------------------------------------------------------ dtype
def test_engines_run_the_trainers_dtype_and_trust_remote_code_as_openrlhfs(model_dir):
    """OpenRLHF's engines are bfloat16 with trust_remote_code (vllm_engine.py lines 273-274) and
    its WorkerWrap asserts every synced weight's dtype is the engine's: on CUDA an ``auto``
    engine runs --ds.param_dtype, another dtype is refused before any engine starts, and a
    disagreeing 16-bit engine dtype is refused when the settings are built."""
    from war_openrlhf.integrations.openrlhf import merge_openrlhf_args

    for param, want in (("bf16", "bfloat16"), ("fp16", "float16")):
        cfg = merge_openrlhf_args(RolloutConfig(), _openrlhf_args(ds__param_dtype=param)).engine
        assert cfg.weight_sync_dtype == want and cfg.trust_remote_code
        gpu = vllm_engine_kwargs(cfg, cuda=True)
        assert gpu["dtype"] == want and gpu["trust_remote_code"] is True
        # on CPU the trainer runs float32 whatever --ds.param_dtype says; the CPU sync casts
        assert vllm_engine_kwargs(cfg, cuda=False)["dtype"] == "auto"
    with pytest.raises(ValueError, match="war.engine.dtype float16 and --ds.param_dtype bf16 disagree"):
        merge_openrlhf_args(RolloutConfig(engine={"dtype": "float16"}), _openrlhf_args())
    f32 = merge_openrlhf_args(RolloutConfig(engine={"dtype": "float32"}), _openrlhf_args()).engine
    real = EngineConfig(**{**f32.as_dict(), "model": str(model_dir), "max_model_len": 512,
                           "index": f32.index, "switch": f32.switch})
    with pytest.raises(ValueError, match="EngineConfig.dtype: float32, but the trainer sends its weights as bfloat16"):
        check_startup(real, cuda=True)
    check_startup(real, cuda=False)  # the CPU run casts (war_openrlhf.cpu.weight_sync)
    assert vllm_engine_kwargs(EngineConfig(model="/m"), cuda=True)["trust_remote_code"] is False  # opt-in outside war-train
    with pytest.raises(ValueError, match="EngineConfig.weight_sync_dtype: 'bf16'"):
        EngineConfig(weight_sync_dtype="bf16")


# ------------------------------------------------------------------ cluster device
def test_cluster_device_comes_from_the_driver_not_the_actor(monkeypatch):
    from war_openrlhf import device
    from war_openrlhf.cpu import apply_cpu_support

    monkeypatch.setenv(device.CLUSTER_DEVICE_ENV, "cuda")
    assert device.cluster_device() == "cuda"  # an actor without a GPU in a GPU run
    assert apply_cpu_support() is False  # never patched in a GPU run, even where torch sees no CUDA
    monkeypatch.setenv(device.CLUSTER_DEVICE_ENV, "cpu")
    assert device.cluster_device() == "cpu"
    monkeypatch.setenv(device.CLUSTER_DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="WAR_CLUSTER_DEVICE: must be 'cuda' or 'cpu'"):
        device.cluster_device()
    monkeypatch.delenv(device.CLUSTER_DEVICE_ENV)
    assert device.cluster_device() == ("cuda" if device.cuda_available() else "cpu")


def test_a_cpu_only_driver_joining_a_gpu_cluster_plans_gpu_engines_unpatched(tmp_path):
    """The driver of a run joined to a GPU cluster (``--ray-address``) from a node without CUDA:
    after ``_ray_init`` its own ``cluster_device()`` is the cluster's (OpenRLHF's
    ``create_vllm_engines`` plans the engines there), and the CPU patches were never applied in
    it (only the flash-attn stand-in OpenRLHF's import needs). A fresh process: the test
    process has applied the CPU patches long ago."""
    code = textwrap.dedent('''
        import json, os, sys, types
        os.environ.pop("WAR_CLUSTER_DEVICE", None)
        import ray
        import war_openrlhf.device as device
        import war_openrlhf.cli.train_ppo as cli
        from war_openrlhf.cpu import openrlhf_patches
        calls = []
        ray.init = lambda *a, **k: calls.append(("init", k.get("address")))
        ray.shutdown = lambda: calls.append(("shutdown", None))
        device.detect_cluster_device = lambda timeout_s=120.0: "cuda"
        cli._apply_cpu_support_for_import()
        shim = "flash_attn" in sys.modules
        got = cli._ray_init("10.0.0.1:6379")
        from war_openrlhf.engine.actors import EngineLauncher
        from war_openrlhf.engine.config import EngineConfig
        print(json.dumps(dict(device=got, driver=device.cluster_device(), shim=shim,
                              patched=openrlhf_patches._STATE["applied"], calls=calls)))
    ''')
    env = {k: v for k, v in os.environ.items() if k != "WAR_CLUSTER_DEVICE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["device"] == "cuda" and got["driver"] == "cuda", got
    assert got["patched"] is False, got  # a GPU run's driver carries no CPU patches
    assert got["shim"] is True  # OpenRLHF imports on this CUDA-less node
    assert ["init", "10.0.0.1:6379"] in got["calls"]


def test_tensor_parallel_engine_core_joins_the_running_ray_cluster():
    """vLLM's engine core is a spawned process whose Ray executor calls ``ray.init(address=None)``:
    without ``RAY_ADDRESS`` it would start a new local Ray. As OpenRLHF's _configure_vllm_env
    (lines 102-105) the engine sets it to its cluster's address, and keeps a user's."""
    env = device_env_for_engine(2, {"CUDA_VISIBLE_DEVICES": "0"}, [0], "10.0.0.1:6379")
    assert env["RAY_ADDRESS"] == "10.0.0.1:6379" and env["CUDA_VISIBLE_DEVICES"] is None
    assert device_env_for_engine(1, {}, [3], "h:1") == {"RAY_ADDRESS": "h:1"}
    assert "RAY_ADDRESS" not in device_env_for_engine(2, {"RAY_ADDRESS": "mine:2"}, [], "h:1")
    assert "RAY_ADDRESS" not in device_env_for_engine(2, {}, [], None)


def test_ray_address_is_taken_from_the_command_line_or_the_environment(monkeypatch):
    from war_openrlhf.cli.train_ppo import _ray_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _ray_address(["--config", "x.yaml"]) == (None, ["--config", "x.yaml"])
    assert _ray_address(["--ray-address", "1.2.3.4:6379", "--a"]) == ("1.2.3.4:6379", ["--a"])
    assert _ray_address(["--ray-address=h:1"]) == ("h:1", [])
    monkeypatch.setenv("RAY_ADDRESS", "env:2")
    assert _ray_address([]) == ("env:2", [])
    with pytest.raises(ValueError, match="--ray-address: needs the cluster's address"):
        _ray_address(["--ray-address"])


# ------------------------------------------------------------------ drafting kinds
@pytest.mark.parametrize("speculation", ["auto", "on", "off", "none", "vllm_suffix"])
def test_speculative_config_only_where_an_engine_drafts(speculation):
    """Each drafting kind's vLLM arguments: ``none`` carries no speculative config (a plain engine,
    as OpenRLHF's: none of what a speculative config changes in vLLM 0.29 applies), WAR's kinds
    carry the suffix method behind WAR's extension, ``vllm_suffix`` vLLM's own; every kind keeps
    the worker extension OpenRLHF's weight sync needs."""
    from war_openrlhf.engine.drafting import PlainEngine, VllmSuffixDrafting, WarIndexDrafting

    cfg = _settings()
    cfg = EngineConfig.from_dict({**cfg.as_dict(), "speculation": speculation, "num_speculative_tokens": 6})
    args = vllm_engine_kwargs(cfg, cuda=True, openrlhf_worker=True)
    kind = cfg.drafting
    if speculation == "none":
        assert isinstance(kind, PlainEngine) and "speculative_config" not in args
        assert args["worker_extension_cls"] == WAR_OPENRLHF_WORKER_EXTENSION and not kind.has_war_index
    elif speculation == "vllm_suffix":
        assert isinstance(kind, VllmSuffixDrafting) and not kind.has_war_index
        assert args["speculative_config"] == {"method": "suffix", "num_speculative_tokens": 6}
    else:
        assert isinstance(kind, WarIndexDrafting) and kind.has_war_index
        assert args["speculative_config"]["method"] == "suffix"
        assert args["speculative_config"]["num_speculative_tokens"] == 6
        assert args["worker_extension_cls"] == WAR_OPENRLHF_WORKER_EXTENSION
    if not kind.has_war_index:
        with pytest.raises(ValueError, match="no WAR index replica"):
            kind.refuse_index_call("reset_index")


@pytest.mark.timeout(600)
def test_a_plain_engine_runs_turns_and_refuses_index_calls(model_dir, tmp_path):
    """``speculation: none`` on a real engine: it generates, reports no replica, and refuses the
    index and switch RPCs by name (the pool then ships it no log)."""
    script = tmp_path / "plain_engine.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, json
        from war_openrlhf.engine import EngineConfig
        from war_openrlhf.engine.engine import WarEngine

        async def main():
            eng = WarEngine(EngineConfig(model={str(model_dir)!r}, dtype="float32", max_model_len=512,
                                         speculation="none"))
            await eng.start()
            out = await eng.generate_tokens([5, 9, 11], {{"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}})
            stats = await eng.stats()
            try:
                await eng.set_speculation("on")
                refused = None
            except ValueError as exc:
                refused = str(exc)
            print("RESULT " + json.dumps({{"tokens": len(out["token_ids"]), "war": "war" in stats,
                                          "refused": refused, "async": stats["async_scheduling"]}}))
            await eng.shutdown()

        if __name__ == "__main__":
            asyncio.run(main())
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=540,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["tokens"] == 6 and result["war"] is False
    assert "no WAR index replica" in result["refused"] and "speculation='none'" in result["refused"]
    # vLLM's CPU platform runs every engine synchronously (platforms/cpu.py ~268-269), plain ones too:
    # on CPU a drafting engine's tax is the speculative path alone (on a GPU it also loses async scheduling)
    assert result["async"] is False


# ------------------------------------------------------------------ equal benchmarks
def test_gpu_baseline_engines_get_the_war_engines_kv_through_openrlhfs_own_call(monkeypatch):
    """A GPU A/B compares equal KV: the OpenRLHF baseline's engines come from OpenRLHF's own
    ``create_vllm_engines`` (its placement group, bf16, trust_remote_code), with the WAR engines'
    ``gpu_memory_utilization`` instead of 0.95, and a stated KV size (CUDA blocks of 16) or vLLM's
    own speculation added to each actor's engine arguments. Ray's placement and actor start are
    recorded here; OpenRLHF's function runs unchanged."""
    import openrlhf.trainer.ray.vllm_engine as openrlhf_engines

    from war_openrlhf.baselines.openrlhf_rollout import _engine_extras, _start_gpu_actors

    started = []

    class Recorder:
        @staticmethod
        def options(**options):
            return SimpleNamespace(remote=lambda *a, **kw: started.append((options, kw)) or len(started))

    monkeypatch.setattr(openrlhf_engines, "RolloutRayActor", Recorder)
    monkeypatch.setattr(openrlhf_engines, "placement_group", lambda bundles, strategy: SimpleNamespace(
        bundles=bundles, strategy=strategy, ready=lambda: None))
    monkeypatch.setattr(openrlhf_engines.ray, "get", lambda ref: ref)
    extra = _engine_extras(4000, {"method": "suffix", "num_speculative_tokens": 8}, cuda=True)
    handles = _start_gpu_actors(2, "/m", seed=5, enable_prefix_caching=True, enforce_eager=False, max_model_len=2048,
                                gpu_memory_utilization=EngineConfig.gpu_memory_utilization, logprobs_mode=None,
                                agent_func_path=None, extra=extra)
    assert handles == [1, 2] and openrlhf_engines.RolloutRayActor is Recorder  # restored after the call
    for i, (options, kw) in enumerate(started):
        assert options["num_gpus"] == 1 and kw["seed"] == 5 + i
        assert kw["dtype"] == "bfloat16" and kw["trust_remote_code"] is True  # OpenRLHF's own arguments
        assert kw["gpu_memory_utilization"] == EngineConfig.gpu_memory_utilization == vllm_engine_kwargs(
            EngineConfig(model="/m"), cuda=True)["gpu_memory_utilization"]
        assert kw["num_gpu_blocks_override"] == 251  # 4000 tokens in CUDA blocks of 16, and vLLM's null block
        assert kw["speculative_config"] == {"method": "suffix", "num_speculative_tokens": 8}
    assert vllm_engine_kwargs(EngineConfig(model="/m", kv_capacity_tokens=4000, max_model_len=2048), cuda=True)[
        "num_gpu_blocks_override"] == 251  # the WAR engines' size for the same regime
    started.clear()
    _start_gpu_actors(1, "/m", seed=0, enable_prefix_caching=True, enforce_eager=False, max_model_len=2048,
                      gpu_memory_utilization=0.5, logprobs_mode=None, agent_func_path=None, extra={})
    assert "num_gpu_blocks_override" not in started[0][1] and started[0][1]["gpu_memory_utilization"] == 0.5


def test_cost_fit_times_the_engine_a_gpu_serves_not_the_cpu_one():
    """bench_engine --fit-costs on a GPU node: bf16 with CUDA graphs (what OpenRLHF's engines
    run), not the CPU engines' float32 eager; prefix caching off on both (known work)."""
    from war_openrlhf.engine.launch import cost_fit_engine_kwargs

    gpu = cost_fit_engine_kwargs(4096, 0, cuda=True)
    cpu = cost_fit_engine_kwargs(4096, 0, cuda=False)
    assert (gpu["dtype"], gpu["enforce_eager"]) == ("bfloat16", False)
    assert (cpu["dtype"], cpu["enforce_eager"]) == ("float32", True)
    for kw in (gpu, cpu):
        assert kw["enable_prefix_caching"] is False and kw["max_model_len"] == 4096
    assert cost_fit_engine_kwargs(4096, 0, cuda=True, dtype="float16")["dtype"] == "float16"
