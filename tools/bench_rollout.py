"""Real-engine rollout benchmark: OpenRLHF 0.11.2's own rollout path vs the WAR pool and its peers.

    python tools/bench_rollout.py --workload traces:../shared/traces/tau_airline_dev.json --split report \
        --max-groups 4 --engines 2 --repeats 3 --pressure 2 --json results/bench_rollout_traces_report_p2.json
    python tools/bench_rollout.py --workload task:sql_qa --engines 2 --load low \
        --repeats 3 --json results/bench_rollout_sql_low.json

Workloads (``--workload``): ``traces:FILE`` replays recorded agent trajectories
(``examples/trace_replay``: every turn at its recorded length, recorded observations, tool
latencies drawn once), so every configuration generates exactly the same tokens; a GRPO group
is a task's trials; ``--split tune|report`` picks half the tasks (tune on one, report the
other). ``task:NAME`` runs an example task with the model's own turns (token counts then differ
between configurations: compare tok/s).

One process, the same prompts, the same model, the same engine count and the same KV size for
every configuration; one synchronous rollout step per
run (all episodes start together; the step ends when the last one ends); every configuration
``--repeats`` times in rotating order (all engine sets stay up, only one runs at a time; the
others' processes are stopped for its run, :mod:`war_openrlhf.metrics.paused_engines`, unless
``--keep-idle-engines-running``).

Prompts that come back (``--history-steps K``): every run first makes K untimed steps on the same
prompts (``--history-order reversed``: in the reverse order, so under OpenRLHF's placement a group
returns to another engine, as it mostly does on a cluster of many engines; ``same``: the same
order), each followed by what a weight sync does (prefix caches reset; the pool's policy
version advanced), then the timed step: what each drafter kept of the earlier rollouts (WAR's
index on every engine, vLLM's suffix cache on the engine that generated them) is what it drafts
from, as in a later epoch. ``returned_share`` in each run: the share of the timed step's turns
(OpenRLHF: prompts) on an engine that served the same prompt before.

A pool past its first step (``--warm-steps K``, trace workloads run on a half): every run first
makes K untimed steps on the *other* half's tasks, with the same weight-sync reset after each,
then the timed step on its own half. A training job's pool has run earlier steps on other
prompts, and the ``war`` dispatcher prices turns and admits trajectories from what it measured
there (turn counts, context growth per turn, tool gaps, the engines' rates); a fresh pool per
run measures only its first step, where admission has no survival curve to project a
trajectory's footprint with. Every configuration makes the same warm steps (OpenRLHF's path on
its own engines, vLLM's suffix cache keeping what it drafted from them, as WAR's index does).

Configurations (``--configs``):

* ``openrlhf``: OpenRLHF's path (:mod:`war_openrlhf.baselines.openrlhf_rollout`): its
  ``RolloutRayActor`` engines, its least-loaded dispatch of whole prompts (n samples each), its
  ``MultiTurnAgentExecutor`` inside the engine actor. Unchanged.
* ``openrlhf_vllm_suffix``: the same path with vLLM's own ``suffix`` speculation (per-engine
  trees, vLLM's defaults, K = ``--num-speculative-tokens``): one engine argument away for a user.
  Its cache is emptied before each run, as WAR's index is (a repeat of the same prompts must
  not draft from their earlier repeats: a real step's prompts are new).
* ``war``: the WAR pool, ``war`` dispatch per turn, speculation ``auto`` (load-aware switch).
* ``war_spec_only``: the WAR pool with OpenRLHF's placement (``least_loaded``: a prompt's samples
  stay on one engine), speculation ``auto``: the pool under the ``least_loaded`` router.
* ``war_sched_only``: ``war`` dispatch, speculation ``off``.
* ``war_spec_on``: ``war`` dispatch, speculation forced ``on`` (drafting every step, as vLLM's own
  method does): what the load-aware switch adds or costs.
* ``war_longest_first``: ``war`` with ``turn_priority: longest_first`` (each turn's vLLM priority from its
  trajectory's predicted remaining turns; every WAR engine of the run then schedules by priority)
* ``war_finished_only``: ``war`` with in-flight sharing off: replicas draft from finished turns
  only (the ablation of sharing a GRPO group's running turns across engines).
* ``war_kv_events``: ``war`` whose model of each engine's prefix cache is corrected by vLLM's
  KV-cache events (``kv_events``: what the engine stored and evicted) instead of only its own
  block-hash bookkeeping. Every WAR configuration records the dispatcher's estimate of each
  turn's cached prefix against the engine's report (``cache_estimate`` in the JSON: exact /
  over / under, both ways in tokens).
* ``war_all_prompt_price``: ``war`` whose dispatcher prices prefill by the engines' step regression over
  vLLM's prompt count *with* prefix-cached tokens (the step meter before it counted computed tokens
  only): the ablation of that fix, on the same engines.
* ``war_no_history``: ``war`` whose index drops the earlier steps' records before the timed step
  (``RolloutPool.forget_index_records``; with ``--history-steps``): what drafting from earlier
  steps' rollouts adds, everything else equal.
* ``war_hosted``: ``war`` with every episode run beside its engine (``episode_host: engine``): the
  dispatcher admits and places each episode, the engine's actor runs it whole (no pool hop per turn,
  no per-turn placement).
* ``war_plain_engines``: ``war`` dispatch on an engine set of its own without a speculative config
  (``speculation: none``, what a pool that never drafts runs): against ``war_sched_only`` (the same
  dispatcher on WAR's drafting engines, drafting off) it measures the engines' tax in a rollout,
  engine cores in their own processes, on the same work.
* ``war_vllm_suffix_engines``: ``war`` dispatch on an engine set of its own whose engines draft by
  vLLM's own suffix method (``speculation: vllm_suffix``; each run starts with their suffix caches
  empty, as the index and ``openrlhf_vllm_suffix`` do): WAR's pool and dispatcher with the one-flag
  drafter, against ``war`` (WAR's drafter) and ``openrlhf_vllm_suffix`` (OpenRLHF's path, the same
  drafter).
* ``war_sticky``, ``war_sglang_cache_aware``, ``war_dynamo_kv``, ``war_verl_kv_aware``: the
  WAR pool (speculation ``auto``) under verl's sticky, SGLang's cache-aware, NVIDIA Dynamo's
  KV and verl's KV-cache-aware routers, so the routers differ and nothing else.

KV regime: ``--kv-tokens N`` gives every engine (WAR's and OpenRLHF's) exactly N tokens of KV
cache (vLLM's ``num_gpu_blocks_override``, whole blocks; never below one max-length sequence);
``--pressure P`` picks N so that the live context per engine is P times the KV: a calibration
step (``war``, ample KV) measures the episodes' final context length first. The output states
the regime. Loads: ``low`` = ``--low-prompts`` prompts per engine, ``high`` = ``--high-prompts``
(x ``--n-samples`` episodes each).

Model (``--model``): ``policy`` (the default for ``task:``: the tiny Llama trained as an agent
on the example tasks, :mod:`war_openrlhf.fixtures.tiny_policy`; tool-call JSON and echoed
values, turns that end with EOS), ``random`` (random-init tiny Llama), ``peaked`` (the default
for ``traces:``: random with a sharpened output layer, ~1 nat/token; the recorded lengths are
forced, so only the drafting statistics depend on the text), or a model directory. On a CUDA machine
the same command runs CUDA vLLM engines (``openrlhf_vllm_suffix`` and ``--kv-tokens`` need the
CPU path of the baseline; see ``start_openrlhf_engines``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from war_openrlhf.metrics import write_json  # noqa: E402
from war_openrlhf.metrics.paused_engines import actor_process_trees, idle_while, paused  # noqa: E402
from war_openrlhf.metrics.process_cpu import cpu_delta, cpu_seconds_by_kind  # noqa: E402
from war_openrlhf.metrics.placement import group_engines  # noqa: E402
from war_openrlhf.metrics.tail import tail_figures  # noqa: E402

TASKS = ("arithmetic_calculator", "sql_qa", "doc_lookup")
BASELINES = {"openrlhf": None, "openrlhf_vllm_suffix": "suffix"}
WAR_CONFIGS = {  # name -> (dispatch policy, speculation mode)
    "war": ("war", "auto"),
    "war_spec_only": ("least_loaded", "auto"),
    "war_sched_only": ("war", "off"),
    "war_spec_on": ("war", "on"),  # war with drafting forced on: the load-aware switch's ablation
    "war_sticky": ("sticky", "auto"),
    "war_sglang_cache_aware": ("sglang_cache_aware", "auto"),
    "war_dynamo_kv": ("dynamo_kv", "auto"),
    "war_verl_kv_aware": ("verl_kv_aware", "auto"),
    "war_kv_events": ("war", "auto"),  # war whose cache model is corrected by vLLM's KV events
    "war_finished_only": ("war", "auto"),  # war without in-flight sharing
    "war_longest_first": ("war", "auto"),  # war + each turn's vLLM priority from predicted remaining work
    "war_plain_engines": ("war", "off"),  # war dispatch on plain engines (speculation: none), a set of its own
    "war_vllm_suffix_engines": ("war", "on"),  # war dispatch on engines drafting by vLLM's suffix method, a set of its own
    "war_all_prompt_price": ("war", "auto"),  # war priced by the step fit over cached-inclusive prompt counts
    "war_no_history": ("war", "auto"),  # war whose index forgets the earlier steps (--history-steps) at the timed one
    "war_hosted": ("war", "auto"),  # war placing whole episodes, each run beside its engine (episode_host: engine)
}
#: configurations on an engine set of their own, beside the WAR engines (``--war-engines``), and the
#: engines' ``speculation``: without a speculative config (the engine tax of drafting engines with
#: drafting off, measured in a rollout), or drafting by vLLM's own suffix method (WAR's dispatch with
#: the one-flag drafter: which of the two decides a regime)
OWN_ENGINE_SETS = {"war_plain_engines": "none", "war_vllm_suffix_engines": "vllm_suffix"}
PLAIN_ENGINE_CONFIGS = tuple(c for c, spec in OWN_ENGINE_SETS.items() if spec == "none")
NO_INFLIGHT_CONFIGS = ("war_finished_only",)
#: configurations that order turns by vLLM request priority; their presence starts every WAR engine
#: of the run with priority scheduling (equal priorities then serve in arrival order, as fcfs does)
PRIORITY_CONFIGS = ("war_longest_first",)
KV_EVENT_CONFIGS = ("war_kv_events",)
ALL_PROMPT_PRICE_CONFIGS = ("war_all_prompt_price",)
#: configurations whose index drops the earlier steps' records before the timed step: what keeping
#: earlier steps' rollouts adds to ``war`` (vLLM's suffix cache keeps them on its own engine)
NO_HISTORY_CONFIGS = ("war_no_history",)
#: configurations whose episodes run beside their engine (the pool places episodes, not turns)
HOSTED_CONFIGS = ("war_hosted",)
CONFIGS = tuple(BASELINES) + tuple(WAR_CONFIGS)


def load_task(name: str):
    """(dataset module, agent file) of an example task."""
    if name not in TASKS:
        raise SystemExit(f"--task: unknown task {name!r}; known: {', '.join(TASKS)}")
    d = ROOT / "examples" / name
    spec = importlib.util.spec_from_file_location(f"war_bench_{name}_dataset", d / "dataset.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod, d / "agent.py"


def read_prompt_rows(path: str, n: int) -> list[dict]:
    """The first ``n`` ``{prompt, label}`` rows of a JSONL file (an error names the file, line and field)."""
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if len(rows) == n:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"--prompts: {path}:{line_no}: not JSON ({e.msg})")
            for key in ("prompt", "label"):
                if not isinstance(row, dict) or not isinstance(row.get(key), str):
                    raise SystemExit(f"--prompts: {path}:{line_no}: field {key!r} must be a string")
            rows.append(row)
    if len(rows) < n:
        raise SystemExit(f"--prompts: {path} has {len(rows)} rows, the run needs {n}")
    return rows


def load_traces(spec: str, split: str, max_groups: int | None, seed: int, tool_latency: float, jitter: float,
                per_env_token: float, skip_groups: int = 0):
    """(rows, agent file) of a ``traces:FILE`` workload (examples/trace_replay)."""
    path = spec.split(":", 1)[1]
    mod_spec = importlib.util.spec_from_file_location("war_bench_trace_dataset",
                                                      ROOT / "examples" / "trace_replay" / "dataset.py")
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    rows = mod.generate_from_traces(path, split=split, seed=seed, tool_latency_s=tool_latency,
                                    jitter_sigma=jitter, per_env_token_s=per_env_token, max_groups=max_groups,
                                    skip_groups=skip_groups)
    return rows, ROOT / "examples" / "trace_replay" / "agent.py"


TRACE_AGENT = ROOT / "examples" / "trace_replay" / "agent.py"


def record_task_episodes(rows, n, agent_file, model, tokenizer, args, dtype, cuda) -> list[dict]:
    """Equal work for a task workload: run its episodes once on plain engines (free sampling,
    the task's own tools, WAR's pool without drafting) and return them as trace-replay rows
    (``war_openrlhf.traces.recorded``): every configuration then replays them, each turn forced
    to its recorded length after the recorded environment text and tool time."""
    import ray

    from war_openrlhf.engine.actors import create_war_engines
    from war_openrlhf.rollout import RolloutConfig, RolloutPool, load_agent_class
    from war_openrlhf.traces.recorded import replay_rows

    cfg = RolloutConfig(num_engines=args.engines, agent_func_path=str(agent_file), max_turns=256,
                        max_context_tokens=args.max_len, max_new_tokens_per_turn=None,
                        temperature=args.temperature, seed=args.seed, progress=False, n_samples_per_prompt=n,
                        dispatch_policy="least_loaded", dispatch_kwargs={"n_samples_per_prompt": n},
                        engine=dict(model=str(model), dtype=dtype, max_model_len=args.max_len,
                                    enforce_eager=not cuda, speculation="none"))
    handles = create_war_engines(args.engines, cfg.engine, placement_group=True)
    try:
        pool = RolloutPool(cfg, handles, tokenizer=tokenizer, agent_cls=load_agent_class(agent_file))
        res = pool.run_batch([r["prompt"] for r in rows], [r["label"] for r in rows])
    finally:
        for h in handles:
            ray.get(h.shutdown.remote())
            ray.kill(h)
    return replay_rows(res.trajectories, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def replay_trajectories(rows: list[dict], tokenizer, n: int, seed: int = 0) -> list:
    """The simulator's view of a trace workload: each trial's turns with the engine's token
    counts (prompt and observations through the benchmark model's tokenizer; each response
    its forced length of fresh ids, as sampled text shares nothing across trajectories) and
    the tool delays the run replays."""
    import numpy as np
    from types import SimpleNamespace

    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    out = []
    for row in rows:
        label = json.loads(row["label"])
        prompt = np.asarray(tokenizer.encode(row["prompt"], add_special_tokens=False), dtype=np.int32)
        for trial in label["trials"][:n]:
            ctx, turns = prompt, []
            for k, length in enumerate(trial["lengths"]):
                resp = rng.integers(5, vocab, size=max(1, int(length))).astype(np.int32)
                obs = (np.asarray(tokenizer.encode(trial["observations"][k], add_special_tokens=False), dtype=np.int32)
                       if k < len(trial["observations"]) else np.zeros(0, dtype=np.int32))
                turns.append(SimpleNamespace(context_token_ids=ctx, response_token_ids=resp, env_token_count=obs.size))
                ctx = np.concatenate([ctx, resp, obs])
            out.append(SimpleNamespace(trajectory_id=f"{label['task']}/{trial['trial']}", group_id=str(label["task"]),
                                       turns=turns, tool_delays_s=trial["delays"]))
    return out


# Each configuration as the simulator runs it: (dispatch policy, speculates).
SIM_POLICIES = {"openrlhf": ("least_loaded", False), "openrlhf_vllm_suffix": ("least_loaded", True),
                "war": ("war", True), "war_spec_only": ("least_loaded", True), "war_sched_only": ("war", False),
                "war_spec_on": ("war", True), "war_plain_engines": ("war", False),
                "war_vllm_suffix_engines": ("war", True),
                "war_sticky": ("sticky", True), "war_sglang_cache_aware": ("sglang_cache_aware", True),
                "war_dynamo_kv": ("dynamo_kv", True), "war_verl_kv_aware": ("verl_kv_aware", True),
                "war_kv_events": ("war", True), "war_longest_first": ("war", True)}


def engine_kind(name: str, same_engines: bool = False, war_engines: str = "auto") -> str:
    """The engines a configuration runs on, as the simulator prices them: ``plain`` (no
    speculative config: OpenRLHF's own engines, or the WAR pool's with ``--war-engines none``),
    ``vllm_suffix`` (vLLM's own suffix method) or ``war_index`` (WAR's drafting engines, even with
    drafting off: in vLLM 0.29 a speculative config alone changes the engine, e.g. no async
    scheduling). The names are ``fit_rollout_costs.py --kind``'s."""
    if name == "openrlhf":
        return "war_index" if same_engines and war_engines != "none" else "plain"
    if name == "openrlhf_vllm_suffix":
        return "vllm_suffix"
    if name in OWN_ENGINE_SETS:
        return {"none": "plain", "vllm_suffix": "vllm_suffix"}[OWN_ENGINE_SETS[name]]
    return "plain" if war_engines == "none" else "war_index"


