"""Multi-node, on one machine: a two-node Ray cluster on loopback (``ray start --head``, then
``ray start --address`` with its own resources) and ``war-train --ray-address`` against it.

The head offers no CPU and no GPU, so every actor (OpenRLHF's trainer and policy, the WAR
engines) must land on the worker node; the test checks that the engines did (war-train prints
each engine's node) and that the run completed. The worker declares logical GPUs, as a CPU
cluster must for OpenRLHF's GPU actors to schedule; the driver decides the run is a CPU run
from the cluster (its GPUs are not CUDA devices), not from its own torch.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
# a two-node Ray cluster and a war-train run on it
# (the default, setup.cfg, is 300 s a test)
pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(*args: str, env: dict, timeout: int = 120) -> subprocess.CompletedProcess:
    exe = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    return subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def two_node_cluster(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    head = _ray("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "0",
                "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats",
                "--resources", '{"war_head": 1}', env=env)
    assert head.returncode == 0, head.stderr[-2000:]
    try:
        worker = _ray("start", "--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1",
                      "--num-cpus", "8", "--num-gpus", "2", "--resources", '{"war_worker": 1}', env=env)
        assert worker.returncode == 0, worker.stderr[-2000:]
        yield f"127.0.0.1:{port}", env
    finally:
        _ray("stop", "--force", env=env)


def test_war_train_joins_a_two_node_cluster_and_engines_land_on_the_worker(two_node_cluster, tmp_path):
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    address, env = two_node_cluster
    model = build_tiny_model(ROOT / ".cache" / "war_tiny_model")
    data = tmp_path / "train.jsonl"
    subprocess.run([sys.executable, str(ROOT / "examples" / "arithmetic_calculator" / "dataset.py"),
                    "--out", str(data), "--n", "4", "--seed", "1", "--level", "basic"], check=True,
                   capture_output=True)
    cfg = yaml.safe_load((ROOT / "configs" / "cpu_demo.yaml").read_text())
    cfg["openrlhf"].update({
        "actor.model_name_or_path": str(model), "data.prompt_dataset": str(data), "data.max_samples": 2,
        "data.max_len": 512, "rollout.batch_size": 2, "rollout.n_samples_per_prompt": 2,
        "rollout.micro_batch_size": 2, "train.batch_size": 4, "train.micro_batch_size": 2,
        "logger.tensorboard_dir": str(tmp_path / "tb"), "ckpt.path": str(tmp_path / "ckpt"),
        "ckpt.output_dir": str(tmp_path / "model"), "algo.kl.init_coef": 0.0})  # no reference model actor
    cfg["war"].update({"max_turns": 2, "max_new_tokens_per_turn": 16, "progress": False, "warm_up": False})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "war_openrlhf.cli.train_ppo", "--ray-address", address,
                           "--config", str(tmp_path / "run.yaml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"war-train: Ray cluster at {address}, device cpu" in out
    assert "Global step 1" in out
    engine_nodes = set(re.findall(r"WAR engine \d+ on node ([0-9a-f]+)", out))
    assert len(re.findall(r"WAR engine \d+ on node", out)) == 2

    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    finally:
        ray.shutdown()
    worker = [nid for nid, res in nodes.items() if "war_worker" in res]
    assert len(worker) == 1 and engine_nodes == set(worker), (engine_nodes, nodes)
