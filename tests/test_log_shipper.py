"""The record channel (rollout/log_shipper.py): each record encoded once however many engines
receive it, holding only what a replica keeps, and decoded by the worker's own decoder."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from war_openrlhf.engine.stats import EngineStats
from war_openrlhf.engine.wire import entries_from_wire
from war_openrlhf.rollout import RolloutConfig
from war_openrlhf.rollout import log_shipper as shipper_module
from war_openrlhf.rollout.engine_client import EngineClient
from war_openrlhf.rollout.log_shipper import LogShipper
from war_openrlhf.rollout.turn_result import TurnResult


class Replica:
    """An engine as the shipper sees it: it keeps what it is pushed."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.flushes = 0
        self.outbox: list[dict] = []  # in-flight chunks the engine would hand out

    async def inflight_chunks(self):
        out, self.outbox = self.outbox, []
        return out

    async def push_log(self, wire):
        self.received.extend(wire)
        return len(wire)

    async def flush_log(self):
        self.flushes += 1
        return 0

    async def reset_index(self, owner=None, start_seq=0):
        self.received.clear()
        return {}


def _shipper(n_engines: int, lead_in: int = 4):
    cfg = RolloutConfig(agent_func_path="agent.py", progress=False, engine={"index": {"prompt_lead_in": lead_in}})
    replicas = [Replica() for _ in range(n_engines)]
    clients = [EngineClient(i, r) for i, r in enumerate(replicas)]
    return LogShipper(cfg, clients, owner="pool-x"), replicas, clients


def test_each_record_is_encoded_once_and_keeps_only_the_lead_in(monkeypatch):
    calls = []
    real = shipper_module.entries_to_wire

    def counting(entries):
        calls.append([e.seq for e in entries])
        return real(entries)

    monkeypatch.setattr(shipper_module, "entries_to_wire", counting)
    shipper, replicas, clients = _shipper(3, lead_in=4)
    rng = np.random.default_rng(0)
    contexts = [rng.integers(0, 1000, size=50 + i, dtype=np.int32) for i in range(5)]
    responses = [rng.integers(0, 1000, size=7, dtype=np.int32) for _ in range(5)]
    for i in range(3):
        shipper.record(f"t{i}", "g", 0, contexts[i], responses[i])
    asyncio.run(shipper.sync())
    for i in range(3, 5):
        shipper.record(f"t{i}", "g", 0, contexts[i], responses[i])
    asyncio.run(shipper.sync(flush=True))
    encoded = [seq for batch in calls for seq in batch]
    assert sorted(encoded) == sorted(set(encoded)) == [1, 2, 3, 4, 5]  # once each, 3 engines
    for r in replicas:
        entries = entries_from_wire(r.received)  # the worker's decoder accepts them as they are
        assert [e.seq for e in entries] == [1, 2, 3, 4, 5] and r.flushes == 1
        for e, ctx, resp in zip(entries, contexts, responses):
            np.testing.assert_array_equal(e.record.prompt_token_ids, ctx[-4:])
            np.testing.assert_array_equal(e.record.response_token_ids, resp)
    assert all(c.log_sent == 5 for c in clients)
    assert shipper.log.first_seq > 5 or len(shipper.log) == 0  # every replica has all: truncated
    assert shipper._wire == {}  # and their encodings dropped


def test_a_dead_engine_does_not_hold_back_truncation_and_is_reattached():
    shipper, replicas, clients = _shipper(2)
    for i in range(2):
        shipper.record(f"t{i}", "g", 0, np.arange(10, dtype=np.int32), np.arange(3, dtype=np.int32))
    clients[1].healthy = False
    asyncio.run(shipper.sync())
    assert len(replicas[0].received) == 2 and replicas[1].received == []
    assert len(shipper.log) == 0  # the only live replica has them
    clients[1].healthy = True  # back: it must be re-attached (from the first retained entry) before more
    asyncio.run(shipper.attach(clients[1]))
    shipper.record("t2", "g", 0, np.arange(10, dtype=np.int32), np.arange(3, dtype=np.int32))
    asyncio.run(shipper.sync())
    assert [w["seq"] for w in replicas[1].received] == [3]


def test_turn_result_from_an_engine_answer():
    answer = {"token_ids": [1, 2], "logprobs": [-0.1, -0.2], "finish_reason": "stop", "num_prompt_tokens": 9,
              "num_cached_tokens": 4, "weight_versions": [3, 2], "queue_s": 0.5, "engine": 7, "custom": 1}
    r = TurnResult.from_engine(answer, engine=1, prompt_tokens=9, attempts=2, estimated_cached_tokens=3)
    assert (r.engine, r.attempts, r.weight_versions, r.num_cached_tokens) == (1, 2, (2, 3), 4)
    assert r.queue_s == 0.5 and r.prefill_s is None and r.extra == {"custom": 1}
    with pytest.raises(ValueError, match="engine 1: a turn's answer has no token_ids"):
        TurnResult.from_engine({"logprobs": []}, engine=1, prompt_tokens=0)


class PlainReplica(Replica):
    """An engine without a WAR replica (``speculation: none``): index calls are refused, as
    ``WarEngine`` refuses them."""

    async def push_log(self, wire):
        raise ValueError("push_log: this engine has no WAR index replica")

    async def reset_index(self, owner=None, start_seq=0):
        raise ValueError("reset_index: this engine has no WAR index replica")