def simulate_configs(trajs, cost_model: str, engines: int, kv_tokens: int | None, summary: dict,
                     plain_cost_model: str | None = None, same_engines: bool = False,
                     war_engines: str = "auto", suffix_cost_model: str | None = None) -> dict:
    """Predicted speed-up over ``openrlhf`` (its step time / the config's) of every measured
    configuration, from the simulator with the fitted ``cost_model`` (and ``plain_cost_model`` /
    ``suffix_cost_model``, when given, for the configurations on plain engines / vLLM's suffix
    engines: :func:`engine_kind`). Speculation
    enters as the configuration's measured tokens per verification step, acceptance and
    speculating fraction (the simulator does not predict acceptance); everything else (prefill,
    prefix caching at the engine's block size, KV limits, batching, placement, tool delays) is
    the simulator's own."""
    import numpy as np

    from war_openrlhf.simulation.cluster import SimConfig, prepare_trajectories, simulate

    prepared = prepare_trajectories(trajs)
    steps = {}
    for name, d in summary.items():
        policy, spec = SIM_POLICIES[name]
        tps = drafted = None
        if spec and d.get("tokens_per_verification_step") and d.get("acceptance"):
            frac = d.get("speculating_fraction")
            frac = float(np.mean(frac)) if isinstance(frac, list) else 1.0
            per_spec_step = d["tokens_per_verification_step"]
            tps = frac * per_spec_step + (1.0 - frac)
            drafted = frac * (per_spec_step - 1.0) / d["acceptance"]
        own = {"plain": plain_cost_model, "vllm_suffix": suffix_cost_model}.get(engine_kind(name, same_engines,
                                                                                         war_engines))
        priority = {}
        if name in PRIORITY_CONFIGS:  # vLLM priority scheduling, the predictor seeded as the run's was
            history = _PRIORITY_SEED[0].records.state_dict()["history"] if _PRIORITY_SEED else ()
            priority = {"turn_priority": "longest_first", "turn_priority_history": tuple(map(tuple, history))}
        cfg = SimConfig(num_engines=engines, preset=own or cost_model,
                        kv_capacity_tokens=kv_tokens,
                        spec_tokens_per_step=tps or 1.0, spec_drafted_per_step=drafted or 0.0, **priority)
        steps[name] = simulate(prepared, policy, cfg).makespan_s
    base = steps.get("openrlhf")
    return {name: {"step_s": round(v, 3), "x_openrlhf": round(base / v, 3) if base else None}
            for name, v in steps.items()}


