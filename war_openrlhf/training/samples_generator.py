"""OpenRLHF's samples generator, with rollouts by the WAR pool.

:class:`WarSamplesGenerator` keeps the contract of OpenRLHF 0.11.2's
``SamplesGenerator`` (``generate_samples(**generate_kwargs) -> (experiences,
filter_pass_rate, prompts_consumed, exhausted)``, ``generate_eval_samples``, the
``vllm_generate_batch_size`` over-sampling buffer, dynamic filtering by group score), so
OpenRLHF's trainers (sync and async) run it unchanged. What differs is underneath: prompts go
to a :class:`~war_openrlhf.rollout.RolloutPool` (per-turn dispatch, global suffix index,
load-aware speculation) instead of whole prompts to engine actors running
``MultiTurnAgentExecutor``; trajectories come back as OpenRLHF ``Experience`` objects built by
OpenRLHF's own conversion (:func:`~war_openrlhf.rollout.to_experiences`).

``metrics`` holds the last rollout's figures (throughput, speculation, cache, per-engine
load and switch decisions, dispatcher moves and waits, per-turn time split, index size and
log lag, rewards, episode lengths), each a value of that batch alone. They travel with the
samples: every ``Experience`` of the batch carries them in its ``info``, which OpenRLHF
averages into the step's status, so they are logged once, at the trainer's global step, as
``train/war/...`` in every logger OpenRLHF drives (TensorBoard and wandb), by the sync and
the async trainer alike.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np

from ..engine.stats import EngineStats
from ..metrics.tail import tail_figures
from ..rollout import RolloutConfig, RolloutPool, to_experiences
from ..rollout.trajectory import uniform_info
from ..versions import check_openrlhf_version


#: The dispatcher's counters that run since its start: reported per batch (differenced).
_CUMULATIVE_DISPATCH = ("moves", "deferrals", "thrash_verdicts")


def rollout_metrics(result, pool: RolloutPool, before: list[EngineStats], after: list[EngineStats],
                    policy_before: dict[str, float] | None = None) -> dict[str, float]:
    """Scalars for one rollout batch (names as they appear in TensorBoard under train/), each
    a figure of this batch alone. ``policy_before``: the dispatcher's ``metrics()`` at the
    batch's start (its running counters are differenced)."""
    m: dict[str, float] = {
        "war/rollout_tokens_per_s": result.tokens_per_s,
        "war/rollout_wall_s": result.wall_s,
        "war/generated_tokens": float(result.generated_tokens),
        "war/turns": float(result.turns),
        "war/prefix_hit_rate_engine": result.prefix_hit_rate,
        "war/redispatched_turns": float(result.redispatched_turns),
        "war/deferred_turns": float(result.deferrals),
        # how long deferred turns waited for KV room, per deferral (admission's cost)
        "war/deferred_wait_s_mean": (float(getattr(result, "deferred_wait_s", 0.0)) / result.deferrals
                                     if result.deferrals else 0.0),
        "war/episode_turns_mean": float(np.mean([len(t.turns) for t in result.trajectories])),
        "war/episode_tokens_mean": float(np.mean([len(t.token_ids) for t in result.trajectories])),
        "war/reward_mean": float(np.mean([t.reward for t in result.trajectories])),
        "war/episodes_failed": float(sum(t.end_reason.endswith("error") for t in result.trajectories)),
    }
    # the step's straggler: share of the rollout after 90% of trajectories ended, p99 / p50 duration
    for k, v in tail_figures([t.finished_s for t in result.trajectories],
                             [t.wall_s for t in result.trajectories]).items():
        m[f"war/{k}"] = v
    # the dispatcher's own estimate of prefix hits (WAR's block model), when it keeps one
    est = [pool.policy.estimated_cached_tokens(r.engine, np.asarray(t.token_ids[:r.start], dtype=np.int32))
           for t in result.trajectories for r in t.turns[:1]]
    if est and all(e is not None for e in est):
        prompt = [r.start for t in result.trajectories for r in t.turns[:1]]
        m["war/prefix_hit_rate_dispatcher_first_turn"] = sum(est) / max(sum(prompt), 1)
    _speculation_metrics(before, after, m)
    _turn_metrics(result, m)
    for i, n in enumerate(result.engine_turns):
        m[f"war/engine{i}_turns"] = float(n)
    for i, s in enumerate(after):
        m[f"war/engine{i}_kv_usage"] = s.kv_cache_usage
    m["war/index_sync_errors"] = float(sum(e.sync_errors for e in pool.engines))
    m["war/engines_healthy"] = float(sum(e.healthy for e in pool.engines))
    m["war/engines_recovered"] = float(getattr(result, "engines_recovered", 0))
    m["war/index_sync_lag_records"] = float(sum(s.sync_lag_records for s in after))
    # what the pool holds across batches (bounded over a long job: tools/long_run.py)
    m["war/log_entries"] = float(len(pool.log))
    m["war/archive_records"] = float(len(pool.shipper.archive))
    _index_metrics(after, m)
    # what the dispatcher measured and decided (war: moves, deferrals, prefix reuse lost,
    # fitted rates), so a user sees why it placed turns where it did
    for k, v in pool.policy.metrics().items():
        if k in _CUMULATIVE_DISPATCH and policy_before is not None:
            v = v - policy_before.get(k, 0.0)
        m[f"war/dispatch_{k}"] = float(v)
    return m


