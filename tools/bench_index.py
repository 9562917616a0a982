#!/usr/bin/env python
"""Micro-benchmarks of the global suffix index (one replica, this machine).

  insertion      tokens/s a replica applies from the log (turn records of real traces)
  speculate      latency per call (the engine's path, ``speculate_engine``), p50/p99, inside
                 a decode loop (a turn drafts, the
                 accepted tokens are appended, it drafts again, to the turn's end),
                 index pre-filled with every turn of the traces
  replication    time for one completed trajectory to reach 8 replicas (log append +
                 every replica's sync), serial on this machine, and per replica (the
                 wall time when replicas apply in parallel, one per engine process)
  memory         bytes per cached token
  breakdown      one request's speculate: the same call again (warm CPU caches), after the
                 caches are flushed, after appending one token (as decoding does)
  trees          speculate on the index's tree (``war``: arctic's tree with the longest-first
                 speculate) and on arctic-inference's own tree (``arctic_`` keys), each in a
                 replica of its own fed the same records, the same calls, in rotating order

Every measurement runs --repeats times (default 3) on the same work; the JSON keeps every run
and the table shows the median (min-max). Each is timed twice: wall time, and this thread's
CPU time (``time.thread_time_ns``, the clocks' own cost subtracted), which leaves out the time
the scheduler gives to other work on a shared machine (not the cache misses that work causes).
The JSON records the machine's load average.

Example:
  python tools/bench_index.py --json benchmarks/results/index/bench_index.json
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from war_openrlhf.metrics import format_table, spread, timed_call, timer_overhead_us, write_json  # noqa: E402
from war_openrlhf.speculation import CompletedSequence, CompletedSequenceLog, GlobalSuffixIndex, SuffixIndexConfig  # noqa: E402
from war_openrlhf.traces import group_trajectories, load_chat_traces, tokenize_traces  # noqa: E402
from war_openrlhf.speculation.suffix_tree import tree_class  # noqa: E402

DEFAULT_TRACES = ROOT.parent / "shared" / "traces" / "tau_airline_dev.json"


def turn_records(trajs, policy_version=0, prefix=""):
    for tr in trajs:
        for t, turn in enumerate(tr.turns):
            yield CompletedSequence.create(
                f"{prefix}{tr.trajectory_id}", tr.group_id, policy_version,
                turn.context_token_ids, turn.response_token_ids,
            )


def bench_insertion(records, config):
    """One run: a fresh replica applies every record from the log; tokens/s (wall, CPU)."""
    log = CompletedSequenceLog()
    log.append_many(records)
    replica = GlobalSuffixIndex(config)
    _, wall_us, cpu_us = timed_call(replica.sync, log)
    return replica, 1e6 * replica.indexed_tokens / wall_us, 1e6 * replica.indexed_tokens / cpu_us


def bench_speculate(replica, trajs, k, calls, seed, overhead):
    """Latency of speculate as an engine's decode loop calls it: a random turn is
    decoded from its first token to its end (speculate, append accepted + 1, repeat);
    every call is timed, the first one of each turn (cold caches) included."""
    rng = np.random.default_rng(seed)
    turns = [(tr, t) for tr in trajs for t in tr.turns if t.response_token_ids.size > 4]
    lat, cpu = [], []
    drafted = 0
    i = 0
    while len(lat) < calls:
        tr, turn = turns[int(rng.integers(len(turns)))]
        resp = turn.response_token_ids
        pos = 1  # the prefill step sampled the first token
        rid = f"probe{i}"
        i += 1
        replica.start_request(rid, turn.context_token_ids, tr.group_id, tr.trajectory_id + "/probe")
        replica.extend_request(rid, resp[:pos])
        while pos < resp.size:
            ctx = np.concatenate([turn.context_token_ids[-64:], resp[:pos]])
            d, w, c = timed_call(replica.speculate_engine, rid, ctx, k)
            lat.append(max(0.0, w - overhead[0]))
            cpu.append(max(0.0, c - overhead[1]))
            drafted += len(d.token_ids) > 0
            accepted = 0
            for tok in d.token_ids:
                if pos + accepted >= resp.size or tok != resp[pos + accepted]:
                    break
                accepted += 1
            step = min(accepted + 1, int(resp.size) - pos)
            replica.extend_request(rid, resp[pos : pos + step])
            pos += step
        replica.stop_request(rid)
    pct = lambda xs, q: float(np.percentile(np.array(xs), q))
    return {"speculate_p50_us": pct(lat, 50), "speculate_p99_us": pct(lat, 99),
            "speculate_p50_cpu_us": pct(cpu, 50), "speculate_p99_cpu_us": pct(cpu, 99),
            "speculate_draft_rate": drafted / len(lat)}


def bench_breakdown(replica, trajs, k, calls, seed, overhead, flush_mib=64):
    """Where one request's speculate time goes, p50 over ``calls`` calls each: the same call
    again (warm CPU caches), the same call after ``flush_mib`` MiB are written (cold caches),
    and after appending one token each time (as decoding does)."""
    rng = np.random.default_rng(seed)
    long_turns = [(tr, t) for tr in trajs for t in tr.turns if t.response_token_ids.size >= 2 * calls + 8]
    tr, turn = long_turns[int(rng.integers(len(long_turns)))]
    resp = turn.response_token_ids
    rid = f"breakdown{seed}"
    replica.start_request(rid, turn.context_token_ids, tr.group_id, tr.trajectory_id + "/breakdown")
    pos = resp.size // 4
    replica.extend_request(rid, resp[:pos])

    def ctx():
        return np.concatenate([turn.context_token_ids[-64:], resp[:pos]])

    def timed(c):
        _, w, cpu = timed_call(replica.speculate_engine, rid, c, k)
        return max(0.0, w - overhead[0]), max(0.0, cpu - overhead[1])

    c = ctx()
    timed(c)
    warm = [timed(c) for _ in range(calls)]
    junk = np.zeros(flush_mib * 2**20, dtype=np.uint8)
    flushed = []
    for _ in range(calls):
        junk += 1  # every byte written: the trees' nodes leave the CPU caches
        flushed.append(timed(c))
    appended = []
    for _ in range(calls):
        replica.extend_request(rid, resp[pos : pos + 1])
        pos += 1
        appended.append(timed(ctx()))
    replica.stop_request(rid)
    out = {}
    for name, xs in (("warm", warm), ("flushed", flushed), ("after_append", appended)):
        out[f"{name}_us"] = float(np.median([w for w, _ in xs]))
        out[f"{name}_cpu_us"] = float(np.median([c for _, c in xs]))
    return out


def bench_replication(base_records, recs, config, replicas):
    """One run: fresh replicas pre-filled with base_records, then one trajectory's records
    appended to the log and applied by every replica in turn. Returns (serial ms, slowest
    replica ms, tokens inserted per replica)."""
    log = CompletedSequenceLog()
    log.append_many(base_records)
    reps = [GlobalSuffixIndex(config) for _ in range(replicas)]
    for rep in reps:
        rep.sync(log)
    before = reps[0].indexed_tokens
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    log.append_many(recs)
    walls, cpus = [], []
    for rep in reps:
        _, w, c = timed_call(rep.sync, log)
        walls.append(w)
        cpus.append(c)
    serial_wall, serial_cpu = (time.perf_counter_ns() - w0) / 1e6, (time.thread_time_ns() - c0) / 1e6
    return {"serial_ms": serial_wall, "per_replica_ms": max(walls) / 1e3,
            "serial_cpu_ms": serial_cpu, "per_replica_cpu_ms": max(cpus) / 1e3}, reps[0].indexed_tokens - before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--breakdown-calls", type=int, default=50)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of every measurement (same work each run); the files keep every run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")

    trajs = tokenize_traces(load_chat_traces(args.traces))
    config = SuffixIndexConfig()
    records = list(turn_records(trajs))

    rng = np.random.default_rng(args.seed)
    vocab = 151_000
    # one record of 8192 fresh tokens: the same tokens in every run
    worst = [CompletedSequence.create("long", "glong", 0, [1],
                                      rng.integers(0, vocab, size=8192 - config.prompt_lead_in + 1))]
    # a real multi-turn trajectory of ~8k tokens (context + responses): its turn records
    real = min((t for t in trajs), key=lambda t: abs(int(t.turns[-1].context_token_ids.size
                                                        + t.turns[-1].response_token_ids.size) - 8192))
    real_tokens = int(real.turns[-1].context_token_ids.size + real.turns[-1].response_token_ids.size)
    real_recs = list(turn_records([real], prefix="rep/"))
    base = records[:500]

    overhead = timer_overhead_us()
    runs: dict[str, list[float]] = {}

    def add(key, value):
        runs.setdefault(key, []).append(value)

    tokens_inserted = {}
    arctic_config = SuffixIndexConfig(suffix_tree="arctic")
    replica = arctic_replica = None
    for r in range(args.repeats):  # every measurement once per run, runs in sequence
        replica = arctic_replica = None  # the last run's replicas go first
        gc.collect()
        order = ("war", "arctic") if r % 2 == 0 else ("arctic", "war")  # the two trees in rotating order
        for tree in order:
            if tree == "war":
                replica, rate, rate_cpu = bench_insertion(records, config)
                add("insertion_tokens_per_s", rate)
                add("insertion_cpu_tokens_per_s", rate_cpu)
            else:
                arctic_replica, arctic_rate, arctic_rate_cpu = bench_insertion(records, arctic_config)
                add("arctic_insertion_tokens_per_s", arctic_rate)
                add("arctic_insertion_cpu_tokens_per_s", arctic_rate_cpu)
        # the same calls (same seed) on each
        for tree in order:
            rep, prefix = (replica, "") if tree == "war" else (arctic_replica, "arctic_")
            for key, v in bench_speculate(rep, trajs, args.k, args.calls, args.seed, overhead).items():
                add(prefix + key, v)
        arctic_replica = None  # only the index's tree is timed below
        for key, v in bench_breakdown(replica, trajs, args.k, args.breakdown_calls, args.seed, overhead).items():
            add(f"breakdown_{key}", v)
        for name, recs in (("8k", worst), ("real", real_recs)):
            times, toks = bench_replication(base, recs, config, args.replicas)
            for key, v in times.items():
                add(f"replicate_{name}_{key}", v)
            tokens_inserted[name] = toks
        print(f"run {r + 1}/{args.repeats}: insertion {rate / 1e6:.2f} M tokens/s ({rate_cpu / 1e6:.2f} by CPU time), "
              f"speculate p50 {runs['speculate_p50_us'][-1]:.1f} us ({runs['speculate_p50_cpu_us'][-1]:.1f} CPU), "
              f"arctic's tree {runs['arctic_speculate_p50_us'][-1]:.1f} us ({runs['arctic_speculate_p50_cpu_us'][-1]:.1f} CPU)",
              flush=True)

    results = {key: spread(vals) for key, vals in runs.items()}
    results.update(
        records=len(records), indexed_tokens=replica.indexed_tokens,
        memory_bytes=replica.memory_bytes(), bytes_per_indexed_token=replica.bytes_per_indexed_token(),
        replicas=args.replicas, replicate_8k_tokens_per_replica=tokens_inserted["8k"],
        replicate_real_trajectory_tokens=real_tokens,
        replicate_real_tokens_per_replica=tokens_inserted["real"],
        k=args.k, calls=args.calls, breakdown_calls=args.breakdown_calls, breakdown_flush_mib=64,
        timer_overhead_us={"wall": overhead[0], "cpu": overhead[1]},
        suffix_tree=tree_class(config.suffix_tree).__module__,
    )

    def fmt(key, scale=1.0):
        s, c = results[key], results[key.replace("_us", "_cpu_us").replace("_ms", "_cpu_ms")
                                         .replace("insertion_tokens", "insertion_cpu_tokens")]
        return (f"{s['median'] * scale:.2f} ({s['min'] * scale:.2f}-{s['max'] * scale:.2f}), CPU "
                f"{c['median'] * scale:.2f} ({c['min'] * scale:.2f}-{c['max'] * scale:.2f})")

    rows = [
        {"metric": "insertion", "value": fmt("insertion_tokens_per_s", 1e-6), "unit": "M tokens/s",
         "note": f"{len(records)} turn records, {replica.indexed_tokens} tokens"},
        {"metric": "speculate p50", "value": fmt("speculate_p50_us"), "unit": "us", "note": f"K={args.k}, {args.calls} calls"},
        {"metric": "speculate p99", "value": fmt("speculate_p99_us"), "unit": "us",
         "note": f"{results['speculate_draft_rate']['median']:.0%} of calls drafted"},
        {"metric": "insertion, arctic's tree", "value": fmt("arctic_insertion_tokens_per_s", 1e-6), "unit": "M tokens/s",
         "note": "the same records, the two trees in rotating order"},
        {"metric": "speculate p50, arctic's tree", "value": fmt("arctic_speculate_p50_us"), "unit": "us",
         "note": f"{results['arctic_speculate_draft_rate']['median']:.0%} of calls drafted"},
        {"metric": "speculate p99, arctic's tree", "value": fmt("arctic_speculate_p99_us"), "unit": "us", "note": ""},
        {"metric": "memory", "value": f"{results['bytes_per_indexed_token']:.0f}", "unit": "B/token",
         "note": f"{results['memory_bytes'] / 2**20:.1f} MiB"},
        {"metric": "speculate, same call again", "value": fmt("breakdown_warm_us"), "unit": "us", "note": "warm caches"},
        {"metric": "speculate, caches flushed", "value": fmt("breakdown_flushed_us"), "unit": "us", "note": "64 MiB written"},
        {"metric": "speculate, after an append", "value": fmt("breakdown_after_append_us"), "unit": "us", "note": ""},
    ]
    for name, label in (("8k", "8k response tokens"), ("real", f"real {real_tokens}-token trajectory")):
        rows.append({"metric": f"replicate x{args.replicas} serial", "value": fmt(f"replicate_{name}_serial_ms"),
                     "unit": "ms", "note": f"{label}: {tokens_inserted[name]} tokens/replica"})
        rows.append({"metric": f"replicate x{args.replicas} parallel", "value": fmt(f"replicate_{name}_per_replica_ms"),
                     "unit": "ms", "note": "slowest replica (one per engine process)"})
    print(f"median of {args.repeats} runs (min-max)")
    print(format_table(rows, [("metric", "metric", ""), ("value", "value", ""), ("unit", "unit", ""),
                              ("note", "note", "")]))
    out = write_json(args.json, {"benchmark": "suffix_index", "repeats": args.repeats, "timed": True,
                                 "config": config.__dict__, "results": results})
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