def resolve_model(arg: str, positions: int = 2048) -> Path:
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    if arg == "policy":
        from war_openrlhf.fixtures.tiny_policy import DEFAULT_PATH, build_tiny_policy

        return build_tiny_policy(DEFAULT_PATH)  # built once (about 4 minutes), then reused
    if arg == "random":
        return build_tiny_model(ROOT / ".cache" / "war_tiny_llama")
    if arg == "peaked":
        if positions <= 2048:
            return build_tiny_model(ROOT / ".cache" / "war_tiny_llama_peaked", lm_head_scale=6.0)
        return build_tiny_model(ROOT / ".cache" / f"war_tiny_llama_peaked_{positions}", lm_head_scale=6.0,
                                max_position_embeddings=positions)
    p = Path(arg)
    if not (p / "config.json").is_file():
        raise SystemExit(f"--model: {arg} is neither 'policy', 'random', 'peaked' nor a model directory")
    return p


def run_spec_fraction(before, after):
    """The share of an engine's steps between two stats snapshots in which its switch drafted (None:
    no switch). The switch's own ``spec_step_fraction`` counts from the engine's start, so on an
    engine set shared by several configurations it mixes their runs; a switch replaced in between
    (fewer steps than before) counts from its start. No step fed to it: 0.0 (nothing drafted)."""
    if after.spec_step_fraction is None:
        return None
    sa, sb = after.war.get("switch") or {}, before.war.get("switch") or {}
    steps, spec = int(sa.get("steps", 0) or 0), int(sa.get("spec_steps", 0) or 0)
    if steps >= int(sb.get("steps", 0) or 0):
        steps, spec = steps - int(sb.get("steps", 0) or 0), spec - int(sb.get("spec_steps", 0) or 0)
    return round(spec / steps, 3) if steps > 0 else 0.0


def _percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


#: traces: the longest-first predictor, fitted on the turn counts of the trace's tasks that this run
#: does not replay (every repeat starts from a copy: no repeat learns from another's, or the reported, tasks)
_PRIORITY_SEED: list = []


#: the half a longest-first predictor is fitted on, for each half a run replays
_OTHER_HALF = {"validation": "tuning", "tuning": "validation", "report": "tune", "tune": "report"}


def seed_priorities(spec: str, split: str, seed: int) -> None:
    """Fit the longest-first predictor on the other half of the trace's tasks (the tuning half
    when the run reports the validation half; see :data:`_PRIORITY_SEED`)."""
    from war_openrlhf.dispatch.turn_priority import TurnPriorities
    from war_openrlhf.traces.chat_traces import load_chat_traces
    from war_openrlhf.traces.turns import group_trajectories

    if split not in _OTHER_HALF:
        raise SystemExit("--split all: war_longest_first is fitted on the tasks a run does not report; "
                         "choose a half (--split validation fits it on the tuning half)")
    other_rows, _ = load_traces(spec, _OTHER_HALF[split], None, seed, 0.0, 0.0, 0.0)
    fit_tasks = {json.loads(r["label"])["task"] for r in other_rows}
    groups = group_trajectories(load_chat_traces(spec.split(":", 1)[1]))
    counts = [[t.model_turns for t in members]
              for members in groups.values() if members[0].task_id in fit_tasks]
    tp = TurnPriorities()
    tp.seed(counts)
    _PRIORITY_SEED[:] = [tp]
    print(f"longest-first predictor fitted on the {_OTHER_HALF[split]} half ({len(counts)} tasks)", flush=True)