def _speculation_metrics(before: list[EngineStats], after: list[EngineStats], m: dict[str, float]) -> None:
    """Drafts, acceptance and the switch's decisions over the batch (engine counters differenced)."""
    tot = {k: 0.0 for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "generation_tokens",
                            "steps")}
    for i, (b, a) in enumerate(zip(before, after)):
        diff = a.minus(b)
        for k in tot:
            tot[k] += diff[k]
        # per engine: the switch decides per engine, so a user sees where drafts pay
        m[f"war/engine{i}_spec_acceptance_rate"] = (diff["spec_accepted_tokens"] / diff["spec_draft_tokens"]
                                                    if diff["spec_draft_tokens"] else 0.0)
        m[f"war/engine{i}_tokens_per_verification_step"] = (1.0 + diff["spec_accepted_tokens"] / diff["spec_drafts"]
                                                            if diff["spec_drafts"] else 1.0)
    m["war/tokens_per_engine_step"] = tot["generation_tokens"] / tot["steps"] if tot["steps"] else 0.0
    m["war/spec_acceptance_rate"] = (tot["spec_accepted_tokens"] / tot["spec_draft_tokens"]
                                     if tot["spec_draft_tokens"] else 0.0)
    m["war/tokens_per_verification_step"] = (1.0 + tot["spec_accepted_tokens"] / tot["spec_drafts"]
                                             if tot["spec_drafts"] else 1.0)
    # this batch's share of engine steps that drafted (the switch's counters, differenced)
    spec_steps = steps = 0
    for i, (b, a) in enumerate(zip(before, after)):
        sw_b, sw_a = (b.war.get("switch") or {}), (a.war.get("switch") or {})
        if "steps" in sw_a:
            d_steps = int(sw_a.get("steps", 0)) - int(sw_b.get("steps", 0))
            d_spec = int(sw_a.get("spec_steps", 0)) - int(sw_b.get("spec_steps", 0))
            steps, spec_steps = steps + d_steps, spec_steps + d_spec
            m[f"war/engine{i}_speculating_fraction"] = d_spec / d_steps if d_steps else 0.0
            # the switch's decision and the gain it measured (what switch.threshold is compared with)
            m[f"war/engine{i}_switch_speculating"] = float(bool(sw_a.get("speculating")))
            if sw_a.get("expected_gain") is not None:
                m[f"war/engine{i}_switch_expected_gain"] = float(sw_a["expected_gain"])
            m[f"war/engine{i}_switch_decisions"] = float(int(sw_a.get("decisions", 0)) - int(sw_b.get("decisions", 0)))
            # the cost-aware cut-off the switch derived (switch.cost_aware_drafts, min_token_prob_floor)
            if sw_a.get("min_token_prob") is not None:
                m[f"war/engine{i}_draft_min_token_prob"] = float(sw_a["min_token_prob"])
    m["war/speculating_fraction"] = spec_steps / steps if steps else 0.0
    # where this batch's drafts came from: the share of the group's turns still generating
    # (index.inflight_sharing), against finished turns, the request's own context and the rest
    drafts: dict[str, float] = {}
    for b, a in zip(before, after):
        d_b, d_a = (b.war.get("drafts") or {}), (a.war.get("drafts") or {})
        for source, n in d_a.items():
            drafts[source] = drafts.get(source, 0.0) + float(n) - float(d_b.get(source, 0))
    if sum(drafts.values()) > 0:
        m["war/drafts_inflight_share"] = drafts.get("inflight", 0.0) / sum(drafts.values())


