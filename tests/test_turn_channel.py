"""The turn channel (engine/turn_channel.py) on real sockets, with a handler standing in for the
engine's ``generate_tokens`` (the transport is what is tested; tests/test_rollout_pool.py runs
it against real engines): answers find their requests out of order, the context arrives
exactly, errors keep their class names, a wrong secret is refused, a lost connection fails
every waiting request at once and never hangs it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from war_openrlhf.engine.turn_channel import (TOKEN_BYTES, ChannelClosed, RemoteError, TurnChannelClient,
                                              TurnChannelServer)
from war_openrlhf.rollout.engine_client import actor_died


class EngineDeadError(RuntimeError):  # vLLM's name for a dead engine core
    pass


async def _handler(context, params, request_id, trajectory_id, group_id, priority):
    if params.get("fail") == "value":
        raise ValueError("bad sampling params: top_p 7")
    if params.get("fail") == "dead":
        raise EngineDeadError("engine core died")
    await asyncio.sleep(params.get("delay", 0.0))
    return {"token_ids": [int(x) for x in context[::-1]], "sum": int(context.sum()), "trajectory_id": trajectory_id,
            "group_id": group_id, "priority": priority, "params": params}


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def _with_channel(body):
    """Run ``body(client, server)`` against a server on loopback, both closed afterwards."""
    async def main():
        server = TurnChannelServer(_handler)
        client = await TurnChannelClient.connect(await server.start("127.0.0.1"))
        try:
            await body(client, server)
        finally:
            client.close()
            server.close()

    _run(main())


def test_answers_find_their_requests_out_of_order_and_contexts_arrive_exactly():
    async def main():
        server = TurnChannelServer(_handler)
        address = await server.start("127.0.0.1")
        client = await TurnChannelClient.connect(address)
        rng = np.random.default_rng(0)
        contexts = [rng.integers(0, 2**31 - 1, size=n).astype(np.int32) for n in (1, 7, 3000, 40)]
        delays = [0.3, 0.0, 0.1, 0.2]  # finish in another order than sent
        answers = await asyncio.gather(*(
            client.request(client.encode(c, {"delay": d, "max_tokens": 4, "stop": ["\n"]}, f"t{i}", "g", i))
            for i, (c, d) in enumerate(zip(contexts, delays))))
        for i, (c, a) in enumerate(zip(contexts, answers)):
            assert a["token_ids"] == [int(x) for x in c[::-1]] and a["sum"] == int(c.astype(np.int64).sum())
            assert a["trajectory_id"] == f"t{i}" and a["priority"] == i and a["params"]["stop"] == ["\n"]
        client.close()
        server.close()

    _run(main())


def test_an_engine_error_keeps_its_class_names_and_a_dead_engine_is_recognised():
    async def body(client, _server):
        ctx = np.arange(3, dtype=np.int32)
        with pytest.raises(RemoteError, match="ValueError: bad sampling params") as bad:
            await client.request(client.encode(ctx, {"fail": "value"}, "t", "g", 0))
        assert not actor_died(bad.value)
        with pytest.raises(RemoteError) as dead:
            await client.request(client.encode(ctx, {"fail": "dead"}, "t", "g", 0))
        assert dead.value.class_names[:2] == ["EngineDeadError", "RuntimeError"] and actor_died(dead.value)
        # the connection survives request errors
        assert (await client.request(client.encode(ctx, {}, "t", "g", 0)))["token_ids"] == [2, 1, 0]

    _with_channel(body)


def test_kwargs_msgpack_cannot_carry_are_refused_before_sending():
    async def body(client, _server):
        with pytest.raises(TypeError):
            client.encode(np.arange(2), {"logits_processors": [object()]}, "t", "g", 0)
        assert (await client.request(client.encode(np.arange(2), {}, "t", "g", 0)))["token_ids"] == [1, 0]

    _with_channel(body)


def test_a_connection_without_the_secret_is_refused():
    async def main():
        server = TurnChannelServer(_handler)
        address = dict(await server.start("127.0.0.1"))
        address["token"] = bytes(len(address["token"]))
        client = await TurnChannelClient.connect(address)
        with pytest.raises(ChannelClosed):
            await client.request(client.encode(np.arange(3), {}, "t", "g", 0))
        assert server.refused_connections == 1
        server.close()

    _run(main())


def test_a_lost_connection_fails_every_waiting_request_and_later_ones():
    async def main():
        server = TurnChannelServer(_handler)
        client = await TurnChannelClient.connect(await server.start("127.0.0.1"))
        waiting = [asyncio.ensure_future(client.request(client.encode(np.arange(5), {"delay": 5.0}, "t", "g", 0)))
                   for _ in range(3)]
        await asyncio.sleep(0.2)
        server.close()  # the engine side goes away mid-turn: its handlers are cancelled
        for task in list(server._tasks):
            task.cancel()
        # the server's handler closes the connection when its reader ends; force that end
        client._reader.feed_eof()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, ChannelClosed) for r in results), results
        assert client.closed
        with pytest.raises(ChannelClosed):
            await client.request(client.encode(np.arange(5), {}, "t", "g", 0))

    _run(main())


def test_closing_from_a_finished_event_loop_drops_the_socket():
    """A batch's loop ends with the channel open (the pool closes it, but a crash may not):
    closing it later, from another loop, neither raises nor hangs."""
    holder = {}

    async def main():
        server = TurnChannelServer(_handler)
        loop = asyncio.get_running_loop()
        # the client lives on a loop of its own thread, which then ends
        import threading

        other = asyncio.new_event_loop()
        t = threading.Thread(target=other.run_forever, daemon=True)
        t.start()
        address = await server.start("127.0.0.1")

        async def use():
            holder["client"] = await TurnChannelClient.connect(address)
            return await holder["client"].request(holder["client"].encode(np.arange(2), {}, "t", "g", 0))

        answer = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(use(), other))
        assert answer["token_ids"] == [1, 0]
        other.call_soon_threadsafe(other.stop)
        t.join(5)
        other.close()
        holder["client"].close()  # its loop is closed: the socket is dropped
        assert holder["client"].closed
        server.close()
        assert loop.is_running()

    _run(main())


def test_turn_answers_keep_the_load_fresh_and_polls_skip_until_the_step_cost_is_due():
    """``EngineClient.refresh_load(max_age_s)``: no poll while turn answers brought the queue within
    ``max_age_s``; a poll when they did not, and every ``10 * max_age_s`` for the step cost."""
    import time

    from war_openrlhf.rollout.engine_client import EngineClient

    class Engine:  # the two calls the client makes here, counted
        polls = 0

        async def generate_tokens(self, ids, params, request_id, trajectory_id, group_id):
            return {"token_ids": [1], "logprobs": [0.0], "load_now": {"waiting": 3, "running": 1}}

        async def load(self, step_cost=True):
            Engine.polls += 1
            Engine.fits += bool(step_cost)
            return {"waiting": 0, "running": 0, **({"step_s": 0.01} if step_cost else {})}

        fits = 0

    async def main():
        client = EngineClient(0, Engine())
        answer = await client.generate_tokens([1, 2], {"max_tokens": 1}, "t", "g")
        assert "load_now" not in answer and client.load["waiting"] == 3 and client.load_at > 0
        await client.refresh_load(0.5)  # the queue is fresh, but the step cost was never read
        assert Engine.polls == 1 and client.load["step_s"] == 0.01
        await client.generate_tokens([1, 2], {"max_tokens": 1}, "t", "g")
        await client.refresh_load(0.5)  # both fresh: no call
        assert Engine.polls == 1 and client.load == {"waiting": 3, "running": 1, "step_s": 0.01}
        client.load_at = time.monotonic() - 1.0  # no answer for longer than max_age_s
        await client.refresh_load(0.5)  # the queue only: the step cost is not due, and is kept
        assert (Engine.polls, Engine.fits) == (2, 1) and client.load == {"waiting": 0, "running": 0, "step_s": 0.01}
        client.load_at = client.step_cost_at = time.monotonic() - 6.0  # the step cost is due again
        await client.refresh_load(0.5)
        assert (Engine.polls, Engine.fits) == (3, 2)
        await client.refresh_load()  # no max_age_s: always a poll, with the step cost
        assert (Engine.polls, Engine.fits) == (4, 3)

    _run(main())


class _RemoteMethod:
    """A Ray actor method's shape (``.options(...).remote(*args)`` -> awaitable) over a coroutine."""

    def __init__(self, fn):
        self.fn = fn

    def options(self, **_kwargs):
        return self

    def remote(self, *args):
        return self.fn(*args)