def returned_share(served_before: dict[str, set], placements) -> float:
    """The share of ``(prompt, engine)`` placements on an engine that served the prompt before
    (``served_before``: prompt -> engines of the earlier steps)."""
    placements = list(placements)
    return sum(e in served_before.get(p, ()) for p, e in placements) / max(1, len(placements))


def run_war(handles, cfg_kwargs, name, prompts, labels, n, tokenizer, agent_cls, history=None):
    """One timed step of configuration ``name`` on the WAR pool. ``history``: ``(prompts, labels,
    steps)`` run first by the same pool, untimed, each followed by what a weight sync does (the
    engines' prefix caches reset, the policy version advanced): the earlier steps of a run whose
    prompts come back, as in a later epoch."""
    import ray

    from war_openrlhf.rollout import RolloutConfig, RolloutPool

    policy, mode = WAR_CONFIGS[name]
    ray.get([h.reset_prefix_cache.remote() for h in handles])  # the pool resets the suffix index
    speculation = cfg_kwargs["engine"].get("speculation", "auto")
    if speculation == "vllm_suffix":  # each run starts without the earlier repeats' responses
        ray.get([h.reset_vllm_suffix_cache.remote() for h in handles])
    elif speculation != "none":  # plain engines and vLLM's own drafter have no switch
        ray.get([h.set_speculation.remote(mode) for h in handles])
    kw = dict(cfg_kwargs)
    if policy == "least_loaded":
        kw["dispatch_kwargs"] = {"n_samples_per_prompt": n}
    kw["record_cache_estimates"] = True
    kw["kv_events"] = name in KV_EVENT_CONFIGS
    if name in NO_INFLIGHT_CONFIGS:  # the pool collects no in-flight chunks: replicas see finished turns only
        engine = dict(kw["engine"])
        engine["index"] = {**dict(engine.get("index") or {}), "inflight_sharing": False}
        kw["engine"] = engine
    if name in PRIORITY_CONFIGS:
        kw["turn_priority"] = "longest_first"
    if name in HOSTED_CONFIGS:
        kw["episode_host"] = "engine"
    if kw.get("turn_priority", "none") != "none" or cfg_kwargs["engine"].get("scheduling_policy") == "priority":
        kw["engine"] = {**dict(kw["engine"]), "scheduling_policy": "priority"}  # what the engines run
    cfg = RolloutConfig(dispatch_policy=policy, n_samples_per_prompt=n, **kw)
    pool = RolloutPool(cfg, handles, tokenizer=tokenizer, agent_cls=agent_cls)
    if name in ALL_PROMPT_PRICE_CONFIGS:
        for client in pool.engines:
            client.step_cost_source = "all_prompt"
    if name in PRIORITY_CONFIGS and _PRIORITY_SEED:  # fitted on the tasks this run does not replay
        import copy

        pool.router.priorities = copy.deepcopy(_PRIORITY_SEED[0])
    earlier: dict[str, set] = {}  # prompt -> engines that served it in the history steps
    if history:
        h_prompts, h_labels, steps = history
        for _ in range(steps):
            for t in pool.run_batch(h_prompts, h_labels).trajectories:
                earlier.setdefault(t.prompt, set()).update(r.engine for r in t.turns)
            # what a weight sync does to the rollout side, without after_weight_sync's engine weight
            # versions: the engines are shared by every run, and a later run's fresh pool would see
            # its turns report a newer version mid-step and drop its cache model then
            ray.get([h.reset_prefix_cache.remote() for h in handles])  # new weights: the KV is stale
            pool.advance_policy_version()
        if name in NO_HISTORY_CONFIGS:
            pool.forget_index_records()
    before = asyncio.run(pool.engine_stats())
    res = pool.run_batch(prompts, labels)
    d = {}
    for b, a in zip(before, res.engine_stats):
        for k, v in a.minus(b).items():
            d[k] = d.get(k, 0) + v
    drafts = d["spec_drafts"]
    latencies = [r.generate_s for t in res.trajectories for r in t.turns]
    return {
        "step_s": res.wall_s, "generated_tokens": res.generated_tokens, "throughput_tok_s": res.tokens_per_s,
        "trajectories": len(res.trajectories), "turns": res.turns,
        "final_context_tokens_mean": statistics.mean(len(t.token_ids) for t in res.trajectories),
        "turn_latency_p50_s": _percentile(latencies, 0.5), "turn_latency_p99_s": _percentile(latencies, 0.99),
        # the step's straggler: share of the step after 90% of trajectories ended, p99 duration
        **tail_figures([t.finished_s for t in res.trajectories], [t.wall_s for t in res.trajectories]),
        "engine_prefix_hit_rate": d["prefix_cache_hits"] / d["prefix_cache_queries"] if d["prefix_cache_queries"] else None,
        "preemptions": d["preemptions"],
        "tokens_per_verification_step": 1.0 + d["spec_accepted_tokens"] / drafts if drafts else None,
        "acceptance": d["spec_accepted_tokens"] / d["spec_draft_tokens"] if d["spec_draft_tokens"] else None,
        # this run's steps only: the switch counts from the engine's start, over every configuration
        "speculating_fraction": [run_spec_fraction(b, a) for b, a in zip(before, res.engine_stats)],
        # each engine's switch at the end of the run: why it decided, its draft cut-off, its step curve
        "switch": [{k: (s.war.get("switch") or {}).get(k) for k in
                    ("decisions_by_reason", "min_token_prob", "draft_calibration", "accepted_per_request_step",
                     "drafted_per_request_step", "step_curve")} for s in res.engine_stats],
        "kv_usage_peak": [round(e.peak_kv_usage, 3) for e in pool.engines],
        "engine_turns": res.engine_turns, "deferrals": res.deferrals, "end_reasons": res.end_reasons,
        # the war dispatcher's fluid model of this step (admit all vs waves of K), when admission asked it
        "admission_fluid": dict(getattr(pool.router.policy, "last_fluid", None) or {}) or None,
        # ... and how many first turns found every engine's KV budget full (the model is asked then)
        "admission_full_offers": getattr(pool.router.policy, "full_offers", None),
        # how many engines each GRPO group's samples started on (siblings run to similar lengths)
        **group_engines(res.trajectories, len(handles)),
        "mean_reward": res.summary()["mean_reward"],
        "cache_estimate": cache_estimate_errors([r for t in res.trajectories for r in t.turns]),
        # history: the share of this step's turns on an engine that served the same prompt before
        "returned_share": (returned_share(earlier, ((t.prompt, r.engine) for t in res.trajectories for r in t.turns))
                           if history else None),
    }


