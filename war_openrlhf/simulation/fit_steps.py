"""Fit the machine model to the steps a real rollout ran (:mod:`war_openrlhf.engine.step_record`).

Each recorded step carries the work the simulator prices (decoding sequences, attended
context, prefill tokens and pairs, draft tokens and their context) and its time: the period
since the engine's previous step ended when requests remained (the next step starts at once),
else the step's own span. A step's cost is stretched by the other engines computing beside it
on a shared host, as the simulator models it (``CostModel.contention``): ``seconds = (1 + (c - 1)
* f) * cost(work)``, ``f`` the share of the step's time the other engines spent in a step of
their own (from every engine's records, one host clock). The fit:

1. ``c`` on a grid (1 to 3), and for each, the base costs by
   :func:`~war_openrlhf.simulation.fit.fit_cost_model` on the steps that verified no draft,
   each step's time divided by its stretch; the ``c`` with the least squared relative error
   wins (the smallest among equals: a run whose engines were always busy together cannot tell
   contention from cost, and then the costs carry it);
2. the drafting costs by :func:`~war_openrlhf.simulation.fit.fit_spec_costs` on the steps that
   verified drafts, priced beyond the base costs.

Steps are summed in bins of like work before fitting (decoding sequences, and the powers of two
of the context, the prefill and the drafts), so one stalled step among many weighs as little
as it costs in a run; each bin is a :class:`~war_openrlhf.simulation.fit.StepRun`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .cost_model import CostModel
from .fit import SpecRun, StepRun, fit_cost_model, fit_spec_costs

__all__ = ["DRAFTERS", "ENGINE_KINDS", "fit_rollout_steps", "is_kind", "step_table"]

_GRID = np.round(np.arange(1.0, 3.0001, 0.02), 4)


def _periods(cols: dict[str, np.ndarray]) -> np.ndarray:
    """Each step's seconds: since the previous step's end if the engine stayed busy, else its own span."""
    t0, t1, busy = cols["t_start"], cols["t_end"], cols["busy_before"] > 0
    prev_end = np.concatenate(([np.nan], t1[:-1]))
    period = np.where(busy & np.isfinite(prev_end), t1 - prev_end, t1 - t0)
    return period


def _busy_sum(starts: np.ndarray, ends: np.ndarray, others: Sequence[tuple[np.ndarray, np.ndarray]]
             ) -> np.ndarray:
    """Per interval ``[starts, ends]``: the sum over ``others`` (each a sorted list of disjoint
    busy intervals) of the share of it they were busy."""
    if not others:
        return np.zeros(len(starts))
    width = np.maximum(ends - starts, 1e-12)
    total = np.zeros(len(starts))
    for os_, oe in others:
        cum = np.concatenate(([0.0], np.cumsum(oe - os_)))

        def busy_until(t: np.ndarray) -> np.ndarray:
            i = np.searchsorted(os_, t, side="right")  # intervals starting at or before t
            last = np.maximum(i - 1, 0)
            partial = np.where(i > 0, np.clip(t - os_[last], 0.0, oe[last] - os_[last]), 0.0)
            return cum[last] + partial

        total += np.clip((busy_until(ends) - busy_until(starts)) / width, 0.0, 1.0)
    return total


#: Which recorded engines a fit prices: ``plain`` (no speculative config), ``speculative`` (every
#: engine with one, whoever drafts), or one drafter (``war_index``: WAR's replica, ``vllm_suffix``:
#: vLLM's own suffix method), whose drafting costs differ (the header's ``drafter``).
DRAFTERS = ("war_index", "vllm_suffix")
ENGINE_KINDS = ("plain", "speculative") + DRAFTERS


def is_kind(header: dict[str, Any], kind: str) -> bool:
    """Whether the engine whose record header is ``header`` is of ``kind`` (:data:`ENGINE_KINDS`)."""
    if kind in ("plain", "speculative"):
        return header.get("engine_kind") == kind
    return header.get("engine_kind") == "speculative" and header.get("drafter") == kind


def step_table(engines: Sequence[Any], engines_per_run: int, kind: str = "speculative") -> dict[str, np.ndarray]:
    """Every engine's steps as columns (the record's work, ``seconds``, ``other_busy``, ``mine``:
    1 for the steps of the ``kind`` engines, :func:`is_kind`). ``engines`` are every engine of one
    host's run (engines of configurations that were stopped meanwhile add nothing);
    ``other_busy`` is the other engines' summed busy share of each step over
    ``engines_per_run - 1`` (at most 1), as the simulator counts them."""
    spans = []
    for e in engines:
        p = _periods(e.columns)
        spans.append((e.columns["t_end"] - p, e.columns["t_end"]))
    parts: dict[str, list[np.ndarray]] = {}
    for k, e in enumerate(engines):
        starts, ends = spans[k]
        order = np.argsort(starts)
        others = []
        for j, (s, t) in enumerate(spans):
            if j != k:
                o = np.argsort(s)
                others.append((s[o], t[o]))
        frac = np.empty(len(starts))
        frac[order] = _busy_sum(starts[order], ends[order], others) / max(engines_per_run - 1, 1)
        frac = np.minimum(frac, 1.0)
        cols = dict(e.columns)
        cols["seconds"] = ends - starts
        cols["other_busy"] = frac
        cols["mine"] = np.full(len(starts), is_kind(e.header, kind), dtype=np.float64)
        cols["first"] = (np.arange(len(starts)) == 0).astype(np.float64)  # the engine's start-up step
        for name, v in cols.items():
            parts.setdefault(name, []).append(np.asarray(v, dtype=np.float64))
    return {name: np.concatenate(v) for name, v in parts.items()}


def _pow2(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, np.floor(np.log2(np.maximum(x, 1.0))) + 1, 0)


def _groups(t: dict[str, np.ndarray], mask: np.ndarray, min_steps: int) -> list[np.ndarray]:
    """Indices of the ``mask`` steps in each bin of like work that holds at least ``min_steps``."""
    idx = np.flatnonzero(mask)
    if not len(idx):
        return []
    keys = np.stack([t["decode_seqs"][idx], _pow2(t["context_tokens"][idx]), _pow2(t["prefill_tokens"][idx]),
                     _pow2(t["draft_tokens"][idx])], axis=1)
    _, inv, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)
    order = np.argsort(inv, kind="stable")
    return [g for g in np.split(idx[order], np.cumsum(counts)[:-1]) if len(g) >= min_steps]


def _bins(t: dict[str, np.ndarray], seconds: np.ndarray, groups: list[np.ndarray]) -> list[SpecRun]:
    """Each group's steps summed into one run of like work (its time from ``seconds``)."""
    runs = []
    for g in groups:
        def s(name: str) -> float:
            return float(t[name][g].sum())

        runs.append(SpecRun(StepRun(kind="prefill" if t["prefill_tokens"][g[0]] > 0 else "decode",
                                    steps=float(len(g)), decode_seqs=s("decode_seqs"),
                                    context_tokens=s("context_tokens"), prefill_tokens=s("prefill_tokens"),
                                    seconds=float(seconds[g].sum()), prefill_pairs=s("prefill_pairs")),
                            spec_steps=float((t["draft_tokens"][g] > 0).sum()),
                            draft_tokens=s("draft_tokens"), draft_context_tokens=s("draft_context_tokens")))
    return runs