def _turn_metrics(result, m: dict[str, float]) -> None:
    """Where a turn's time went."""
    # where a turn's time went, per turn: waiting for an engine slot (dispatch to first
    # token is inside generate), generating, and in the environment
    turns = [r for t in result.trajectories for r in t.turns]
    if turns:
        m["war/turn_generate_s_mean"] = float(np.mean([r.generate_s for r in turns]))
        m["war/turn_tool_s_mean"] = float(np.mean([r.tool_s for r in turns]))
        m["war/turn_attempts_mean"] = float(np.mean([r.attempts for r in turns]))
        queued = [r.queue_s for r in turns if r.queue_s is not None]
        if queued:  # inside the engine: waiting for the scheduler, then the prefill
            m["war/turn_queue_s_mean"] = float(np.mean(queued))
            m["war/turn_queue_s_max"] = float(np.max(queued))
            m["war/turn_prefill_s_mean"] = float(np.mean([r.prefill_s for r in turns if r.prefill_s is not None] or [0.0]))


def _index_metrics(after: list[EngineStats], m: dict[str, float]) -> None:
    """The replicas' size, and what drafting costs each engine step."""
    index = [(st.war.get("index") or {}) for st in after]
    for key, name in (("records", "index_records"), ("indexed_tokens", "index_tokens"),
                      ("records_evicted", "index_records_evicted")):
        vals = [ix.get(key) for ix in index if isinstance(ix.get(key), (int, float))]
        if vals:
            m[f"war/{name}"] = float(max(vals))  # replicas agree; the largest is the furthest along
    # what drafting costs each engine step (the replica's step trace): the budget a user tunes
    # with the index's apply_budget_ms / max_spec_factor, and the log backlog it leaves
    traces = [st.war.get("step_trace") or {} for st in after]
    p50 = [t["drafter_us"]["p50"] for t in traces if t.get("steps")]
    if p50:
        m["war/drafter_step_us_p50"] = float(max(p50))
        m["war/drafter_step_us_p99"] = float(max(t["drafter_us"]["p99"] for t in traces if t.get("steps")))
    pending = [(st.war.get("index") or {}).get("pending_entries") for st in after]
    if any(p is not None for p in pending):
        m["war/index_pending_entries"] = float(sum(p or 0 for p in pending))


class RolloutFailed(RuntimeError):
    """Episodes failed for reasons outside the policy (engine, environment, agent file) after
    their retries, and the settings say to fail the step (``on_failed_episode: fail``)."""


def healthy_groups(trajectories: list, n: int, on_failed: str) -> tuple[list, int]:
    """The trajectories a trainer may use: whole GRPO groups (``n`` consecutive samples of a
    prompt) of healthy episodes. A failed episode (engine, environment or agent-file error,
    :data:`~war_openrlhf.rollout.trajectory.FAILED_END_REASONS`) is never a sample (its reward
    0 would read as the policy's failure and skew its group's advantages): ``on_failed``
    ``fail`` raises :class:`RolloutFailed` naming the reasons; ``drop_group`` leaves out each
    group that holds one, with a warning. Returns (kept, groups dropped)."""
    import logging

    from ..rollout.trajectory import FAILED_END_REASONS

    groups = [trajectories[i:i + n] for i in range(0, len(trajectories), n)]
    bad_ids = {k for k, g in enumerate(groups) if any(t.end_reason in FAILED_END_REASONS for t in g)}
    bad = [groups[k] for k in sorted(bad_ids)]
    if not bad:
        return list(trajectories), 0
    failed = [t for g in bad for t in g if t.end_reason in FAILED_END_REASONS]
    first = "; ".join(f"{t.trajectory_id}: {t.end_reason}: {str(t.error)[:160]}" for t in failed[:3])
    if on_failed == "fail":
        raise RolloutFailed(f"{len(failed)} episode(s) failed after their retries ({first}); set "
                            "war.on_failed_episode: drop_group to train on the other groups")
    logging.getLogger(__name__).warning("dropping %d of %d GRPO groups with failed episodes: %s",
                                        len(bad), len(groups), first)
    return [t for k, g in enumerate(groups) if k not in bad_ids for t in g], len(bad)


def attach_metrics(experiences: list, metrics: dict[str, float]) -> list:
    """Put the batch's scalars in every experience's ``info`` (one value per sample, the same
    for all): OpenRLHF averages ``info`` into the step status, so they reach every logger it
    drives, in the sync and the async trainer, once per step."""
    import torch

    for e in experiences:
        for k, v in metrics.items():
            e.info[k] = torch.tensor([float(v)])
    return experiences


def run_coroutine(coro):
    """Run ``coro`` to completion from sync code, even inside a running event loop (an async
    Ray actor): then on a fresh loop in a helper thread."""
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