def cache_estimate_errors(turns) -> dict | None:
    """The dispatcher's estimate of each turn's cached prefix (before it chose) against what
    the engine reported (vLLM's ``num_cached_tokens``): how often and by how much it was over
    (it expected a hit the engine did not have: evicted, or never stored) and under."""
    pairs = [(r.estimated_cached_tokens, r.cached_tokens) for r in turns if r.estimated_cached_tokens is not None]
    if not pairs:
        return None
    over = [e - a for e, a in pairs if e > a]
    under = [a - e for e, a in pairs if e < a]
    actual = sum(a for _, a in pairs)
    return {"turns": len(pairs), "exact": round(1 - (len(over) + len(under)) / len(pairs), 4),
            "over": round(len(over) / len(pairs), 4), "under": round(len(under) / len(pairs), 4),
            "over_tokens": sum(over), "under_tokens": sum(under), "cached_tokens": actual,
            "abs_error_per_cached_token": round((sum(over) + sum(under)) / actual, 4) if actual else None}


def _vllm_counters(engines):
    """Prometheus counters of each OpenRLHF engine's vLLM (prefix cache, spec decode, preemptions)."""
    import ray

    def read(actor):
        from vllm.v1.metrics.reader import get_metrics_snapshot

        names = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:spec_decode_num_drafts",
                 "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
                 "vllm:num_preemptions")
        out = dict.fromkeys(names, 0.0)
        for m in get_metrics_snapshot():
            if m.name in out and hasattr(m, "value"):
                out[m.name] += float(m.value)
        return out

    try:
        snaps = ray.get([e.__ray_call__.remote(read) for e in engines], timeout=30)
    except Exception:  # metrics are a report, not the benchmark
        return None
    total: dict[str, float] = {}
    for s in snaps:
        for k, v in s.items():
            total[k] = total.get(k, 0.0) + v
    return total


def run_baseline(engines, prompts, labels, n, tokenizer, max_len, temperature, war_engines=False,
                 vllm_suffix=False, history=None):
    """One timed step of OpenRLHF's own path; ``history`` as in :func:`run_war` (vLLM's suffix
    cache keeps the earlier steps' responses on the engine that generated them)."""
    import ray

    from war_openrlhf.baselines.openrlhf_rollout import reset_vllm_suffix_caches, run_openrlhf_rollout

    if vllm_suffix:  # each run starts without the earlier repeats' responses, as WAR's index does
        reset_vllm_suffix_caches(engines)

    if war_engines:  # OpenRLHF's path on WAR engines: vLLM as OpenRLHF runs it (no drafting)
        if ray.get(engines[0].stats.remote())["speculation"] != "none":
            ray.get([h.set_speculation.remote("off") for h in engines])
        ray.get([h.reset_prefix_cache.remote() for h in engines])

    earlier: dict[str, set] = {}  # prompt -> engines that served it in the history steps
    if history:
        h_prompts, h_labels, steps = history
        for _ in range(steps):
            _, hst = run_openrlhf_rollout(engines, h_prompts, h_labels, tokenizer=tokenizer, n_samples_per_prompt=n,
                                          max_new_tokens=None, max_len=max_len, temperature=temperature)
            for p, e in zip(h_prompts, hst["placements"]):
                earlier.setdefault(p, set()).add(e)
            ray.get([e.reset_prefix_cache.remote() for e in engines])  # new weights: the KV is stale
    before = _vllm_counters(engines)
    exps, st = run_openrlhf_rollout(engines, prompts, labels, tokenizer=tokenizer, n_samples_per_prompt=n,
                                    max_new_tokens=None, max_len=max_len, temperature=temperature)
    after = _vllm_counters(engines)
    d = {k: after[k] - before[k] for k in after} if before and after else {}
    rewards = [float(e.rewards[0]) for e in exps if e.rewards is not None]
    drafts = d.get("vllm:spec_decode_num_drafts", 0.0)
    queries = d.get("vllm:prefix_cache_queries", 0.0)
    return {"step_s": st["wall_s"], "generated_tokens": st["action_tokens"], "throughput_tok_s": st["tokens_per_s"],
            "trajectories": st["trajectories"], "turns": None, "turn_latency_p50_s": None, "turn_latency_p99_s": None,
            "tail10_share": None, "trajectory_p99_s": None,  # OpenRLHF's generator returns no per-sample end times
            "engine_prefix_hit_rate": d["vllm:prefix_cache_hits"] / queries if queries else None,
            "preemptions": int(d["vllm:num_preemptions"]) if d else None,
            "tokens_per_verification_step": 1.0 + d["vllm:spec_decode_num_accepted_tokens"] / drafts if drafts else None,
            "acceptance": (d["vllm:spec_decode_num_accepted_tokens"] / d["vllm:spec_decode_num_draft_tokens"]
                           if d.get("vllm:spec_decode_num_draft_tokens") else None),
            "engine_turns": st.get("trajectories_per_engine"),
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            # history: the share of this step's prompts sent to an engine that served them before
            "returned_share": returned_share(earlier, zip(prompts, st["placements"])) if history else None}


