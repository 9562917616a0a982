"""Deferred first turns are offered again in the policy's admission order (the pool's
TurnRouter.notify; the simulator's twin is tested in test_cluster_sim)."""

from __future__ import annotations

import asyncio

import numpy as np

from war_openrlhf.dispatch import TurnRequest, make_policy
from war_openrlhf.rollout.config import RolloutConfig
from war_openrlhf.rollout.turn_router import TurnRouter


class _Ranked:
    """A policy stand-in: only what notify() asks of it (pure ordering logic)."""

    def __init__(self, ordered: bool) -> None:
        self.orders_admission = ordered

    def admission_priority(self, request: TurnRequest) -> float:
        return float(request.trajectory_id[1:])

    def start_batch(self) -> None:
        pass


def _resume_order(policy, ids):
    async def run():
        router = TurnRouter(RolloutConfig(), [], policy, shipper=None)
        router.start_batch()
        order = []

        async def waiter(tid):
            room = asyncio.get_running_loop().create_future()
            router._deferred.append((len(router._deferred), TurnRequest(tid, "g", np.zeros(4, np.int32), 0, 0), room))
            await room
            order.append(tid)

        tasks = [asyncio.create_task(waiter(t)) for t in ids]
        await asyncio.sleep(0)  # every waiter is parked
        await router.notify()
        await asyncio.gather(*tasks)
        assert router._deferred == []
        return order

    return asyncio.run(run())


def test_deferred_turns_resume_in_admission_order():
    ids = ["t3", "t9", "t1", "t7"]
    assert _resume_order(_Ranked(False), ids) == ids  # arrival order
    assert _resume_order(_Ranked(True), ids) == ["t9", "t7", "t3", "t1"]


def test_war_fifo_keeps_arrival_order_through_the_router():
    ids = ["a", "b", "c"]
    assert _resume_order(make_policy("war", 2), ids) == ids