def _dumps_so_far(dump_dir) -> int:
    """The highest ``rollout_NNNN.jsonl`` number in ``dump_dir`` (0: none, or no dumps)."""
    import re
    from pathlib import Path

    if not dump_dir or not Path(dump_dir).is_dir():
        return 0
    nums = [int(m.group(1)) for p in Path(dump_dir).iterdir() if (m := re.fullmatch(r"rollout_(\d+)\.jsonl", p.name))]
    return max(nums, default=0)


class WarSamplesGenerator:
    """Drop-in for ``openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator``."""

    def __init__(self, strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines,
                 rollout_config: RolloutConfig) -> None:
        self.settings = rollout_config  # the run's frozen settings, as the driver built them
        self.strategy = strategy
        self.args = strategy.args
        self.tokenizer = tokenizer
        self.vllm_engines = list(vllm_engines or [])
        self.prompts_dataloader = prompts_dataloader
        self.eval_dataloader = eval_dataloader
        self.pool = RolloutPool(rollout_config, self.vllm_engines, tokenizer=tokenizer)
        self.metrics: dict[str, float] = {}
        self._sample_buffer: list = []
        self._dataloader_iter = None
        self._batches = _dumps_so_far(rollout_config.dump_dir)  # a resumed job appends, never overwrites
        self._pending_metrics: dict[str, float] = {}  # reported with the next batch (warm-up)
        self._sampled: dict[tuple[float, float], RolloutConfig] = {}  # (temperature, top_p) -> settings

    def _batch_settings(self, generate_kwargs: dict) -> RolloutConfig:
        """The settings for one rollout call: the run's own, or a copy with the temperature /
        top-p OpenRLHF passes for this call (its evaluation uses ``--eval.temperature``). The
        run's settings object itself never changes."""
        base = self.settings
        key = (float(generate_kwargs.get("temperature", base.temperature)),
               float(generate_kwargs.get("top_p", base.top_p)))
        if key == (base.temperature, base.top_p):
            return base
        if key not in self._sampled:
            self._sampled[key] = replace(base, temperature=key[0], top_p=key[1])
        return self._sampled[key]

    @contextmanager
    def _engines_awake(self):
        """Every rollout runs inside this. With ``--vllm.enable_sleep`` the engines wake for it and
        sleep after, as OpenRLHF's generator does around generation and evaluation
        (``ppo_utils/samples_generator.py`` lines 66-83 and 106-120): vLLM 0.29 holds a sleeping
        engine's requests until it wakes, so a rollout outside (the warm-up at start, an
        evaluation) would wait out ``turn_timeout_s`` on every turn."""
        sleep_mode = bool(getattr(getattr(self.args, "vllm", None), "enable_sleep", False))
        if sleep_mode:
            from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

            batch_vllm_engine_call(self.vllm_engines, "wake_up")
        try:
            yield
        finally:
            if sleep_mode:
                batch_vllm_engine_call(self.vllm_engines, "sleep")

    def warm_up(self) -> float | None:
        """The pool's warm-up on the first training prompt (``RolloutConfig.warm_up``), before
        the first step is timed; its seconds (TensorBoard ``war/warm_up_s``), or None if off.
        Sleeping engines are woken for it and put back to sleep."""
        if not self.settings.warm_up or self.prompts_dataloader is None:
            return None
        dataset = self.prompts_dataloader.dataset
        if len(dataset) == 0:
            return None
        _source, prompt, label, _image = dataset[0]
        with self._engines_awake():
            seconds = run_coroutine(self.pool.warm_up_async(prompt, label))
        self._pending_metrics["war/warm_up_s"] = float(seconds)
        return seconds

    def _rollout(self, prompts, labels, **generate_kwargs) -> list:
        cfg = self._batch_settings(generate_kwargs)
        n = int(generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))

        async def run():
            before = await self.pool.engine_stats()
            policy_before = dict(self.pool.policy.metrics())
            res = await self.pool.run_batch_async(prompts, labels, n_samples_per_prompt=n)
            return res, before, policy_before

        self.pool.config = cfg  # this call's sampling; the pool reads its settings per batch
        try:
            res, before, policy_before = run_coroutine(run())
        finally:
            self.pool.config = self.settings
        self._batches += 1
        kept, dropped_groups = healthy_groups(res.trajectories, n, cfg.on_failed_episode)
        self.metrics = {**self._pending_metrics,
                        **rollout_metrics(res, self.pool, before, res.engine_stats, policy_before),
                        "war/groups_dropped": float(dropped_groups), "war/episode_retries": float(res.episode_retries)}
        self._pending_metrics = {}
        if cfg.dump_dir:
            self._dump(res.trajectories)
        max_len = int(generate_kwargs.get("max_len", cfg.max_context_tokens))
        return attach_metrics(to_experiences(kept, max_len=max_len), self.metrics), n

    def _dump(self, trajectories) -> None:
        """One JSONL file per rollout batch: every trajectory with its tokens, mask, logprobs,
        turns and policy version (for audits: which weights produced which sample)."""
        import json
        import os

        os.makedirs(self.settings.dump_dir, exist_ok=True)
        path = os.path.join(self.settings.dump_dir, f"rollout_{self._batches:04d}.jsonl")
        with open(path, "w") as fh:
            for t in trajectories:
                fh.write(json.dumps({**t.to_dict(), "policy_version": self.pool.policy_version}) + "\n")

    def _filtered(self, experiences, n: int):
        """OpenRLHF's dynamic filtering: drop groups whose mean score is outside the range."""
        if not self.args.algo.dynamic_filtering_enable:
            return experiences
        lo, hi = self.args.algo.dynamic_filtering_range
        kept = []
        for i in range(0, len(experiences), n):
            group = experiences[i:i + n]
            scores = [float(e.scores[0]) for e in group if e.scores is not None]
            if not scores or lo < sum(scores) / len(scores) < hi:
                kept.extend(group)
        return kept

    def generate_samples(self, **generate_kwargs):
        if self._dataloader_iter is None and not self._sample_buffer:
            self._dataloader_iter = iter(self.prompts_dataloader)
        chunk = self.args.rollout.batch_size * self.args.rollout.n_samples_per_prompt
        consumed, pass_rate = 0, None
        if len(self._sample_buffer) < chunk and self._dataloader_iter is not None:
            with self._engines_awake():
                consumed, pass_rate = self._fill(**generate_kwargs)
        out = uniform_info(self._sample_buffer[:chunk])
        self._sample_buffer = self._sample_buffer[chunk:]
        exhausted = self._dataloader_iter is None and not self._sample_buffer
        return out, pass_rate, consumed, exhausted

    def _fill(self, **generate_kwargs) -> tuple[int, float | None]:
        """Roll out prompts until the generation batch's samples are in (as OpenRLHF's
        ``_generate_vllm``: prompts whose groups dynamic filtering removed, or whose groups
        were dropped for a failed episode, are replaced with new prompts while the dataset
        lasts). Returns (prompts consumed, filter pass rate in % or None)."""
        from openrlhf.trainer.ppo_utils.samples_generator import _collect_prompt_batch

        check_openrlhf_version()  # a private of OpenRLHF's: only on the release it is read from

        n = int(generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))
        gen_batch = getattr(self.args.rollout, "vllm_generate_batch_size", None) or self.args.rollout.batch_size
        want = gen_batch * n
        got, consumed, rolled = [], 0, 0
        totals = {"war/groups_dropped": 0.0, "war/episode_retries": 0.0,  # counts: summed over the fill's batches
                  "war/engines_recovered": 0.0}
        while len(got) < want and self._dataloader_iter is not None:
            missing = max(1, (want - len(got)) // n)
            prompts, labels, _images, exhausted = _collect_prompt_batch(self._dataloader_iter, missing)
            consumed += len(prompts)
            if prompts:
                exps, n = self._rollout(prompts, labels, **generate_kwargs)
                rolled += len(prompts) * n
                for k in totals:
                    totals[k] += float(self.metrics.get(k, 0.0))
                got.extend(self._filtered(exps, n))
            if exhausted:
                self._dataloader_iter = None
            refill = self.args.algo.dynamic_filtering_enable or self.metrics.get("war/groups_dropped", 0) > 0
            if not refill or not prompts:
                break
        if len(got) < want:
            import logging

            logging.getLogger(__name__).warning(
                "rollout batch short: %d of %d samples after filtering / dropped groups (the dataset ran out)",
                len(got), want)
        self._sample_buffer.extend(attach_metrics(got, totals))  # one value for the step, not a mean of batches
        pass_rate = len(got) / max(rolled, 1) * 100 if self.args.algo.dynamic_filtering_enable and consumed else None
        return consumed, pass_rate

    def generate_eval_samples(self, **generate_kwargs):
        from openrlhf.trainer.ppo_utils.samples_generator import _collect_prompt_batch

        check_openrlhf_version()  # a private of OpenRLHF's: only on the release it is read from

        it = iter(self.eval_dataloader)
        out = []
        with self._engines_awake():
            while True:
                prompts, labels, _images, exhausted = _collect_prompt_batch(it, self.args.rollout.batch_size)
                if prompts:
                    exps, _ = self._rollout(prompts, labels, **generate_kwargs)
                    out.extend(exps)
                if exhausted or not prompts:
                    return out