@pytest.mark.parametrize("failure, retried", [(asyncio.TimeoutError, True), (ConnectionRefusedError, False)])
def test_a_channel_that_timed_out_opening_is_tried_again_at_the_next_batch_a_refused_one_is_not(
        failure, retried, monkeypatch):
    """A connection that only took too long (a loop busy with thousands of first turns) must not
    send every later batch's turns over Ray; a refused port (a firewall) stays off."""
    from war_openrlhf.rollout.engine_client import EngineClient

    async def address():
        return {"host": "127.0.0.1", "port": 1, "token": b"x" * TOKEN_BYTES}

    async def never(*_args):
        raise AssertionError("no turn is sent here")

    handle = SimpleNamespace(generate_tokens=_RemoteMethod(never), turn_channel=_RemoteMethod(address))
    attempts = []

    async def failing_connect(cls, addr, timeout_s=10.0):
        attempts.append(addr["port"])
        raise failure("no connection")

    monkeypatch.setattr(TurnChannelClient, "connect", classmethod(failing_connect))
    client = EngineClient(0, handle)

    async def two_batches():
        await client.open_channel()
        first = client.channel_off_reason
        await client.open_channel()
        return first

    first = asyncio.run(two_batches())
    assert first is not None and "no connection" in first  # the reason is kept
    assert len(attempts) == (2 if retried else 1)
    assert client.healthy


