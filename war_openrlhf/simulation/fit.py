"""Fit a :class:`~.cost_model.CostModel` to step timings measured on a real engine.

The simulator stands behind cluster-scale claims only where it matches real engines; its
costs must therefore come from measurements, fitted in code. A measurement is a run of
engine steps whose work is known (``tools/bench_engine.py --fit-costs`` makes them: prompts
of known length prefilled, batches of known size decoded for a known number of steps); the
cost model is linear in that work,

    seconds = steps * step_overhead_s + decode_seqs * decode_per_seq_s
              + context_tokens * kv_read_per_token_s + prefill_tokens * prefill_per_token_s
              + prefill_pairs * prefill_attn_per_pair_s

(each term summed over the run's steps), so the five costs are a non-negative least-squares
fit. Rows are weighted by 1 / seconds: the fit minimises *relative* error, so a 2 ms decode
run counts as much as a 2 s prefill. The report gives each run's predicted / measured ratio.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

import numpy as np

from .cost_model import CostModel

__all__ = ["StepRun", "SpecRun", "fit_cost_model", "fit_spec_costs"]

_COSTS = ("step_overhead_s", "decode_per_seq_s", "kv_read_per_token_s", "prefill_per_token_s",
          "prefill_attn_per_pair_s")


@dataclass(frozen=True)
class StepRun:
    """One measured run of engine steps: the work summed over its steps, and its wall time."""

    kind: str  # "prefill" | "decode": what the run exercised (for the report)
    steps: float
    decode_seqs: float
    context_tokens: float
    prefill_tokens: float
    seconds: float
    prefill_pairs: float = 0.0  # prefill attention pairs (see CostModel.prefill_attn_per_pair_s)

    def features(self) -> list[float]:
        return [self.steps, self.decode_seqs, self.context_tokens, self.prefill_tokens, self.prefill_pairs]


@dataclass(frozen=True)
class SpecRun:
    """A measured run of a drafting engine: its plain work (as :class:`StepRun`), the steps
    that verified drafts and the draft tokens verified, and its wall time."""

    plain: StepRun
    spec_steps: float
    draft_tokens: float
    draft_context_tokens: float = 0.0  # sum over verified draft tokens of their request's context


def fit_spec_costs(model: CostModel, runs: Sequence[SpecRun], *,
                   weights: Sequence[float] | None = None) -> tuple[CostModel, dict[str, Any]]:
    """``model`` with ``spec_step_s``, ``draft_token_s`` and ``draft_context_token_s`` fitted to
    drafting runs: what each run took beyond ``model``'s price of its plain work (non-negative
    least squares on relative error, as :func:`fit_cost_model`). Runs that record no draft
    context (all zero) fit the first two only. ``weights``: each run's weight in the squared
    relative error (default: all equal)."""
    if len(runs) < 2:
        raise ValueError(f"runs: need at least 2 drafting runs to fit 2 costs, got {len(runs)}")
    base = np.array([np.dot(r.plain.features(), [getattr(model, c) for c in _COSTS]) for r in runs])
    y = np.array([r.plain.seconds for r in runs])
    a = np.array([[r.spec_steps, r.draft_tokens, r.draft_context_tokens] for r in runs], dtype=np.float64)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    w = _row_weights(weights, len(runs))
    x = _nnls((a / scale) / y[:, None] * w[:, None], (y - base) / y * w) / scale
    fitted = replace(model, spec_step_s=float(x[0]), draft_token_s=float(x[1]), draft_context_token_s=float(x[2]))
    predicted = base + a @ x
    ratios = predicted / y
    report = {
        "costs": {"spec_step_s": float(x[0]), "draft_token_s": float(x[1]), "draft_context_token_s": float(x[2])},
        "runs": [{**asdict(r.plain), "spec_steps": r.spec_steps, "draft_tokens": r.draft_tokens,
                  "draft_context_tokens": r.draft_context_tokens,
                  "predicted_s": float(p), "ratio": round(float(q), 4)} for r, p, q in zip(runs, predicted, ratios)],
        "max_relative_error": round(float(np.max(np.abs(ratios - 1.0))), 4),
        "median_relative_error": round(float(np.median(np.abs(ratios - 1.0))), 4),
    }
    return fitted, report


def _row_weights(weights: Sequence[float] | None, n: int) -> np.ndarray:
    """The square roots of the runs' weights (rows of the least squares), validated."""
    if weights is None:
        return np.ones(n)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not (w > 0).all():
        raise ValueError(f"weights: need {n} positive weights, got {w.tolist()!r}")
    return np.sqrt(w)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares (Lawson-Hanson active set; 4 unknowns, so plain numpy)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(10 * n):
        w = a.T @ (b - a @ x)
        if passive.all() or (w[~passive] <= 1e-12 * max(1.0, np.abs(w).max())).all():
            break
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit_cost_model(
    runs: Sequence[StepRun],
    *,
    name: str,
    kv_capacity_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    weights: Sequence[float] | None = None,
) -> tuple[CostModel, dict[str, Any]]:
    """The cost model that best explains ``runs`` (relative least squares, costs >= 0), and a report.

    ``weights``: each run's weight in the squared relative error (default: all equal; a fit to a
    rollout's steps weighs each bin by its seconds, so that a few long prefill bins count as
    much as the time they take, not as little as their number).

    The engine limits (KV capacity, scheduler limits, block size) are the measured engine's
    own, passed in. Report: the fitted costs, each run's predicted / measured ratio, and the
    worst relative error.
    """
    if len(runs) < len(_COSTS):
        raise ValueError(f"runs: need at least {len(_COSTS)} measured runs to fit {len(_COSTS)} costs, "
                         f"got {len(runs)}")
    for i, r in enumerate(runs):
        if not r.seconds > 0:
            raise ValueError(f"runs[{i}].seconds: must be > 0, got {r.seconds!r}")
    a = np.array([r.features() for r in runs], dtype=np.float64)
    y = np.array([r.seconds for r in runs], dtype=np.float64)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    w = _row_weights(weights, len(runs))
    weighted = (a / scale) / y[:, None] * w[:, None]
    x = _nnls(weighted, w) / scale
    costs = dict(zip(_COSTS, (float(v) for v in x)))
    model = CostModel(
        name=name,
        kv_capacity_tokens=int(kv_capacity_tokens),
        max_num_seqs=int(max_num_seqs),
        max_num_batched_tokens=int(max_num_batched_tokens),
        block_size=int(block_size),
        **costs,
    )
    predicted = a @ x
    ratios = predicted / y
    report = {
        "costs": costs,
        "runs": [{**asdict(r), "predicted_s": float(p), "ratio": round(float(q), 4)}
                 for r, p, q in zip(runs, predicted, ratios)],
        "max_relative_error": round(float(np.max(np.abs(ratios - 1.0))), 4),
        "median_relative_error": round(float(np.median(np.abs(ratios - 1.0))), 4),
    }
    return model, report
