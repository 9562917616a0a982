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

Example:
  python tools/bench_index.py --json results/bench_index.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from war_openrlhf.metrics import format_table, write_json  # noqa: E402
from war_openrlhf.speculation import CompletedSequence, CompletedSequenceLog, GlobalSuffixIndex, SuffixIndexConfig  # noqa: E402
from war_openrlhf.traces import group_trajectories, load_chat_traces, tokenize_traces  # noqa: E402

DEFAULT_TRACES = ROOT.parent / "shared" / "traces" / "tau_airline_dev.json"


def turn_records(trajs, policy_version=0, prefix=""):
    for tr in trajs:
        for t, turn in enumerate(tr.turns):
            yield CompletedSequence.create(
                f"{prefix}{tr.trajectory_id}", tr.group_id, policy_version,
                turn.context_token_ids, turn.response_token_ids,
            )


def bench_insertion(records, config, repeats):
    rates = []
    for _ in range(repeats):
        log = CompletedSequenceLog()
        log.append_many(records)
        replica = GlobalSuffixIndex(config)
        t0 = time.perf_counter()
        replica.sync(log)
        dt = time.perf_counter() - t0
        rates.append(replica.indexed_tokens / dt)
    return replica, float(np.median(rates))


def bench_speculate(replica, trajs, k, calls, seed):
    """Latency of speculate as an engine's decode loop calls it: a random turn is
    decoded from its first token to its end (speculate, append accepted + 1, repeat);
    every call is timed, the first one of each turn (cold caches) included."""
    rng = np.random.default_rng(seed)
    turns = [(tr, t) for tr in trajs for t in tr.turns if t.response_token_ids.size > 4]
    lat = []
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
            t0 = time.perf_counter_ns()
            d = replica.speculate_engine(rid, ctx, k)
            lat.append((time.perf_counter_ns() - t0) / 1e3)
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
    lat = np.array(lat)
    return float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), drafted / len(lat)


def bench_replication(base_records, make_traj_records, config, replicas, repeats):
    """Per repeat: fresh replicas pre-filled with base_records, then time one trajectory."""
    serial, per_replica, tokens = [], [], 0
    for r in range(repeats):
        log = CompletedSequenceLog()
        log.append_many(base_records)
        reps = [GlobalSuffixIndex(config) for _ in range(replicas)]
        for rep in reps:
            rep.sync(log)
        recs = make_traj_records(r)
        t0 = time.perf_counter()
        log.append_many(recs)
        times = []
        for rep in reps:
            t1 = time.perf_counter()
            rep.sync(log)
            times.append(time.perf_counter() - t1)
        serial.append(time.perf_counter() - t0)
        per_replica.append(max(times))
        tokens = reps[0].indexed_tokens - sum(
            int(x.response_token_ids.size) + min(config.prompt_lead_in, int(x.prompt_token_ids.size)) for x in base_records
        )
    return 1e3 * float(np.median(serial)), 1e3 * float(np.median(per_replica)), tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    trajs = tokenize_traces(load_chat_traces(args.traces))
    config = SuffixIndexConfig()
    records = list(turn_records(trajs))
    rows, results = [], {}

    replica, rate = bench_insertion(records, config, args.repeats)
    results["insertion_tokens_per_s"] = rate
    rows.append({"metric": "insertion", "value": rate / 1e6, "unit": "M tokens/s",
                 "note": f"{len(records)} turn records, {replica.indexed_tokens} tokens"})

    p50, p99, hit = bench_speculate(replica, trajs, args.k, args.calls, args.seed)
    results.update(speculate_p50_us=p50, speculate_p99_us=p99, speculate_draft_rate=hit)
    rows.append({"metric": "speculate p50", "value": p50, "unit": "us", "note": f"K={args.k}, {args.calls} calls"})
    rows.append({"metric": "speculate p99", "value": p99, "unit": "us", "note": f"{hit:.0%} of calls drafted"})

    bpt = replica.bytes_per_indexed_token()
    results["bytes_per_indexed_token"] = bpt
    rows.append({"metric": "memory", "value": bpt, "unit": "B/token", "note": f"{replica.memory_bytes() / 2**20:.1f} MiB"})

    rng = np.random.default_rng(args.seed)
    vocab = 151_000

    def worst_case(r):  # one record of 8192 fresh tokens
        return [CompletedSequence.create(f"long{r}", "glong", 0, [1],
                                         rng.integers(0, vocab, size=8192 - config.prompt_lead_in + 1))]

    # a real multi-turn trajectory of ~8k tokens (context + responses): its turn records
    real = min((t for t in trajs), key=lambda t: abs(int(t.turns[-1].context_token_ids.size
                                                        + t.turns[-1].response_token_ids.size) - 8192))
    real_tokens = int(real.turns[-1].context_token_ids.size + real.turns[-1].response_token_ids.size)

    def real_traj(r):
        return list(turn_records([real], prefix=f"rep{r}/"))

    base = records[:500]
    for name, make in (("8k response tokens", worst_case), (f"real {real_tokens}-token trajectory", real_traj)):
        serial, per, toks = bench_replication(base, make, config, args.replicas, args.repeats)
        key = "replicate_worst_case" if name.startswith("8k") else "replicate_real_trajectory"
        results[key] = {"serial_ms": serial, "per_replica_ms": per, "tokens_inserted_per_replica": toks,
                        "replicas": args.replicas}
        rows.append({"metric": f"replicate x{args.replicas} serial", "value": serial, "unit": "ms",
                     "note": f"{name}: {toks} tokens/replica"})
        rows.append({"metric": f"replicate x{args.replicas} parallel", "value": per, "unit": "ms",
                     "note": "slowest replica (one per engine process)"})

    print(format_table(rows, [("metric", "metric", ""), ("value", "value", ".2f"), ("unit", "unit", ""),
                              ("note", "note", "")]))
    out = write_json(args.json, {"benchmark": "suffix_index", "config": config.__dict__, "results": results})
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