def _summarise(runs, base_step):
    steps = [r["step_s"] for r in runs]
    med = sorted(runs, key=lambda r: r["step_s"])[len(runs) // 2]
    out = dict(med)
    out["step_s"] = statistics.median(steps)
    out["step_s_runs"] = [round(s, 3) for s in steps]
    out["step_s_spread"] = [round(min(steps), 3), round(max(steps), 3)]
    out["throughput_tok_s"] = statistics.median(r["throughput_tok_s"] for r in runs)
    out["throughput_tok_s_runs"] = [round(r["throughput_tok_s"], 1) for r in runs]
    out["x_openrlhf"] = base_step / out["step_s"] if base_step else None
    for key in ("tail10_share", "trajectory_p99_s"):  # medians over the runs, with each run's value
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            out[key] = statistics.median(vals)
            out[f"{key}_runs"] = [round(v, 3) for v in vals]
    return out


def check_kv_holds_an_episode(args) -> None:
    """``--kv-tokens`` below ``--max-len``: refused (a real engine's KV always holds one sequence)."""
    if args.kv_tokens is not None and args.kv_tokens < args.max_len:
        raise SystemExit(f"--kv-tokens: {args.kv_tokens} cannot hold one {args.max_len}-token episode (--max-len); "
                         "a real engine's KV always holds one max-length sequence")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="task:arithmetic_calculator",
                    help="task:NAME (an example task) or traces:FILE (recorded trajectories, tau format)")
    ap.add_argument("--split", choices=("tune", "report", "tuning", "validation", "all"),
                    default="report",
                    help="traces: which half of the tasks (tune constants on one, report the other); "
                         "tuning/validation are the dispatch benchmarks' halves (the dispatcher "
                         "was tuned on tuning), tune/report the earlier hash halves")
    ap.add_argument("--prompts", metavar="FILE.jsonl",
                    help="task: take the prompts from this JSONL file ({prompt, label} rows, the first "
                         "prompts-per-engine x engines of them) instead of the task's generated ones")
    ap.add_argument("--max-groups", type=int, help="traces: at most this many tasks (GRPO groups)")
    ap.add_argument("--skip-groups", type=int, default=0,
                    help="traces: leave out the half's first N tasks (in task order) before --max-groups: "
                         "tasks no earlier run of a regime used (the warm steps' half skips as many)")
    ap.add_argument("--tool-latency", type=float, default=0.05, help="traces: median tool latency, s")
    ap.add_argument("--tool-jitter", type=float, default=0.5, help="traces: lognormal sigma of the latency")
    ap.add_argument("--per-env-token", type=float, default=0.0, help="traces: extra tool seconds per env token")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--load", choices=("low", "high"), default="low",
                    help="task workloads: --low-prompts or --high-prompts per engine (traces: --max-groups)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default=None,
                    help="policy | random | peaked | a model directory (default: policy for task:, peaked for traces:)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated configurations (default: all; war_no_history only with --history-steps)")
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--low-prompts", type=int, default=1, help="prompts per engine at low load")
    ap.add_argument("--high-prompts", type=int, default=8, help="prompts per engine at high load")
    ap.add_argument("--max-len", type=int, help="context per episode (default: task 1024; traces: the longest, rounded up)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--war-engines", choices=("auto", "none"), default="auto",
                    help="the WAR pool's engines: auto (WAR's drafting engines, the switch decides) or none "
                         "(plain vLLM engines: nothing drafts; what a pool that never drafts runs)")
    ap.add_argument("--free-sampling", action="store_true",
                    help="task workloads: every configuration samples its own episodes (different work per "
                         "run: compare tok/s) instead of replaying one recorded run's (equal work, the default)")
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--cost-model", default=None, metavar="FILE.json",
                    help="traces: also run the workload through the simulator with this fitted cost model "
                         "(bench_engine.py --fit-costs) and report predicted vs measured speed-up per config")
    ap.add_argument("--plain-cost-model", default=None, metavar="FILE.json",
                    help="with --cost-model: the cost model fitted on plain engines (fit_serving_costs.py "
                         "--engine-kind plain) for the configurations that run on them (OpenRLHF's own engines)")
    ap.add_argument("--suffix-cost-model", default=None, metavar="FILE.json",
                    help="with --cost-model: the cost model fitted on vLLM's suffix engines (fit_rollout_costs.py "
                         "--kind vllm_suffix) for openrlhf_vllm_suffix")
    ap.add_argument("--keep-idle-engines-running", action="store_true",
                    help="leave the engine sets of the other configurations running (idle) during each run "
                         "(default: stopped, so that their idle CPU does not slow the measured one)")
    ap.add_argument("--history-steps", type=int, default=0,
                    help="steps every run makes on the same prompts before the timed one, untimed, each followed "
                         "by what a weight sync does (prefix caches reset, policy version advanced): prompts that "
                         "come back, as in a later epoch; each drafter keeps what it kept of them")
    ap.add_argument("--history-order", choices=("reversed", "same"), default="reversed",
                    help="the earlier steps' prompt order: reversed (under OpenRLHF's placement a prompt comes back "
                         "to another engine, as it mostly does on a cluster of many engines) or the same")
    ap.add_argument("--warm-steps", type=int, default=0,
                    help="trace workloads run on a half: untimed steps every run makes first on the other half's tasks "
                         "(each followed by what a weight sync does): a pool past its first step, as in training")
    ap.add_argument("--same-engines", action="store_true",
                    help="run the openrlhf baseline on the WAR engines (speculation off, OpenRLHF's dispatch and "
                         "agent executor inside the engine actor) instead of starting OpenRLHF's own engine "
                         "actors: one engine set, half the start-up; the vLLM engines are configured alike either way")
    kv = ap.add_mutually_exclusive_group()
    kv.add_argument("--kv-tokens", type=int, help="KV-cache tokens per engine, every configuration")
    kv.add_argument("--pressure", type=float, help="live context per engine / KV capacity (calibrated)")
    args = ap.parse_args(argv)
    configs = ([c.strip() for c in args.configs.split(",") if c.strip()] if args.configs is not None else
               [c for c in CONFIGS if args.history_steps or c not in NO_HISTORY_CONFIGS])
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"--configs: unknown configuration {c!r}; known: {', '.join(CONFIGS)}")
    if args.engines < 1 or args.repeats < 1:
        raise SystemExit("--engines and --repeats must be >= 1")
    if args.history_steps < 0:
        raise SystemExit(f"--history-steps: must be >= 0, got {args.history_steps}")
    if args.warm_steps < 0:
        raise SystemExit(f"--warm-steps: must be >= 0, got {args.warm_steps}")
    if args.skip_groups and (args.skip_groups < 0 or not args.workload.startswith("traces:")):
        raise SystemExit(f"--skip-groups: a count >= 0 of a trace workload's tasks (got {args.skip_groups} "
                         f"with --workload {args.workload})")
    if args.warm_steps and (not args.workload.startswith("traces:") or args.split not in _OTHER_HALF):
        raise SystemExit("--warm-steps: the warm steps run the other half's tasks; use a traces: workload with "
                         f"--split one of {', '.join(_OTHER_HALF)} (got {args.workload!r}, --split {args.split})")
    if args.warm_steps and args.history_steps:
        raise SystemExit("--warm-steps and --history-steps: choose one (earlier steps on other tasks, or on the same)")
    if not args.history_steps and any(c in NO_HISTORY_CONFIGS for c in configs):
        raise SystemExit(f"--configs: {', '.join(NO_HISTORY_CONFIGS)} needs --history-steps >= 1 (nothing to forget)")
    if args.pressure is not None and not args.pressure > 0:
        raise SystemExit("--pressure: must be > 0")
    if args.free_sampling and not args.workload.startswith("task:"):
        raise SystemExit("--free-sampling: a traces: workload replays recorded lengths; the flag is for task: workloads")
    drafting = [c for c in configs if c in WAR_CONFIGS and c not in OWN_ENGINE_SETS and WAR_CONFIGS[c][1] != "off"]
    if args.war_engines == "none" and drafting:
        raise SystemExit(f"--war-engines none: plain engines cannot draft, but {', '.join(drafting)} would; "
                         "run war_sched_only (and the openrlhf baselines) on them")
    if args.war_engines == "none" and any(c in PLAIN_ENGINE_CONFIGS for c in configs):
        raise SystemExit("--war-engines none: the WAR engines are plain already; run war_sched_only on them "
                         "instead of war_plain_engines")
    if args.same_engines and "openrlhf_vllm_suffix" in configs:
        raise SystemExit("--same-engines: openrlhf_vllm_suffix needs engines started with vLLM's suffix method; "
                         "drop it from --configs or run without --same-engines")

    import ray
    from transformers import AutoTokenizer

    from war_openrlhf.baselines.openrlhf_rollout import start_openrlhf_engines, stop_openrlhf_engines
    from war_openrlhf.device import cuda_available
    from war_openrlhf.engine.actors import create_war_engines
    from war_openrlhf.rollout import RolloutConfig, load_agent_class

    if args.workload.startswith("task:"):
        dataset, agent_file = load_task(args.workload.split(":", 1)[1])
        per_engine = args.low_prompts if args.load == "low" else args.high_prompts
        if args.prompts:
            rows = read_prompt_rows(args.prompts, per_engine * args.engines)
        else:
            rows = dataset.generate(per_engine * args.engines, args.seed)
        n = args.n_samples
        args.max_len = args.max_len or 2048
        check_kv_holds_an_episode(args)  # before a model is built or loaded
        model = resolve_model(args.model or "policy")
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        tool_text = "the task's own tools"

    elif args.workload.startswith("traces:"):
        rows, agent_file = load_traces(args.workload, args.split, args.max_groups, args.seed, args.tool_latency,
                                       args.tool_jitter, args.per_env_token, args.skip_groups)
        if any(c in PRIORITY_CONFIGS for c in configs):
            seed_priorities(args.workload, args.split, args.seed)
        trials = {len(json.loads(r["label"])["trials"]) for r in rows}
        n = min(trials)  # a GRPO group = the trials of one task
        warm_rows = []
        if args.warm_steps:  # the other half's tasks, drawn alike
            warm_rows, _ = load_traces(args.workload, _OTHER_HALF[args.split], args.max_groups, args.seed,
                                       args.tool_latency, args.tool_jitter, args.per_env_token, args.skip_groups)
            short = [json.loads(r["label"])["task"] for r in warm_rows if len(json.loads(r["label"])["trials"]) < n]
            if short:
                raise SystemExit(f"--warm-steps: the {_OTHER_HALF[args.split]} half's tasks {', '.join(short)} have "
                                 f"fewer than {n} trials (the timed half's GRPO group size)")
        model = resolve_model(args.model or "peaked", positions=32768)
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        longest = max(len(tokenizer.encode(r["prompt"])) + sum(t["lengths"]) +
                      sum(len(tokenizer.encode(o)) for o in t["observations"])
                      for r in rows + warm_rows for t in json.loads(r["label"])["trials"])
        args.max_len = args.max_len or -(-(longest + 64) // 1024) * 1024
        check_kv_holds_an_episode(args)
        tool_text = (f"recorded steps, {args.tool_latency:g} s median x lognormal({args.tool_jitter:g})"
                     f" + {args.per_env_token:g} s/env token, drawn once")
    else:
        raise SystemExit(f"--workload: {args.workload!r} is neither task:NAME nor traces:FILE")
    prompts, labels = [r["prompt"] for r in rows], [r["label"] for r in rows]
    cuda = cuda_available()
    ray.init(num_cpus=None if cuda else 4 * args.engines + (os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    dtype = "bfloat16" if cuda else "float32"
    equal_work = None
    if args.workload.startswith("task:") and not args.free_sampling:
        # equal work: one free-sampled run's episodes, replayed by every configuration
        rows = record_task_episodes(rows, n, agent_file, model, tokenizer, args, dtype, cuda)
        agent_file = TRACE_AGENT
        prompts, labels = [r["prompt"] for r in rows], [r["label"] for r in rows]
        n = min(len(json.loads(r["label"])["trials"]) for r in rows)
        recorded = [t for r in rows for t in json.loads(r["label"])["trials"]]
        equal_work = {"episodes": len(recorded), "turns": sum(len(t["lengths"]) for t in recorded),
                      "forced_tokens": sum(sum(t["lengths"]) for t in recorded),
                      "skipped_episodes": sum(json.loads(r["label"]).get("skipped_episodes", 0) for r in rows)}
        tool_text = (f"the task's own tools, one free-sampled run replayed ({equal_work['episodes']} episodes, "
                     f"{equal_work['turns']} turns, {equal_work['forced_tokens']:,} forced tokens, tool times as recorded)")
    history = None
    if args.warm_steps:  # earlier steps on other tasks: the history mechanism with the other half's prompts
        history = ([r["prompt"] for r in warm_rows], [r["label"] for r in warm_rows], args.warm_steps)
    if args.history_steps:
        order = range(len(prompts) - 1, -1, -1) if args.history_order == "reversed" else range(len(prompts))
        history = ([prompts[i] for i in order], [labels[i] for i in order], args.history_steps)
    agent_cls = load_agent_class(agent_file)
    engine_kw = dict(model=str(model), dtype=dtype, max_model_len=args.max_len, enforce_eager=not cuda,
                     speculation=args.war_engines,
                     num_speculative_tokens=args.num_speculative_tokens)
    cfg_kwargs = dict(num_engines=args.engines, agent_func_path=str(agent_file), max_turns=256,
                      max_context_tokens=args.max_len, max_new_tokens_per_turn=None,
                      temperature=args.temperature, seed=None, progress=False,
                      engine=engine_kw)  # the pool's own intervals (stats, load, log sync): what a user runs
    t_all = time.time()
    kv_tokens, calibration = args.kv_tokens, None
    if args.pressure is not None:  # measure the live context with ample KV, then size every engine's KV
        handles = create_war_engines(args.engines, RolloutConfig(**cfg_kwargs).engine, placement_group=True)
        run_war(handles, cfg_kwargs, "war", prompts[:args.engines], labels[:args.engines], 1, tokenizer, agent_cls)
        calibration = run_war(handles, cfg_kwargs, "war", prompts, labels, n, tokenizer, agent_cls)
        for h in handles:
            ray.get(h.shutdown.remote())
            ray.kill(h)
        live = len(prompts) * n / args.engines * calibration["final_context_tokens_mean"]
        kv_tokens = max(args.max_len, int(live / args.pressure))
    live_per_engine = None
    if calibration is not None:
        live_per_engine = len(prompts) * n / args.engines * calibration["final_context_tokens_mean"]

    runners = {}
    engine_set = {}  # configuration -> the engine handles it runs on
    war_names = [c for c in configs if c in WAR_CONFIGS and c not in OWN_ENGINE_SETS]
    handles = None
    if war_names or args.same_engines:
        if any(c in PRIORITY_CONFIGS for c in configs):
            engine_kw = {**engine_kw, "scheduling_policy": "priority"}
            cfg_kwargs["engine"] = {**dict(cfg_kwargs["engine"]), "scheduling_policy": "priority"}
        ecfg = RolloutConfig(**{**cfg_kwargs, "engine": {**engine_kw, "kv_capacity_tokens": kv_tokens,
                                                           "kv_events": any(c in KV_EVENT_CONFIGS for c in configs)}}).engine
        handles = create_war_engines(args.engines, ecfg, placement_group=True,
                                     agent_func_path=str(agent_file) if args.same_engines else None)
    if war_names:
        # warm-up: one whole step, as a training job's engines have run the step before (the engines'
        # switches keep what they measured of their steps; every run's index starts empty)
        run_war(handles, cfg_kwargs, war_names[0], prompts, labels, n, tokenizer, agent_cls)
        for name in war_names:
            engine_set[name] = handles
            runners[name] = (lambda name=name: run_war(handles, cfg_kwargs, name, prompts, labels, n, tokenizer,
                                                       agent_cls, history))
    own_sets = []  # OWN_ENGINE_SETS: engine sets of their own (plain, or drafting by vLLM's suffix method)
    for name in (c for c in configs if c in OWN_ENGINE_SETS):
        own_kwargs = {**cfg_kwargs, "engine": {**dict(cfg_kwargs["engine"]), "speculation": OWN_ENGINE_SETS[name]}}
        own_handles = create_war_engines(args.engines, RolloutConfig(**{**own_kwargs, "engine": {
            **own_kwargs["engine"], "kv_capacity_tokens": kv_tokens}}).engine, placement_group=True)
        own_sets.append(own_handles)
        run_war(own_handles, own_kwargs, name, prompts, labels, n, tokenizer, agent_cls)  # warm-up, as above
        engine_set[name] = own_handles
        runners[name] = (lambda name=name, h=own_handles, kw=own_kwargs: run_war(
            h, kw, name, prompts, labels, n, tokenizer, agent_cls, history))
    baseline_sets = []
    for name, method in BASELINES.items():
        if name not in configs:
            continue
        spec = {"method": method, "num_speculative_tokens": args.num_speculative_tokens} if method else None
        if args.same_engines:
            engines = handles
        else:
            engines = start_openrlhf_engines(args.engines, model, agent_func_path=str(agent_file),
                                             max_model_len=args.max_len, seed=0, kv_capacity_tokens=kv_tokens,
                                             speculative_config=spec)
            baseline_sets.append(engines)
        run_baseline(engines, prompts[:args.engines], labels[:args.engines], 1, tokenizer, args.max_len,
                     args.temperature, args.same_engines)  # warm-up
        engine_set[name] = engines
        runners[name] = (lambda engines=engines, method=method: run_baseline(
            engines, prompts, labels, n, tokenizer, args.max_len, args.temperature, args.same_engines,
            vllm_suffix=method == "suffix", history=history))
    # the processes of every engine set, stopped while a configuration on another set runs
    trees = ({} if args.keep_idle_engines_running else
             {id(h): actor_process_trees(h) for h in {id(h): h for h in engine_set.values()}.values()})
    idle_of = idle_while(engine_set, trees)
    results = {c: [] for c in configs}
    for r in range(args.repeats):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for name in order:
            cpu0 = cpu_seconds_by_kind()
            with paused(idle_of[name]):
                out = runners[name]()
            # CPU seconds of every process kind during the run (the other engine sets: stopped, or
            # idle with --keep-idle-engines-running); see war_openrlhf/metrics/process_cpu.py
            out["cpu_s_by_process"] = cpu_delta(cpu0, cpu_seconds_by_kind())
            results[name].append(out)
            busiest = sorted(out["cpu_s_by_process"].items(), key=lambda kv: -kv[1])[:6]
            print(f"  {name} run {r}: {out['step_s']:.2f} s, {out['throughput_tok_s']:.0f} tok/s, "
                  f"{out['generated_tokens']} tokens; CPU s: " + ", ".join(f"{k} {v:.2f}" for k, v in busiest),
                  file=sys.stderr, flush=True)
    for hs in (handles, *own_sets):
        for h in hs or ():
            ray.get(h.shutdown.remote())
            ray.kill(h)
    for engines in baseline_sets:
        stop_openrlhf_engines(engines)
    ray.shutdown()

    base_step = statistics.median(r["step_s"] for r in results["openrlhf"]) if results.get("openrlhf") else None
    summary = {c: _summarise(results[c], base_step) for c in configs if results[c]}
    pressure = (live_per_engine / kv_tokens) if (live_per_engine and kv_tokens) else None
    episodes_per_engine = len(prompts) * n / args.engines
    regime = {"load": "low" if episodes_per_engine <= 4 else "high",  # low: <= 4 concurrent episodes/engine
              "episodes_per_engine": episodes_per_engine,
              "kv_tokens_per_engine": kv_tokens, "pressure": pressure, "tool_latency": tool_text,
              "history_steps": args.history_steps, "history_order": args.history_order if args.history_steps else None,
              "warm_steps": args.warm_steps, "warm_split": _OTHER_HALF[args.split] if args.warm_steps else None}
    def write(**extra):
        out = {"benchmark": "rollout", "cuda": cuda, "speculating_fraction_scope": "run",
               "workload": args.workload, "split": args.split if args.workload.startswith("traces:") else None,
               "model": str(model), "engines": args.engines, "same_engines": args.same_engines,
               "war_engines": args.war_engines,
               "kv_tokens_per_engine": kv_tokens, "pressure": pressure, "regime": regime,
               "prompts": len(prompts), "n_samples": n, "episodes": len(prompts) * n, "max_len": args.max_len,
               "equal_work": equal_work,
               # the other configurations' engines during each run: stopped (SIGSTOP) or left running idle
               "idle_engines": "running" if args.keep_idle_engines_running else "stopped",
               "temperature": args.temperature, "repeats": args.repeats, "wall_s": time.time() - t_all,
               "calibration": calibration, "configs": summary, "runs": results,
               # what re-creates the trace workload (tools/resimulate_rollout.py reads it)
               "trace_args": {"max_groups": args.max_groups, "skip_groups": args.skip_groups,
                              "seed": args.seed, "tool_latency": args.tool_latency,
                              "tool_jitter": args.tool_jitter, "per_env_token": args.per_env_token},
               # a task workload's recorded episodes, as every configuration replayed them: the
               # simulator re-runs them with any cost model (tools/resimulate_rollout.py)
               "replayed_rows": rows if equal_work else None,
               **extra}
        write_json(args.json, out)

    write()  # the measurements are on disk before anything else can fail
    simulated = None
    if args.cost_model:
        if not (args.workload.startswith("traces:") or equal_work):
            raise SystemExit("--cost-model: the simulator replays trace workloads and recorded task runs "
                             "(not --free-sampling) only")
        sim = simulate_configs(replay_trajectories(rows, tokenizer, n, args.seed), args.cost_model, args.engines,
                               kv_tokens, summary, args.plain_cost_model, args.same_engines, args.war_engines,
                               args.suffix_cost_model)
        simulated = {c: v["x_openrlhf"] for c, v in sim.items()}
        for c, v in sim.items():
            measured = summary[c].get("x_openrlhf")
            summary[c]["simulated_step_s"] = v["step_s"]
            summary[c]["simulated_x_openrlhf"] = v["x_openrlhf"]
            summary[c]["simulated_over_measured"] = (round(v["x_openrlhf"] / measured, 3)
                                                     if measured and v["x_openrlhf"] else None)
    if simulated:
        write(simulated=simulated, cost_model=args.cost_model, plain_cost_model=args.plain_cost_model,
              suffix_cost_model=args.suffix_cost_model)

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    kv_text = "engines' default KV" if kv_tokens is None else f"KV {kv_tokens:,} tokens/engine"
    print(f"\n### {args.workload}, {args.engines} engines, load {regime['load']} ({regime['episodes_per_engine']:g} "
          f"episodes/engine), {kv_text}, pressure {f(pressure, '.2f')}, tools: {tool_text}, "
          f"median of {args.repeats}\n")
    print("| config | step s (spread) | x openrlhf | tok/s | tokens | turn p50/p99 s | tail 10% share | "
          "trajectory p99 s | prefix hit | preempt | tok/verif step | acceptance | speculating | KV peak |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for c, d in summary.items():
        lat = ("n/a" if d.get("turn_latency_p50_s") is None
               else f"{d['turn_latency_p50_s']:.2f}/{d['turn_latency_p99_s']:.2f}")
        print(f"| {c} | {d['step_s']:.2f} ({d['step_s_spread'][0]:.2f}-{d['step_s_spread'][1]:.2f}) | "
              f"{f(d['x_openrlhf'], '.2f')} | {d['throughput_tok_s']:,.0f} | {d['generated_tokens']:,} | {lat} | "
              f"{f(d.get('tail10_share'), '.2f')} | {f(d.get('trajectory_p99_s'), '.2f')} | "
              f"{f(d.get('engine_prefix_hit_rate'), '.3f')} | {f(d.get('preemptions'), 'd')} | "
              f"{f(d.get('tokens_per_verification_step'), '.2f')} | {f(d.get('acceptance'), '.2f')} | "
              f"{d.get('speculating_fraction', 'n/a')} | {d.get('kv_usage_peak', 'n/a')} |")
    ests = {c: [r.get("cache_estimate") for r in results[c] if r.get("cache_estimate")] for c in summary}
    if any(ests.values()):
        print("\nThe dispatcher's estimate of each turn's cached prefix vs the engine's report (all runs pooled):\n")
        print("| config | turns | exact | over (turns) | under (turns) | over tokens | under tokens | "
              "|error| / cached token |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for c, runs in ests.items():
            if not runs:
                continue
            t = {k: sum(r[k] for r in runs) for k in ("turns", "over_tokens", "under_tokens", "cached_tokens")}
            ex = sum(r["exact"] * r["turns"] for r in runs) / t["turns"]
            ov = sum(r["over"] * r["turns"] for r in runs) / t["turns"]
            un = sum(r["under"] * r["turns"] for r in runs) / t["turns"]
            err = (t["over_tokens"] + t["under_tokens"]) / t["cached_tokens"] if t["cached_tokens"] else None
            print(f"| {c} | {t['turns']} | {ex:.3f} | {ov:.3f} | {un:.3f} | {t['over_tokens']:,} | "
                  f"{t['under_tokens']:,} | {f(err, '.4f')} |")
    if simulated:
        print("\n| config | measured x openrlhf | simulated x openrlhf | simulated / measured |")
        print("|---|---:|---:|---:|")
        for c, d in summary.items():
            print(f"| {c} | {f(d.get('x_openrlhf'), '.2f')} | {f(d.get('simulated_x_openrlhf'), '.2f')} | "
                  f"{f(d.get('simulated_over_measured'), '.3f')} |")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
