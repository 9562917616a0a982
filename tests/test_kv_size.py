"""An engine given exactly the KV it was asked for: vLLM 0.29 keeps one block of the pool as its
null block, so the block count must be one more than the tokens need, and the usable KV is
what an engine reports. A bench_rollout run at KV pressure 2 sized an engine to one max-length
sequence of blocks and vLLM refused to start it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from war_openrlhf.device import kv_blocks_for, kv_usable_tokens

ROOT = Path(__file__).resolve().parents[1]


@given(tokens=st.integers(1, 10**7), cuda=st.booleans())
def test_the_blocks_for_a_size_leave_that_many_usable_tokens_and_no_more_than_a_block_extra(tokens, cuda):
    size = 16 if cuda else 128
    usable = kv_usable_tokens(kv_blocks_for(tokens, cuda=cuda), size)
    assert tokens <= usable < tokens + size


def test_a_real_engine_with_exactly_one_max_length_sequence_of_kv_starts_and_reports_it(tmp_path):
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    model = build_tiny_model(ROOT / ".cache" / "war_tiny_llama")
    script = textwrap.dedent(f"""
        import json
        from vllm import LLM
        from war_openrlhf.device import kv_blocks_for, kv_usable_tokens
        llm = LLM(model={str(model)!r}, max_model_len=512, enforce_eager=True, dtype="float32",
                  num_gpu_blocks_override=kv_blocks_for(512, cuda=False))
        cache = llm.llm_engine.vllm_config.cache_config
        out = llm.generate([{{"prompt_token_ids": list(range(10, 500))}}],
                           __import__("vllm").SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        print("RESULT", json.dumps({{"usable": kv_usable_tokens(cache.num_gpu_blocks, cache.block_size),
                                    "generated": len(out[0].outputs[0].token_ids)}}))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_OMP_THREADS_BIND="nobind")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[0][len("RESULT "):])
    assert got == {"usable": 512, "generated": 16}  # a 506-token sequence fits in the 512 usable tokens