def test_engines_whose_stats_name_no_replica_get_no_log_and_do_not_hold_back_truncation():
    cfg = RolloutConfig(agent_func_path="agent.py", progress=False)
    replicas = [Replica(), PlainReplica(), Replica()]
    clients = [EngineClient(i, r) for i, r in enumerate(replicas)]
    shipper = LogShipper(cfg, clients, owner="pool-x")
    kinds = ["auto", "none", "auto"]
    asyncio.run(shipper.attach_all([EngineStats(engine=i, speculation=k) for i, k in enumerate(kinds)]))
    assert [c.has_war_index for c in clients] == [True, False, True]
    for i in range(3):
        shipper.record(f"t{i}", "g", 0, np.arange(10, dtype=np.int32), np.arange(3, dtype=np.int32))
    asyncio.run(shipper.sync(flush=True))
    assert [len(r.received) for r in replicas] == [3, 0, 3]
    assert [c.sync_errors for c in clients] == [0, 0, 0] and clients[1].last_sync_error is None
    assert len(shipper.log) == 0  # the plain engine holds nothing back


def test_with_no_replica_anywhere_the_log_keeps_nothing_and_nothing_is_shipped():
    cfg = RolloutConfig(agent_func_path="agent.py", progress=False, engine={"speculation": "none"})
    replicas = [PlainReplica(), PlainReplica()]
    clients = [EngineClient(i, r) for i, r in enumerate(replicas)]
    shipper = LogShipper(cfg, clients, owner="pool-x")
    asyncio.run(shipper.attach_all([EngineStats(engine=i, speculation="none") for i in range(2)]))
    for i in range(4):
        shipper.record(f"t{i}", "g", 0, np.arange(10, dtype=np.int32), np.arange(3, dtype=np.int32))
        asyncio.run(shipper.sync(flush=i == 3))
    assert len(shipper.log) == 0 and shipper.log.last_seq == 4  # numbering goes on, entries do not pile up
    assert [c.sync_errors for c in clients] == [0, 0] and all(r.received == [] for r in replicas)


def test_in_flight_chunks_of_one_engine_reach_every_replica_in_log_order(monkeypatch):
    from war_openrlhf.engine.wire import tokens_to_bytes

    encoded = []
    real = shipper_module.entries_to_wire
    monkeypatch.setattr(shipper_module, "entries_to_wire", lambda es: encoded.extend(es) or real(es))
    shipper, replicas, _ = _shipper(2)
    replicas[0].outbox = [{"key": "e0:r1", "trajectory_id": "t1", "group_id": "g", "offset": 0,
                           "token_ids": tokens_to_bytes(np.array([5, 6, 7]))}]
    asyncio.run(shipper.sync())
    shipper.record("t1", "g", 0, np.arange(10, dtype=np.int32), np.array([5, 6, 7, 8], dtype=np.int32))
    asyncio.run(shipper.sync())
    for r in replicas:
        entries = entries_from_wire(r.received)
        assert [e.seq for e in entries] == [1, 2]
        assert entries[0].chunk.key == "e0:r1" and entries[0].chunk.token_ids.tolist() == [5, 6, 7]
        assert entries[1].record.trajectory_id == "t1"
    assert shipper.inflight_chunks == 1 and shipper.errors == 0
    assert [e.chunk for e in encoded] == [None]  # the chunk travels in the worker's wire form, encoded once


def test_without_in_flight_sharing_no_engine_is_asked_for_chunks():
    cfg = RolloutConfig(agent_func_path="agent.py", progress=False, engine={"index": {"inflight_sharing": False}})
    replica = Replica()
    replica.outbox = [{"key": "k", "trajectory_id": "t", "group_id": "g", "offset": 0, "token_ids": b"\x01\x00\x00\x00"}]
    shipper = LogShipper(cfg, [EngineClient(0, replica)], owner="pool-x")
    asyncio.run(shipper.sync())
    assert replica.outbox and replica.received == []


def test_engines_not_drafting_by_their_last_report_are_not_asked_for_chunks():
    from war_openrlhf.engine.wire import tokens_to_bytes

    shipper, replicas, clients = _shipper(3)
    chunk = {"key": "k", "trajectory_id": "t", "group_id": "g", "offset": 0, "token_ids": tokens_to_bytes(np.array([1]))}
    for r in replicas:
        r.outbox = [dict(chunk, key=f"k{id(r)}")]
    clients[0].last_stats = EngineStats(engine=0, war={"mode": "auto", "switch": {"speculating": False}})
    clients[1].last_stats = EngineStats(engine=1, war={"mode": "off", "switch": {"speculating": True}})
    clients[2].last_stats = EngineStats(engine=2, war={"mode": "auto", "switch": {"speculating": True}})
    asyncio.run(shipper.sync())
    assert [bool(r.outbox) for r in replicas] == [True, True, False]
    assert shipper.inflight_chunks == 1


def test_unsent_records_count_what_the_slowest_live_replica_still_lacks():
    shipper, replicas, clients = _shipper(2)
    rng = np.random.default_rng(1)
    assert shipper.unsent_records() == 0
    for i in range(3):
        shipper.record(f"t{i}", "g", 0, rng.integers(0, 1000, size=20, dtype=np.int32),
                       rng.integers(0, 1000, size=5, dtype=np.int32))
    assert shipper.unsent_records() == 3
    asyncio.run(shipper.sync())
    assert shipper.unsent_records() == 0
    clients[1].healthy = False  # a dead engine does not hold the count back
    shipper.record("t3", "g", 0, rng.integers(0, 1000, size=20, dtype=np.int32),
                   rng.integers(0, 1000, size=5, dtype=np.int32))
    assert shipper.unsent_records() == 1
    asyncio.run(shipper.sync())
    assert shipper.unsent_records() == 0
