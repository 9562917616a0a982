"""``war-train --preflight`` on this machine: every check reports, GPU checks say why they are
skipped, and the engine check (greedy with WAR's drafting on == off, drafts accepted) passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_preflight_reports_every_check_and_passes_here(tmp_path):
    out = tmp_path / "preflight.json"
    proc = subprocess.run([sys.executable, "-m", "war_openrlhf.cli.train_ppo", "--preflight", "--json", str(out)],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["name"]: r for r in json.loads(out.read_text())}
    assert list(results) == ["cuda", "flash_attn", "fused_adam", "vllm", "cpu_attn", "arctic", "suffix_tree",
                             "openrlhf", "engine", "nccl"]
    for name, r in results.items():
        assert f"] {name}" in proc.stdout  # one line each
        assert r["status"] in ("ok", "skip"), r
    import torch

    if not torch.cuda.is_available():  # this machine: the GPU checks skip with their reason
        assert {n for n, r in results.items() if r["status"] == "skip"} == {"cuda", "flash_attn", "fused_adam", "nccl"}
        assert "CPU build" in results["cuda"]["detail"] or "sees no GPU" in results["cuda"]["detail"]
    assert results["engine"]["status"] == "ok" and "greedy on == off" in results["engine"]["detail"]
    assert "weight sync changes and restores the output" in results["engine"]["detail"]  # war-train's engine path
    assert results["suffix_tree"]["detail"] == "the war suffix tree drafts as arctic-inference's does"
    assert "preflight: 6 ok" in proc.stdout or torch.cuda.is_available()


def test_gpu_acceptance_refuses_a_machine_without_cuda_and_bad_arguments(tmp_path):
    """tools/gpu_acceptance.py: on a CPU machine it stops at once saying where to run it; an
    unknown step or a model path without config.json is named."""
    import torch

    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(ROOT / ".cache" / "war_tiny_model")
    script = str(ROOT / "tools" / "gpu_acceptance.py")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    bad = subprocess.run([sys.executable, script, "--model", str(model), "--steps", "engine_path,bogus"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--steps: unknown bogus" in bad.stderr
    bad = subprocess.run([sys.executable, script, "--model", str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert bad.returncode == 2 and "is not a local HF model directory" in bad.stderr
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, script, "--model", str(model), "--json", str(tmp_path / "a.json")],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2 and "no CUDA device here" in proc.stdout
        assert not (tmp_path / "a.json").exists()
