"""GPU cost presets fitted to published measurements, every constant cited.

The analytic ``h100_qwen7b`` preset of :mod:`war_openrlhf.simulation.cost_model` prices a step
from the H100's bandwidth and an assumed "400 TFLOP/s effective". The presets here are fitted,
in code, to measurements other people published for a 7-8B dense bf16 model on one GPU:

``a100_qwen7b_published``
    Qwen2.5-7B-Instruct, bf16, one A100 80 GB SXM, vLLM.
``h100_qwen7b_published``
    The same model on one H100 80 GB SXM.

No H200 preset: no published H200 figure for a 7-8B bf16 model on one whole H200 was found.

**These presets are unvalidated.** Each reproduces the published figures it was fitted to
(the table below, checked by tests/test_gpu_presets.py), but nobody has yet run this
simulator's workloads on those GPUs and compared. The figures come from different
engines, engine versions and benchmarks (listed in :data:`SOURCES`), and the fit assumes
a few things, such as a full batch of 256 during a saturated run. For numbers you can
rely on, fit your own preset on your node::

    python tools/bench_engine.py --fit-costs OUT.json --model MODEL_DIR --max-len 16384 --repeats 3

and pass ``OUT.json`` wherever a preset name is accepted (:func:`~war_openrlhf.simulation.cost_model.get_preset`
loads it by path).

How the costs are fitted
------------------------
The step model is :class:`~war_openrlhf.simulation.cost_model.CostModel`'s::

    step = step_overhead_s + decode_per_seq_s * decodes + kv_read_per_token_s * context
         + prefill_per_token_s * prefill_tokens

* ``kv_read_per_token_s``: analytic. Each step reads the KV cache once at the GPU's datasheet
  bandwidth: 57,344 B a token (Qwen2.5-7B config) / HBM bandwidth.
* ``prefill_per_token_s``:
    * A100: the slope of Qwen's vLLM speed benchmark (batch 1, 2048 generated tokens after
      prompts of 1, 6144, 14336 and 30720 tokens). A prompt token costs one prefill token plus
      one KV read in each of the 2048 steps (the prefill step and 2047 decode steps), so
      ``prefill = slope - 2048 * kv_read``.
    * H100: a published prefill-dominated run (random prompts of up to 8192 tokens, 4065 on
      average, 8 output tokens).
* ``step_overhead_s`` and ``decode_per_seq_s``: two equations. A batch-1 decode step costs
  ``overhead + decode_per_seq``. A saturated ShareGPT run (5000 prompts, 256 running sequences)
  costs ``overhead / 256 + decode_per_seq + KV + prefill share`` per generated token.
* ``kv_capacity_tokens``: 0.9 (vLLM's default ``gpu_memory_utilization``) x 80 GB, minus
  the bf16 weights and vLLM's measured activation reserve, / 57,344 B.
* Llama-3.1-8B figures stand in for the 7B-class model, scaled by parameter count: a time is
  multiplied by 7.6155e9 / 8.0303e9 = 0.948 (both counts computed from the models' HF configs).

What each preset predicts against the figure it came from
---------------------------------------------------------
Tokens/s (Llama figures after the parameter scaling). ``fitted`` rows are what the
constants were solved from; the ``held out`` row was not used.

============================  ====================================================  =========  =========  ======
preset                        published figure                                      published  predicted  error
============================  ====================================================  =========  =========  ======
a100_qwen7b_published         Qwen2.5-7B vLLM batch 1, prompt 1 (fitted)                84.28      84.26   -0.0%
a100_qwen7b_published         Qwen2.5-7B vLLM batch 1, prompt 6144 (fitted)             80.70      81.08   +0.5%
a100_qwen7b_published         Qwen2.5-7B vLLM batch 1, prompt 14336 (fitted)            77.69      77.20   -0.6%
a100_qwen7b_published         Qwen2.5-7B vLLM batch 1, prompt 30720 (fitted)            70.33      70.46   +0.2%
a100_qwen7b_published         Llama-3.1-8B vLLM ShareGPT, 256 seqs (fitted)              4357       4357   +0.0%
a100_qwen7b_published         Qwen2.5-7B vLLM batch 1, prompt 63488 (held out)          50.86      59.98  +17.9%
h100_qwen7b_published         Llama-3.1-8B SGLang batch 1, MT-bench (fitted)           166.96     166.96   +0.0%
h100_qwen7b_published         Llama-3.1-8B vLLM ShareGPT, 256 seqs (fitted)              8529       8529   +0.0%
h100_qwen7b_published         Llama-3.1-8B SGLang prefill, prompts <= 8k (fitted)       29177      29177   +0.0%
============================  ====================================================  =========  =========  ======

The held-out 63k-token row runs 18% fast. These presets leave out the quadratic part of
prefill attention (``prefill_attn_per_pair_s = 0``), and past 32k tokens that part
dominates. Below about 30k tokens the linear prefill cost absorbs it.

The fitted values (rounded):

=========================  ============  ============
field                      A100          H100
=========================  ============  ============
step_overhead_s            11.78 ms      5.93 ms
decode_per_seq_s           56.9 us       47.1 us
kv_read_per_token_s        28.1 ns       17.1 ns
prefill_per_token_s        97.3 us       34.3 us
kv_capacity_tokens         944,624       944,624
max_num_seqs               256           256
max_num_batched_tokens     8192          8192
=========================  ============  ============

The A100's batch-1 step (11.8 ms) lies well above its 7.5 ms weight-streaming floor. The
same benchmark's 0.5B model runs at 311.55 tokens/s (3.2 ms a step for 1 GB of weights),
so vLLM 0.6.3's offline batch-1 loop spent about 2.7 ms a step on host work. That overhead
is part of the A100 preset. The H100 batch-1 figure is SGLang's, with less host overhead
(6.0 ms against a 4.5 ms floor).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

from .cost_model import CostModel

__all__ = [
    "GPU_PRESETS", "SOURCES", "FIELD_SOURCES", "PUBLISHED_FIGURES", "NUMERIC_FIELDS",
    "published_checks", "speed_benchmark_tokens_per_s", "single_stream_tokens_per_s",
    "saturated_tokens_per_s", "marginal_prefill_tokens_per_s",
    "QWEN25_7B_PARAMS", "LLAMA31_8B_PARAMS", "QWEN25_7B_WEIGHT_BYTES", "QWEN25_7B_KV_BYTES_PER_TOKEN",
    "H100_SXM_HBM_BANDWIDTH", "A100_80GB_SXM_HBM_BANDWIDTH", "H100_SXM_BF16_DENSE_FLOPS",
    "A100_BF16_DENSE_FLOPS",
]

# ------------------------------------------------------------------ models (Hugging Face configs)
#: Qwen/Qwen2.5-7B-Instruct config.json (the fields the cost model needs)
QWEN25_7B_CONFIG = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                    "tie_word_embeddings": False}
#: meta-llama/Llama-3.1-8B config.json (the stand-in model of several measurements)
LLAMA31_8B_CONFIG = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "tie_word_embeddings": False}
BF16_BYTES = 2


def _head_dim(cfg: dict) -> int:
    return cfg["hidden_size"] // cfg["num_attention_heads"]


def dense_decoder_params(cfg: dict) -> int:
    """Parameters of a Llama-style decoder from its config: per layer q/o (h x h), k/v
    (h x kv_heads*head_dim), a gated MLP (3 x h x intermediate) and two RMSNorms; the
    embedding and (untied) LM head; the final norm. Biases (Qwen2's q/k/v carry ~0.13 M)
    are left out."""
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * _head_dim(cfg)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * cfg["intermediate_size"] + 2 * h
    embeddings = cfg["vocab_size"] * h * (1 if cfg["tie_word_embeddings"] else 2)
    return cfg["num_hidden_layers"] * per_layer + embeddings + h


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = BF16_BYTES) -> int:
    """K and V of every layer for one token."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * _head_dim(cfg) * dtype_bytes


QWEN25_7B_PARAMS = dense_decoder_params(QWEN25_7B_CONFIG)          # 7,615,487,488
LLAMA31_8B_PARAMS = dense_decoder_params(LLAMA31_8B_CONFIG)        # 8,030,261,248
QWEN25_7B_WEIGHT_BYTES = QWEN25_7B_PARAMS * BF16_BYTES             # 15.23 GB
QWEN25_7B_KV_BYTES_PER_TOKEN = kv_bytes_per_token(QWEN25_7B_CONFIG)  # 57,344 B
#: a Llama-3.1-8B time stands for the 7B-class model's after this factor (parameter count)
LLAMA_TO_QWEN_TIME = QWEN25_7B_PARAMS / LLAMA31_8B_PARAMS          # 0.948

# ------------------------------------------------------------------ hardware (datasheets)
H100_SXM_HBM_BANDWIDTH = 3.35e12        # B/s
H100_SXM_BF16_SPARSE_FLOPS = 1979e12    # FLOP/s, "with sparsity"
H100_SXM_BF16_DENSE_FLOPS = H100_SXM_BF16_SPARSE_FLOPS / 2
H100_SXM_MEMORY_BYTES = 80e9
A100_80GB_SXM_HBM_BANDWIDTH = 2.039e12  # B/s
A100_BF16_DENSE_FLOPS = 312e12          # FLOP/s
A100_80GB_MEMORY_BYTES = 80e9

# ------------------------------------------------------------------ engine memory accounting
VLLM_GPU_MEMORY_UTILIZATION = 0.9       # vLLM's default (the Qwen benchmark's setting too)
#: vLLM's memory profile of Llama-3.1-8B-Instruct (issue #10517): weights, peak torch, non-torch
VLLM_PROFILE_WEIGHTS_GIB = 14.9888
VLLM_PROFILE_PEAK_TORCH_GIB = 17.06
VLLM_PROFILE_NON_TORCH_GIB = 0.35
VLLM_ACTIVATION_RESERVE_BYTES = (VLLM_PROFILE_PEAK_TORCH_GIB - VLLM_PROFILE_WEIGHTS_GIB
                                 + VLLM_PROFILE_NON_TORCH_GIB) * 2**30
MAX_NUM_SEQS = 256                      # the saturated runs' scheduler limit (and vLLM's default)
MAX_NUM_BATCHED_TOKENS = 8192           # vLLM V1's online-serving chunked-prefill budget
BLOCK_SIZE = 16                         # vLLM's CUDA KV block

# ------------------------------------------------------------------ published measurements
#: Qwen2.5 speed benchmark, "7B (vLLM)": Qwen2.5-7B-Instruct BF16, 1 x A100 80GB, vLLM 0.6.3,
#: batch 1, 2048 generated tokens: tokens/s by input length (2048 / wall time of generate()).
QWEN_A100_VLLM_SPEED = {1: 84.28, 6144: 80.70, 14336: 77.69, 30720: 70.33}
QWEN_A100_VLLM_SPEED_64K = 50.86        # input 63488, "setting-64k" (held out)
QWEN_SPEED_BENCH_GENERATED = 2048
#: SGLang's vLLM v0.6.0 comparison, offline: Llama 3.1 8B Instruct, 1 x A100 80G, 5000 ShareGPT
A100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S = 4132.37
A100_LLAMA8B_VLLM_SHAREGPT_REQ_S = 21.27
#: Lambda's vLLM report: Llama 3.1 8B, tp=1, rps=inf, 5000 prompts, max-num-seq=256, v0.6.0 + 10 steps
H100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S = 8088.35
#: ShareGPT as sglang.bench_serving samples it: 2000 prompts' input and generated tokens
SHAREGPT_INPUT_TOKENS = 453502
SHAREGPT_OUTPUT_TOKENS = 376493
#: SGLang docs: Llama-3.1-8B-Instruct on MT-bench, 1 x H100, without speculative decoding
H100_LLAMA8B_SGLANG_BATCH1_TOK_S = 158.34
MT_BENCH_CONTEXT_TOKENS = 512           # assumed mean context of an MT-bench decode step
#: SGLang PR #1060: Llama-3.1-8B-Instruct, H100, 1000 random prompts of up to 8192 tokens, 8 out
H100_LLAMA8B_SGLANG_INPUT_TOK_S = 27670.26

# ------------------------------------------------------------------ derived workload shapes
SHAREGPT_OUTPUT_PER_REQ = A100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S / A100_LLAMA8B_VLLM_SHAREGPT_REQ_S  # 194.3
SHAREGPT_INPUT_PER_OUTPUT = SHAREGPT_INPUT_TOKENS / SHAREGPT_OUTPUT_TOKENS                            # 1.205
SHAREGPT_PROMPT_PER_REQ = SHAREGPT_INPUT_PER_OUTPUT * SHAREGPT_OUTPUT_PER_REQ                        # 234.0


# ------------------------------------------------------------------ what a cost model predicts
def speed_benchmark_tokens_per_s(model: CostModel, input_len: int,
                                 generated: int = QWEN_SPEED_BENCH_GENERATED) -> float:
    """Qwen's speed benchmark on ``model``: one prefill step of ``input_len`` tokens (it yields
    the first token), then ``generated - 1`` decode steps at batch 1; ``generated`` over the
    total time, as the benchmark reports it."""
    total = model.step_time(0, input_len, input_len)
    for j in range(1, generated):
        total += model.step_time(1, input_len + j, 0)
    return generated / total


def single_stream_tokens_per_s(model: CostModel, context_tokens: int) -> float:
    """Decode at batch 1 over ``context_tokens`` of KV."""
    return 1.0 / model.step_time(1, context_tokens, 0)


def saturated_tokens_per_s(model: CostModel, batch: int, prompt_tokens: float, output_tokens: float) -> float:
    """Generated tokens/s of a run kept full at ``batch`` running sequences, each of
    ``prompt_tokens`` in and ``output_tokens`` out: decode steps of ``batch`` sequences at the
    mean context (prompt + half the output), plus every prompt's prefill work (the prefill
    steps' own overhead left out: many prompts share one)."""
    context = prompt_tokens + output_tokens / 2
    decode = model.step_time(batch, batch * context, 0) / batch
    prefill = (model.step_time(0, prompt_tokens, prompt_tokens) - model.step_overhead_s) / output_tokens
    return 1.0 / (decode + prefill)


def marginal_prefill_tokens_per_s(model: CostModel, prompt_tokens: int) -> float:
    """Prompt tokens/s of a prefill-only run whose step overhead is shared by many prompts."""
    return prompt_tokens / (model.step_time(0, prompt_tokens, prompt_tokens) - model.step_overhead_s)


# ------------------------------------------------------------------ the fits
def _linear_fit(xs: List[float], ys: List[float]):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def _overhead_and_per_seq(batch1_step: float, decode_fraction: float, per_token_saturated: float,
                          batch: int):
    """Solve ``overhead + decode_fraction * per_seq = batch1_step`` and
    ``overhead / batch + per_seq = per_token_saturated``."""
    overhead = (batch1_step - decode_fraction * per_token_saturated) / (1.0 - decode_fraction / batch)
    return overhead, per_token_saturated - overhead / batch


def _kv_capacity(memory_bytes: float) -> int:
    free = VLLM_GPU_MEMORY_UTILIZATION * memory_bytes - QWEN25_7B_WEIGHT_BYTES - VLLM_ACTIVATION_RESERVE_BYTES
    tokens = int(free // QWEN25_7B_KV_BYTES_PER_TOKEN)
    return tokens - tokens % BLOCK_SIZE


def _fit_a100() -> Dict[str, Any]:
    n = QWEN_SPEED_BENCH_GENERATED
    kv = QWEN25_7B_KV_BYTES_PER_TOKEN / A100_80GB_SXM_HBM_BANDWIDTH
    # total time T(L) = n*o + (n-1)*d + L*(p + n*kv) + kv*n*(n-1)/2  (see speed_benchmark_tokens_per_s)
    lens = sorted(QWEN_A100_VLLM_SPEED)
    slope, intercept = _linear_fit([float(x) for x in lens], [n / QWEN_A100_VLLM_SPEED[x] for x in lens])
    prefill = slope - n * kv
    batch1 = (intercept - kv * n * (n - 1) / 2) / n          # = o + d*(n-1)/n
    per_token = LLAMA_TO_QWEN_TIME / A100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S
    context = SHAREGPT_PROMPT_PER_REQ + SHAREGPT_OUTPUT_PER_REQ / 2
    decode_share = per_token - kv * context - (prefill + kv) * SHAREGPT_INPUT_PER_OUTPUT  # = o/B + d
    overhead, per_seq = _overhead_and_per_seq(batch1, (n - 1) / n, decode_share, MAX_NUM_SEQS)
    return {"slope": slope, "intercept": intercept, "batch1": batch1, "decode_share": decode_share,
            "step_overhead_s": overhead, "decode_per_seq_s": per_seq, "kv_read_per_token_s": kv,
            "prefill_per_token_s": prefill, "kv_capacity_tokens": _kv_capacity(A100_80GB_MEMORY_BYTES)}


def _fit_h100() -> Dict[str, Any]:
    kv = QWEN25_7B_KV_BYTES_PER_TOKEN / H100_SXM_HBM_BANDWIDTH
    prefill = LLAMA_TO_QWEN_TIME / H100_LLAMA8B_SGLANG_INPUT_TOK_S - kv
    batch1 = LLAMA_TO_QWEN_TIME / H100_LLAMA8B_SGLANG_BATCH1_TOK_S - kv * MT_BENCH_CONTEXT_TOKENS  # = o + d
    per_token = LLAMA_TO_QWEN_TIME / H100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S
    context = SHAREGPT_PROMPT_PER_REQ + SHAREGPT_OUTPUT_PER_REQ / 2
    decode_share = per_token - kv * context - (prefill + kv) * SHAREGPT_INPUT_PER_OUTPUT
    overhead, per_seq = _overhead_and_per_seq(batch1, 1.0, decode_share, MAX_NUM_SEQS)
    return {"batch1": batch1, "decode_share": decode_share,
            "step_overhead_s": overhead, "decode_per_seq_s": per_seq, "kv_read_per_token_s": kv,
            "prefill_per_token_s": prefill, "kv_capacity_tokens": _kv_capacity(H100_SXM_MEMORY_BYTES)}


_A100 = _fit_a100()
_H100 = _fit_h100()


def _preset(name: str, fit: Dict[str, Any]) -> CostModel:
    return CostModel(name=name, step_overhead_s=fit["step_overhead_s"], decode_per_seq_s=fit["decode_per_seq_s"],
                     kv_read_per_token_s=fit["kv_read_per_token_s"], prefill_per_token_s=fit["prefill_per_token_s"],
                     kv_capacity_tokens=fit["kv_capacity_tokens"], max_num_seqs=MAX_NUM_SEQS,
                     max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, block_size=BLOCK_SIZE)


GPU_PRESETS: Dict[str, CostModel] = {
    "a100_qwen7b_published": _preset("a100_qwen7b_published", _A100),
    "h100_qwen7b_published": _preset("h100_qwen7b_published", _H100),
}

#: CostModel's numeric fields (every one has a source in FIELD_SOURCES)
NUMERIC_FIELDS = ("step_overhead_s", "decode_per_seq_s", "kv_read_per_token_s", "prefill_per_token_s",
                  "kv_capacity_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size",
                  "prefill_attn_per_pair_s", "spec_step_s", "draft_token_s", "draft_context_token_s",
                  "contention")

# ------------------------------------------------------------------ sources
_QWEN_SPEED = ("Qwen2.5 Speed Benchmark (qwen.readthedocs.io, benchmark/speed_benchmark), table '7B (vLLM)', "
               "source https://github.com/QwenLM/Qwen2.5/blob/010c37c33b13a1ac59944b349620e13404efe97d/"
               "docs/source/benchmark/speed_benchmark.rst; method: https://github.com/QwenLM/Qwen2.5/blob/"
               "0b7d9f7670a3e1e05d1e076147d08c045a5aa99e/examples/speed-benchmark/speed_benchmark_vllm.py")
_QWEN_CONFIG = ("https://huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json (read from the copy "
                "https://huggingface.co/osllmai-community/Qwen2.5-7B-Instruct/blob/main/config.json, "
                "_name_or_path 'Qwen/Qwen2.5-7B-Instruct')")
_LLAMA_CONFIG = ("https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (read from the copy "
                 "https://huggingface.co/NbAiLab/nb-llama-3.1-8B/blob/main/config.json, "
                 "_name_or_path 'meta-llama/Llama-3.1-8B')")
_H100_SHEET = ("NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column, as reproduced at "
               "https://www.clawkipedia.org/wiki/nvidia-h100 and https://glennklockwood.com/garden/processors/h100")
_A100_SHEET = ("NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), "
               "A100 80GB SXM column, as reproduced at https://www.thundercompute.com/blog/nvidia-a100-specs-full-guide "
               "and https://glennklockwood.com/garden/processors/A100")
_SGLANG_VLLM060 = ("SGLang, 'How to reproduce the benchmark results for SGLang v0.3.0 compared to vLLM v0.6.0', "
                   "section 'Offline benchmark results / Llama 3.1 8B Instruct 1 x A100 80G', "
                   "https://github.com/sgl-project/sglang/blob/120affb9613cc3f5bcd055ec09c7621d3ced0ebc/"
                   "benchmark/benchmark_vllm_060/README.md")
_LAMBDA = ("Lambda, 'LLMs inference benchmarks, using vLLM, on Lambda Cloud', section 'vLLM v0.5.4 v.s. v0.6.0', "
           "https://github.com/LambdaLabsML/vllm-benchmark/blob/0e8fc5d0f9865a326666cb82aeb2d8dc74c82c5e/benchmark_v0.md")
_SGLANG_SPEC = ("SGLang docs, Speculative Decoding, 'Performance Highlights' table, "
                "https://docs.sglang.io/advanced_features/speculative_decoding.html")
_SGLANG_PR1060 = ("SGLang pull request #1060, benchmark in the comment of 2024-08-13 (block '# latest main'), "
                  "https://github.com/sgl-project/sglang/pull/1060")
_SGLANG_ISSUE1639 = ("SGLang issue #1639 'is it time to rerun the benchmarks?', comment of 2024-10-17, "
                     "https://github.com/sgl-project/sglang/issues/1639")
_VLLM_ISSUE10517 = "vLLM issue #10517, comment of 2024-12-02 (20k run), https://github.com/vllm-project/vllm/issues/10517"
_COST_MODEL = "war_openrlhf/simulation/cost_model.py, module docstring, preset h100_qwen7b"


def _src(value, unit, source, quote, derivation, measured):
    return {"value": value, "unit": unit, "source": source, "quote_or_reading": quote,
            "derivation": derivation, "measured": measured}


SOURCES: Dict[str, Dict[str, Any]] = {
    # --- models
    "QWEN25_7B_CONFIG": _src(
        QWEN25_7B_CONFIG, "config fields", _QWEN_CONFIG,
        '"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, '
        '"num_key_value_heads": 4, "tie_word_embeddings": false, "torch_dtype": "bfloat16", "vocab_size": 152064',
        "copied", True),
    "QWEN25_7B_PARAMS": _src(
        QWEN25_7B_PARAMS, "parameters", _QWEN_CONFIG, "the config fields above",
        "28 x (2*3584^2 + 2*3584*512 + 3*3584*18944 + 2*3584) + 2*152064*3584 + 3584 "
        "(head_dim 3584/28 = 128, K/V width 4*128 = 512; untied LM head; q/k/v biases left out) = 7.6155e9", True),
    "QWEN25_7B_KV_BYTES_PER_TOKEN": _src(
        QWEN25_7B_KV_BYTES_PER_TOKEN, "B/token", _QWEN_CONFIG, "num_hidden_layers 28, num_key_value_heads 4, head_dim 128",
        "2 (K, V) x 28 layers x 4 KV heads x 128 x 2 B (bf16) = 57,344 B", True),
    "QWEN25_7B_WEIGHT_BYTES": _src(
        QWEN25_7B_WEIGHT_BYTES, "B", _QWEN_CONFIG, '"torch_dtype": "bfloat16"',
        "QWEN25_7B_PARAMS x 2 B = 15.23 GB", True),
    "LLAMA31_8B_CONFIG": _src(
        LLAMA31_8B_CONFIG, "config fields", _LLAMA_CONFIG,
        '"head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, '
        '"num_hidden_layers": 32, "num_key_value_heads": 8, "tie_word_embeddings": false, "vocab_size": 128256',
        "copied", True),
    "LLAMA31_8B_PARAMS": _src(
        LLAMA31_8B_PARAMS, "parameters", _LLAMA_CONFIG, "the config fields above",
        "32 x (2*4096^2 + 2*4096*1024 + 3*4096*14336 + 2*4096) + 2*128256*4096 + 4096 = 8.0303e9", True),
    "LLAMA_TO_QWEN_TIME": _src(
        LLAMA_TO_QWEN_TIME, "ratio", f"{_QWEN_CONFIG}; {_LLAMA_CONFIG}", "parameter counts from the two configs",
        "QWEN25_7B_PARAMS / LLAMA31_8B_PARAMS = 0.948: a Llama-3.1-8B time (per token or per step) is "
        "multiplied by it to stand for the 7B-class model (weights, FLOPs and so time scale with parameters)", False),
    # --- hardware
    "H100_SXM_HBM_BANDWIDTH": _src(
        H100_SXM_HBM_BANDWIDTH, "B/s", _H100_SHEET, "'Memory Bandwidth: 3.35 TB/s'; '3.35 TB/s (max)?'",
        "3.35 TB/s = 3.35e12 B/s", True),
    "H100_SXM_BF16_DENSE_FLOPS": _src(
        H100_SXM_BF16_DENSE_FLOPS, "FLOP/s", _H100_SHEET,
        "'BF16/FP16 Tensor Core: 1,979 teraFLOPS (with sparsity)'; 'BF16 | 133.8 | 989.4 | 1978.9' (vector, matrix, sparse)",
        "dense = the sparse figure / 2 = 989.5e12 (used only in sanity checks)", True),
    "H100_SXM_MEMORY_BYTES": _src(
        H100_SXM_MEMORY_BYTES, "B", _H100_SHEET, "'GPU Memory: 80GB HBM3'",
        "80 GB read as 80e9 B (the device reports a little more: a lower bound)", True),
    "A100_80GB_SXM_HBM_BANDWIDTH": _src(
        A100_80GB_SXM_HBM_BANDWIDTH, "B/s", _A100_SHEET, "'Memory Bandwidth | 1,555GB/s | 1,935GB/s | 1,555GB/s | 2,039GB/s' "
        "(PCIe 40GB, PCIe 80GB, SXM 40GB, SXM 80GB)", "2,039 GB/s = 2.039e12 B/s", True),
    "A100_BF16_DENSE_FLOPS": _src(
        A100_BF16_DENSE_FLOPS, "FLOP/s", _A100_SHEET, "'BF16 | 312 | 624' (matrix, sparse TFLOPS)",
        "312e12 (used only in sanity checks)", True),
    "A100_80GB_MEMORY_BYTES": _src(
        A100_80GB_MEMORY_BYTES, "B", _A100_SHEET, "'A100 VRAM ... 80GB HBM2e' (SXM 80GB)",
        "80 GB read as 80e9 B (a lower bound, as for the H100)", True),
    # --- published serving measurements
    "QWEN_A100_VLLM_SPEED": _src(
        QWEN_A100_VLLM_SPEED, "tokens/s by input length", _QWEN_SPEED,
        "Qwen2.5-7B-Instruct, BF16, 1 GPU: input 1 -> 84.28, 6144 -> 80.70, 14336 -> 77.69, 30720 -> 70.33; "
        "environment 'NVIDIA A100 80GB ... vLLM 0.6.3'; 'batch size of 1'; 'generating 2048 tokens'; "
        "'gpu_memory_utilization=0.9 max_model_len=32768 enforce_eager=False'; the script reports "
        "output_len / (wall time of llm.generate), so the prefill is inside",
        "the four totals T(L) = 2048 / speed lie on a line; its slope and intercept fit prefill_per_token_s and "
        "step_overhead_s + decode_per_seq_s (a100 step costs)", True),
    "QWEN_A100_VLLM_SPEED_64K": _src(
        QWEN_A100_VLLM_SPEED_64K, "tokens/s", _QWEN_SPEED, "input 63488 -> 50.86, note 'setting-64k' (max_model_len=65536)",
        "held out: compared with the preset's prediction, not fitted", True),
    "QWEN_A100_VLLM_SPEED_0P5B": _src(
        311.55, "tokens/s", _QWEN_SPEED, "table '0.5B (vLLM)': Qwen2.5-0.5B-Instruct, input 1, BF16 -> 311.55",
        "supporting reading: 1/311.55 = 3.2 ms a step for ~1 GB of weights, so vLLM 0.6.3's batch-1 loop spends "
        "~2.7 ms a step on host work; this is why the A100 step_overhead_s is well above its weight-streaming floor",
        True),
    "A100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S": _src(
        A100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S, "output tokens/s", _SGLANG_VLLM060,
        "'| inf | 5000 | vLLM | 21.27 | 4132.37 |' (RPS, prompts, engine, request throughput, output token "
        "throughput); vLLM v0.6.0 started with '--num-scheduler-steps 10 --max_model_len 4096'; "
        "'sglang.bench_serving --backend vllm --dataset-name sharegpt --num-prompts 5000'",
        "x LLAMA_TO_QWEN_TIME in time: 4132.37 / 0.948 = 4357 tokens/s for the 7B-class model, "
        "saturated at MAX_NUM_SEQS running sequences", True),
    "A100_LLAMA8B_VLLM_SHAREGPT_REQ_S": _src(
        A100_LLAMA8B_VLLM_SHAREGPT_REQ_S, "requests/s", _SGLANG_VLLM060, "request throughput 21.27 (the same row)",
        "4132.37 / 21.27 = 194.3 generated tokens per ShareGPT request (SHAREGPT_OUTPUT_PER_REQ)", True),
    "H100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S": _src(
        H100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S, "output tokens/s", _LAMBDA,
        "'Llama 3.1 8B: tp=1, rps=inf, num-prompt=5000, max-num-seq=256, max-seq-len=2048' | v0.6.0 | "
        "chunked prefill False | scheduler steps 10 | 8088.35 | median TPOT 25.57 ms. The table names no GPU; "
        "the report's GPUs are H100-80GB-SXM and A100-80GB-SXM, and its 70B row (tp=4, 3542.88) matches "
        "SGLang's vLLM v0.6.0 figure on 4 x H100 (3700.64), so it is read as one H100 80GB SXM",
        "x LLAMA_TO_QWEN_TIME in time: 8088.35 / 0.948 = 8529 tokens/s, saturated at 256 running sequences", True),
    "SHAREGPT_INPUT_PER_OUTPUT": _src(
        SHAREGPT_INPUT_PER_OUTPUT, "prompt tokens per generated token", _SGLANG_ISSUE1639,
        "'Successful requests: 2000', 'Total input tokens: 453502', 'Total generated tokens: 376493' "
        "(sglang.bench_serving on ShareGPT)",
        "453502 / 376493 = 1.205; with 194.3 generated tokens per request, 234.0 prompt tokens per request", True),
    "H100_LLAMA8B_SGLANG_BATCH1_TOK_S": _src(
        H100_LLAMA8B_SGLANG_BATCH1_TOK_S, "tokens/s", _SGLANG_SPEC,
        "'LLaMA-Instruct 3.1 8B tested on MT bench': 'SGLang (w/o speculative, 1x H100) | 158.34 tokens/s' "
        "(SGLang, not vLLM: no vLLM batch-1 H100 figure was found; the page does not state the batch size, "
        "this preset reads it as batch 1)",
        "x LLAMA_TO_QWEN_TIME in time: 1 / 158.34 x 0.948 = 5.99 ms a step (166.96 tokens/s); minus "
        "kv_read x MT_BENCH_CONTEXT_TOKENS = step_overhead_s + decode_per_seq_s", True),
    "MT_BENCH_CONTEXT_TOKENS": _src(
        MT_BENCH_CONTEXT_TOKENS, "tokens", _SGLANG_SPEC, "not stated by the source",
        "assumed mean KV context of an MT-bench decode step; its KV read is 9 us of a 6 ms step", False),
    "H100_LLAMA8B_SGLANG_INPUT_TOK_S": _src(
        H100_LLAMA8B_SGLANG_INPUT_TOK_S, "prompt tokens/s", _SGLANG_PR1060,
        "'python -m sglang.launch_server --model-path meta-llama/Meta-Llama-3.1-8B-Instruct --enable-torch-compile "
        "--disable-radix-cache --disable-flashinfer'; 'sglang.bench_serving --backend sglang --dataset-name random "
        "--num-prompts 1000 --random-input 8192 --random-output 8'; 'Total input tokens: 4064944', "
        "'Total generated tokens: 3930', 'Input token throughput (tok/s): 27670.26'. GPU: H100, per the PR's "
        "title (the benchmark block does not restate it). SGLang, not vLLM: no vLLM H100 prefill figure was found",
        "x LLAMA_TO_QWEN_TIME in time: 1 / 27670.26 x 0.948 = 34.27 us a prompt token (29177 tokens/s), "
        "its attention at ~4k context included", True),
    "VLLM_ACTIVATION_RESERVE_BYTES": _src(
        VLLM_ACTIVATION_RESERVE_BYTES, "B", _VLLM_ISSUE10517,
        "meta-llama/Llama-3.1-8B-Instruct, max-model-len 20000: 'Loading model weights took 14.9888 GB'; "
        "'peak_torch_memory=17.06GiB ... non_torch_memory=0.35GiB ... gpu_memory_utilization=0.90'",
        "(17.06 - 14.9888 + 0.35) GiB = 2.42 GiB that vLLM keeps out of the KV cache (activations at its "
        "profile run and non-torch memory) for an 8B model", True),
    "VLLM_GPU_MEMORY_UTILIZATION": _src(
        VLLM_GPU_MEMORY_UTILIZATION, "fraction", f"{_SGLANG_VLLM060}, section 'Notes'; {_QWEN_SPEED}",
        "'The gpu_memory_utilization of vLLM is by default 0.9 at both TP 1 and TP 4'; "
        "'We use gpu_memory_utilization=0.9 ... by default' (Qwen's vLLM runs)",
        "the share of GPU memory vLLM manages (weights, activation reserve and KV cache)", True),
    # --- preset fields
    "A100_STEP_OVERHEAD_S": _src(
        _A100["step_overhead_s"], "s", f"{_QWEN_SPEED}; {_SGLANG_VLLM060}",
        "batch-1 intercept of the Qwen A100 speed table; ShareGPT 4132.37 output tokens/s",
        f"intercept {_A100['intercept']:.4f} s of T(L) over the 2048 steps, minus the KV reads of the "
        f"growing context, / 2048 = {1e3 * _A100['batch1']:.3f} ms = overhead + decode_per_seq x 2047/2048; the "
        f"ShareGPT run leaves {1e6 * _A100['decode_share']:.1f} us a generated token = overhead / 256 + "
        "decode_per_seq after its KV reads and prefill share; solving both gives the overhead", True),
    "A100_DECODE_PER_SEQ_S": _src(
        _A100["decode_per_seq_s"], "s", f"{_QWEN_SPEED}; {_SGLANG_VLLM060}",
        "as A100_STEP_OVERHEAD_S", "the second unknown of the same two equations", True),
    "A100_KV_READ_PER_TOKEN_S": _src(
        _A100["kv_read_per_token_s"], "s/token", f"{_QWEN_CONFIG}; {_A100_SHEET}",
        "57,344 B a token; 2,039 GB/s", "57,344 / 2.039e12 = 28.1 ns: one read of the KV at peak bandwidth "
        "(no published batch-1 figure separates it from prefill)", False),
    "A100_PREFILL_PER_TOKEN_S": _src(
        _A100["prefill_per_token_s"], "s/token", _QWEN_SPEED,
        "slope of T(L) = 2048 / speed over input lengths 1, 6144, 14336, 30720",
        f"slope {1e6 * _A100['slope']:.1f} us a prompt token minus the 2048 KV reads it adds "
        "(2048 x 28.1 ns) = 97.3 us (~50% of the A100's 312 TFLOP/s at 2 x params FLOPs a token; prompt "
        "attention up to 30k tokens included)", True),
    "H100_STEP_OVERHEAD_S": _src(
        _H100["step_overhead_s"], "s", f"{_SGLANG_SPEC}; {_LAMBDA}",
        "158.34 tokens/s at batch 1; 8088.35 output tokens/s at 256 sequences (both Llama-3.1-8B, scaled)",
        f"batch-1 step {1e3 * _H100['batch1']:.3f} ms = overhead + decode_per_seq; the ShareGPT run leaves "
        f"{1e6 * _H100['decode_share']:.1f} us a generated token = overhead / 256 + decode_per_seq after its "
        "KV reads and prefill share; solving both gives the overhead", True),
    "H100_DECODE_PER_SEQ_S": _src(
        _H100["decode_per_seq_s"], "s", f"{_SGLANG_SPEC}; {_LAMBDA}", "as H100_STEP_OVERHEAD_S",
        "the second unknown of the same two equations", True),
    "H100_KV_READ_PER_TOKEN_S": _src(
        _H100["kv_read_per_token_s"], "s/token", f"{_QWEN_CONFIG}; {_H100_SHEET}",
        "57,344 B a token; 3.35 TB/s", "57,344 / 3.35e12 = 17.1 ns: one read of the KV at peak bandwidth", False),
    "H100_PREFILL_PER_TOKEN_S": _src(
        _H100["prefill_per_token_s"], "s/token", _SGLANG_PR1060, "27670.26 input tokens/s",
        "1 / 27670.26 x 0.948 - kv_read (the preset charges a prompt token's KV write as a read) = 34.3 us "
        "(~45% of 989.5 TFLOP/s at 2 x params FLOPs a token)", True),
    "KV_CAPACITY_TOKENS_80GB": _src(
        _A100["kv_capacity_tokens"], "tokens", f"{_A100_SHEET}; {_H100_SHEET}; {_QWEN_CONFIG}; {_VLLM_ISSUE10517}",
        "80 GB; bf16 weights 15.23 GB; reserve 2.42 GiB; 57,344 B a token",
        "(0.9 x 80e9 - 15.23e9 - 2.42 GiB) / 57,344 B, down to a whole 16-token block = 944,624 tokens "
        "(same for both 80 GB GPUs)", False),
    "MAX_NUM_SEQS": _src(
        MAX_NUM_SEQS, "sequences", _LAMBDA, "'For all tests, we set max-num-seq=256'",
        "the scheduler limit of the saturated runs the costs were fitted to (also vLLM's long-standing default)", True),
    "MAX_NUM_BATCHED_TOKENS": _src(
        MAX_NUM_BATCHED_TOKENS, "tokens", _COST_MODEL,
        "'max_num_batched_tokens = 8192 (vLLM V1's default chunked-prefill token budget for online serving)'",
        "a configuration, not a measurement; as the analytic preset", False),
    "BLOCK_SIZE": _src(
        BLOCK_SIZE, "tokens", _COST_MODEL, "'the H100 preset's FlashAttention backend uses 16'",
        "vLLM's KV block on CUDA: a configuration, not a measurement", False),
    "PREFILL_ATTN_PER_PAIR_S": _src(
        0.0, "s/pair", _COST_MODEL, "'0 in the analytic presets'",
        "not modelled: the quadratic part of prompt attention is folded into prefill_per_token_s (the A100's "
        "slope spans prompts up to 30k tokens; the H100's prefill figure has ~4k-token prompts)", False),
    "SPEC_STEP_S": _src(
        0.0, "s", _COST_MODEL, "'0: a draft token costs a prefill token and a drafting step nothing more'",
        "not modelled: no published drafting costs for this setup", False),
    "DRAFT_TOKEN_S": _src(
        0.0, "s/token", _COST_MODEL, "'0: a draft token costs a prefill token'", "not modelled, as SPEC_STEP_S", False),
    "DRAFT_CONTEXT_TOKEN_S": _src(
        0.0, "s/token", _COST_MODEL, "'on a GPU one read of the KV serves all of a request's query tokens (about 0)'",
        "not modelled", False),
    "CONTENTION": _src(
        1.0, "factor", _COST_MODEL, "'1 (the presets): independent accelerators, as GPUs are'",
        "one engine a GPU: no slowdown from the other engines", False),
}

#: preset -> CostModel field -> the SOURCES entry its value comes from
FIELD_SOURCES: Dict[str, Dict[str, str]] = {
    name: {
        "step_overhead_s": f"{gpu}_STEP_OVERHEAD_S", "decode_per_seq_s": f"{gpu}_DECODE_PER_SEQ_S",
        "kv_read_per_token_s": f"{gpu}_KV_READ_PER_TOKEN_S", "prefill_per_token_s": f"{gpu}_PREFILL_PER_TOKEN_S",
        "kv_capacity_tokens": "KV_CAPACITY_TOKENS_80GB", "max_num_seqs": "MAX_NUM_SEQS",
        "max_num_batched_tokens": "MAX_NUM_BATCHED_TOKENS", "block_size": "BLOCK_SIZE",
        "prefill_attn_per_pair_s": "PREFILL_ATTN_PER_PAIR_S", "spec_step_s": "SPEC_STEP_S",
        "draft_token_s": "DRAFT_TOKEN_S", "draft_context_token_s": "DRAFT_CONTEXT_TOKEN_S", "contention": "CONTENTION",
    }
    for name, gpu in (("a100_qwen7b_published", "A100"), ("h100_qwen7b_published", "H100"))
}

# ------------------------------------------------------------------ the figures each preset must reproduce
_SHAREGPT = (MAX_NUM_SEQS, SHAREGPT_PROMPT_PER_REQ, SHAREGPT_OUTPUT_PER_REQ)

#: preset, what, the SOURCES entry, the published tokens/s for the 7B-class model, the predictor
#: (a function of the CostModel) and the stated tolerance; ``fitted`` False: held out
PUBLISHED_FIGURES: List[Dict[str, Any]] = [
    *({"preset": "a100_qwen7b_published", "figure": f"Qwen2.5-7B vLLM batch 1, prompt {n}", "source": "QWEN_A100_VLLM_SPEED",
       "published_tok_s": QWEN_A100_VLLM_SPEED[n], "fitted": True, "tolerance": 0.02,
       "predict": (lambda m, n=n: speed_benchmark_tokens_per_s(m, n))} for n in sorted(QWEN_A100_VLLM_SPEED)),
    {"preset": "a100_qwen7b_published", "figure": "Llama-3.1-8B vLLM ShareGPT, 256 seqs",
     "source": "A100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S",
     "published_tok_s": A100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S / LLAMA_TO_QWEN_TIME, "fitted": True, "tolerance": 0.02,
     "predict": lambda m: saturated_tokens_per_s(m, *_SHAREGPT)},
    {"preset": "a100_qwen7b_published", "figure": "Qwen2.5-7B vLLM batch 1, prompt 63488", "source": "QWEN_A100_VLLM_SPEED_64K",
     "published_tok_s": QWEN_A100_VLLM_SPEED_64K, "fitted": False, "tolerance": 0.25,
     "predict": lambda m: speed_benchmark_tokens_per_s(m, 63488)},
    {"preset": "h100_qwen7b_published", "figure": "Llama-3.1-8B SGLang batch 1, MT-bench",
     "source": "H100_LLAMA8B_SGLANG_BATCH1_TOK_S",
     "published_tok_s": H100_LLAMA8B_SGLANG_BATCH1_TOK_S / LLAMA_TO_QWEN_TIME, "fitted": True, "tolerance": 0.02,
     "predict": lambda m: single_stream_tokens_per_s(m, MT_BENCH_CONTEXT_TOKENS)},
    {"preset": "h100_qwen7b_published", "figure": "Llama-3.1-8B vLLM ShareGPT, 256 seqs",
     "source": "H100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S",
     "published_tok_s": H100_LLAMA8B_VLLM_SHAREGPT_OUTPUT_TOK_S / LLAMA_TO_QWEN_TIME, "fitted": True, "tolerance": 0.02,
     "predict": lambda m: saturated_tokens_per_s(m, *_SHAREGPT)},
    {"preset": "h100_qwen7b_published", "figure": "Llama-3.1-8B SGLang prefill, prompts <= 8k",
     "source": "H100_LLAMA8B_SGLANG_INPUT_TOK_S",
     "published_tok_s": H100_LLAMA8B_SGLANG_INPUT_TOK_S / LLAMA_TO_QWEN_TIME, "fitted": True, "tolerance": 0.02,
     "predict": lambda m: marginal_prefill_tokens_per_s(m, 4096)},
]


def published_checks() -> List[Dict[str, Any]]:
    """Every published figure with the preset's prediction and the relative error."""
    rows = []
    for f in PUBLISHED_FIGURES:
        predict: Callable[[CostModel], float] = f["predict"]
        predicted = predict(GPU_PRESETS[f["preset"]])
        rows.append({**{k: v for k, v in f.items() if k != "predict"}, "predicted_tok_s": predicted,
                     "error": predicted / f["published_tok_s"] - 1.0})
    return rows
