"""The README's Python: every ``from war_openrlhf... import`` it shows imports from where it
says, and the "Use the pieces" snippets run as written (each in its own process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the README's snippets start real engines
# (the default, setup.cfg, is 300 s a test)
pytestmark = pytest.mark.timeout(600)
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
RUNNABLE = {m.group(1): b for b in BLOCKS if (m := re.match(r"# runnable: (\w+)\n", b))}


def test_every_import_the_readme_shows_works():
    lines = sorted({l.strip() for b in BLOCKS for l in b.splitlines()
                    if re.match(r"\s*from war_openrlhf[\w.]* import ", l)})
    assert len(lines) >= 6
    code = "\n".join(lines)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("name", ["dispatcher", "vllm_index", "pool"])
def test_the_use_the_pieces_snippets_run(name, tmp_path):
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    assert name in RUNNABLE, sorted(RUNNABLE)
    model = build_tiny_model(ROOT / ".cache" / "war_tiny_model")
    script = tmp_path / f"{name}.py"
    script.write_text(f"MODEL = {str(model)!r}\nAGENT = {str(ROOT / 'examples/arithmetic_calculator/agent.py')!r}\n"
                      f"if __name__ == '__main__':\n" + "".join(f"    {l}\n" for l in RUNNABLE[name].splitlines()))
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    expected = {"dispatcher": r"turn 0 -> [01]\b", "vllm_index": r"True", "pool": r"tokens_per_s|trajectories"}
    assert re.search(expected[name], proc.stdout), proc.stdout[-2000:]