def test_engine_calls_carry_no_ray_task_events():
    """Every call the pool makes to an engine actor (stats, load polls, log pushes: every
    interval of a long job) is made with enable_task_events=False, so Ray's GCS keeps no event
    record of it; a call without that option would fail here."""
    from war_openrlhf.rollout.engine_client import EngineClient

    seen = []

    class Method:
        def __init__(self, name):
            self.name = name

        def options(self, **kwargs):
            seen.append((self.name, kwargs))
            return SimpleNamespace(remote=self._call)

        def remote(self, *_args):
            raise AssertionError(f"{self.name} called without options")

        async def _call(self, *_args):
            return {"kv_cache_usage": 0.0} if self.name == "load" else []

    handle = SimpleNamespace(**{m: Method(m) for m in ("generate_tokens", "load", "stats", "kv_events", "push_log")})
    client = EngineClient(0, handle)

    async def calls():
        await client.refresh_load()
        await client.kv_events()
        await client.push_log([])

    asyncio.run(calls())
    assert [name for name, _ in seen] == ["load", "kv_events", "push_log"]
    assert all(kwargs == {"enable_task_events": False} for _, kwargs in seen)


def test_calls_by_name_share_the_connection_with_turns_and_only_served_names_run():
    """The pool's periodic calls (in-flight chunks, log pushes, load polls) travel on the same
    connection as turns: arguments and results arrive as sent, interleaved with a turn still
    running; an unserved name and a call's own exception come back as errors naming them."""
    seen = []

    async def push_log(entries):
        seen.append(entries)
        return len(entries)

    async def broken():
        raise KeyError("no replica installed")

    async def main():
        server = TurnChannelServer(_handler, calls={"push_log": push_log, "broken": broken})
        client = await TurnChannelClient.connect(await server.start("127.0.0.1"))
        try:
            ctx = np.arange(5, dtype=np.int32)
            turn = asyncio.ensure_future(client.request(client.encode(ctx, {"delay": 0.3}, "t", "g", 0)))
            entries = [{"seq": 1, "policy_version": None, "record": None,
                        "chunk": {"key": "e0:r", "token_ids": b"\x01\x00\x00\x00", "offset": 0}}]
            assert await client.call("push_log", entries) == 1
            assert not turn.done()  # the call was answered while the turn still ran
            assert seen == [entries]
            with pytest.raises(RemoteError) as unknown:
                await client.call("shutdown")
            assert "shutdown" in str(unknown.value) and unknown.value.class_names[0] == "ValueError"
            with pytest.raises(RemoteError) as failed:
                await client.call("broken")
            assert failed.value.class_names[0] == "KeyError" and "no replica" in failed.value.message
            assert (await turn)["token_ids"] == [4, 3, 2, 1, 0]
        finally:
            client.close()
            server.close()

    _run(main())


def test_periodic_calls_take_the_open_channel_and_fall_back_to_ray_when_it_closes():
    """EngineClient's in-flight chunks, log pushes and load polls: on the loop's open channel when
    there is one (not a Ray task); over Ray once it closed; an engine whose vLLM died inside its
    actor (the error carried back on the channel) is marked dead."""
    from war_openrlhf.rollout.engine_client import EngineClient, EngineDead

    ray_calls = []

    async def over_ray(name):
        async def fn(*args):
            ray_calls.append((name, args))
            return [{"via": "ray"}]
        return fn

    async def chunks():
        return [{"via": "channel"}]

    async def load(step_cost=True):
        raise EngineDeadError("engine core died")

    async def main():
        server = TurnChannelServer(_handler, calls={"inflight_chunks": chunks, "load": load})
        address = await server.start("127.0.0.1")
        handle = SimpleNamespace(generate_tokens=_RemoteMethod(_handler),
                                 inflight_chunks=_RemoteMethod(await over_ray("inflight_chunks")),
                                 load=_RemoteMethod(await over_ray("load")),
                                 turn_channel=_RemoteMethod(lambda: _address(address)))
        client = EngineClient(0, handle)
        try:
            assert await client.inflight_chunks() == [{"via": "ray"}]  # no channel opened yet: Ray
            await client.open_channel()
            assert await client.inflight_chunks() == [{"via": "channel"}] and client.channel_calls == 1
            assert ray_calls == [("inflight_chunks", ())]
            client._channel.close()  # the connection is lost
            assert await client.inflight_chunks() == [{"via": "ray"}] and client.channel_calls == 1
            assert client.healthy
            await client.open_channel()
            with pytest.raises(EngineDead):
                await client._hot_call("load", True)
            assert not client.healthy and "engine core died" in client.error
        finally:
            client.close_channel()
            server.close()

    _run(main())


async def _address(address):
    return address