def fit_rollout_steps(runs: Sequence[Sequence[Any]], *, kind: str, engines_per_run: int, name: str,
                      min_steps: int = 3, max_period_s: float = 5.0) -> tuple[CostModel, dict[str, Any]]:
    """The cost model (base, drafting and ``contention``) of the ``kind`` engines (:data:`ENGINE_KINDS`)
    that best explains their recorded steps, and a report. ``runs``: per run
    (one host, one recording directory), every engine's
    :class:`~war_openrlhf.engine.step_record.EngineSteps`; ``engines_per_run``: how many engines
    each configuration ran at once. The limits come from the header of the matching engine
    that ran the most steps."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"kind: expected one of {', '.join(ENGINE_KINDS)}, got {kind!r}")
    if engines_per_run < 1:
        raise ValueError(f"engines_per_run: must be >= 1, got {engines_per_run!r}")
    engines = [e for run in runs for e in run if is_kind(e.header, kind)]
    if not engines:
        unnamed = [str(e.path) for run in runs for e in run
                   if e.header.get("engine_kind") == "speculative" and "drafter" not in e.header]
        hint = ""
        if unnamed and kind in DRAFTERS:
            hint = (f"; {len(unnamed)} speculative engine(s) were recorded before records named their drafter "
                    f"(e.g. {unnamed[0]}): fit them as 'speculative' or record again")
        raise ValueError(f"runs: no {kind} engine among the step records "
                         f"({', '.join(str(e.path) for run in runs for e in run) or 'none'}){hint}")
    tables = [step_table(run, engines_per_run, kind) for run in runs if run]
    t = {k: np.concatenate([tb[k] for tb in tables]) for k in tables[0]}
    mine = t["mine"] > 0
    # an engine's first step pays its one-time start-up (seconds for a few hundred tokens), as
    # the benchmarks' warm-up runs do: it prices nothing a rollout step repeats
    ok = mine & (t["first"] == 0) & (t["seconds"] > 0) & (t["seconds"] <= max_period_s)
    base_mask = ok & (t["draft_tokens"] == 0)
    spec_mask = ok & (t["draft_tokens"] > 0)
    if base_mask.sum() < 16:
        raise ValueError(f"engines: {int(base_mask.sum())} steps without drafts in "
                         f"{', '.join(str(e.path) for e in engines)}; need at least 16 to fit the base costs")
    top = max(engines, key=len)  # the engines that ran most of the steps (a probe engine may differ)
    try:
        limits = {k: int(top.header[k]) for k in ("kv_capacity_tokens", "max_num_seqs", "max_num_batched_tokens",
                                                   "block_size")}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{top.path}: line 1: the header lacks an engine limit ({exc!r})") from exc
    best = None
    base_groups = _groups(t, base_mask, min_steps)  # the bins do not depend on the contention tried
    grid = _GRID if engines_per_run > 1 else _GRID[:1]
    for c in grid:
        stretch = 1.0 + (c - 1.0) * t["other_busy"]
        runs = [r.plain for r in _bins(t, t["seconds"] / stretch, base_groups)]
        if len(runs) < 5:
            continue
        weights = [r.seconds for r in runs]  # a bin counts as much as the time it takes
        model, report = fit_cost_model(runs, name=name, weights=weights, **limits)
        ratios = np.array([r["ratio"] for r in report["runs"]])
        err = float(np.sum(np.asarray(weights) * (ratios - 1.0) ** 2))
        if best is None or err < best[0] * (1 - 1e-6):
            best = (err, float(c), model, report)
    if best is None:
        raise ValueError(f"engines: their steps fill fewer than 5 bins of like work (min_steps={min_steps}); "
                         f"record a longer rollout")
    _, c, model, report = best
    model = model.with_overrides(contention=c)
    spec_report = None
    stretch = 1.0 + (c - 1.0) * t["other_busy"]
    spec_runs = _bins(t, t["seconds"] / stretch, _groups(t, spec_mask, min_steps))
    if len(spec_runs) >= 3:
        model, spec_report = fit_spec_costs(model, spec_runs, weights=[r.plain.seconds for r in spec_runs])
    busy = t["other_busy"][ok]
    return model, {
        "engine_kind": kind, "engines": len(engines), "engines_per_run": engines_per_run, "steps": int(ok.sum()),
        "steps_dropped": int((mine & ~ok).sum()), "drafting_steps": int(spec_mask.sum()),
        "contention": c, "other_busy_mean": round(float(busy.mean()), 4) if len(busy) else 0.0,
        "base": report, "drafting": spec_report,
    }
