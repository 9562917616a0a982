"""The turn channel: one TCP connection from the pool to each engine actor, for its hot calls.

A turn is the pool's hottest call: one per model turn of every episode. As a Ray actor call it
costs the driver about 1.7 ms of CPU and 3.4 ms of wall time per round trip on a 2-core machine
(serialization, the GCS-free but still heavyweight task path, the actor's task queue), against
74 us and 130 us for a length-prefixed msgpack frame on a plain socket
(``tools/bench_turn_path.py`` measures the whole turn path both ways). So turns travel here, and
so do the small calls the pool makes every few tens of milliseconds while a batch runs (the
engine's in-flight chunks, index log pushes, load polls: the server's ``calls``), which over Ray
would cost the driver and the actor that CPU twice per engine, twenty times a second; everything
else (start-up, stats, weight syncs, recovery) stays on Ray.

The engine serves the channel on its actor's event loop (the loop its vLLM engine runs on), bound
to its node's address on a free port; :meth:`WarEngine.turn_channel` returns ``{host, port,
token}`` over Ray. A client must send the token first (a random 32-byte secret only the pool
learns through Ray); the server closes any connection that does not. Frames are a 4-byte
little-endian length and a msgpack body:

* turn ``[request_no, context_int32_bytes, sampling_kwargs, trajectory_id, group_id, priority]``
* call ``[request_no, name, [args]]`` (only the names the server was given)
* answer ``[request_no, 0, result]`` or ``[request_no, 1, [exception class names], message]``

Requests are answered as they finish (many in flight on one connection). A closed connection
fails the requests waiting on it with :class:`ChannelClosed`; the caller asks Ray whether the
actor lives (:class:`~war_openrlhf.rollout.engine_client.EngineClient`).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import struct
from typing import Any, Awaitable, Callable

import msgpack
import numpy as np

__all__ = ["ChannelClosed", "RemoteError", "TurnChannelClient", "TurnChannelServer", "MAX_FRAME_BYTES"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
TOKEN_BYTES = 32
#: a frame above this is refused (a 1M-token context is 4 MiB; this leaves room for sampling kwargs)
MAX_FRAME_BYTES = 64 << 20
#: seconds a connection may take to present its token
AUTH_TIMEOUT_S = 10.0


class ChannelClosed(ConnectionError):
    """The connection to the engine closed (or never opened) with requests waiting."""


class RemoteError(RuntimeError):
    """The engine's ``generate_tokens`` raised: its exception's class names (the whole MRO, so a
    caller can recognise vLLM's ``EngineDeadError``) and message."""

    def __init__(self, class_names: list[str], message: str) -> None:
        self.class_names = [str(c) for c in class_names]
        self.message = str(message)
        super().__init__(f"{self.class_names[0] if self.class_names else 'Exception'}: {self.message}")


def _frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if n > MAX_FRAME_BYTES:
        raise ConnectionError(f"turn channel: a {n}-byte frame exceeds {MAX_FRAME_BYTES}")
    return await reader.readexactly(n)


def _node_address() -> str:
    """The address other nodes reach this process at (Ray's node IP; loopback outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray here: a local engine
        pass
    return "127.0.0.1"


class TurnChannelServer:
    """Serves ``handler(context, sampling_kwargs, request_id, trajectory_id, group_id, priority)``
    (the engine's ``generate_tokens``) and the coroutine functions in ``calls`` (by name, with
    msgpack-native arguments and results) on the running event loop."""

    def __init__(self, handler: Callable[..., Awaitable[dict[str, Any]]],
                 calls: dict[str, Callable[..., Awaitable[Any]]] | None = None) -> None:
        self.handler = handler
        self.calls = dict(calls or {})
        self.token = os.urandom(TOKEN_BYTES)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.address: dict[str, Any] | None = None
        self.refused_connections = 0

    async def start(self, host: str | None = None) -> dict[str, Any]:
        if self.address is None:
            host = host or _node_address()
            self._server = await asyncio.start_server(self._serve, host, 0)
            port = self._server.sockets[0].getsockname()[1]
            self.address = {"host": host, "port": int(port), "token": self.token}
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        self.address = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), AUTH_TIMEOUT_S)
            if not hmac.compare_digest(token, self.token):
                self.refused_connections += 1
                return
            while True:
                request = msgpack.unpackb(await _read_frame(reader), raw=False)
                task = asyncio.get_running_loop().create_task(self._answer(request, writer))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, ValueError, TypeError,
                msgpack.UnpackException):
            pass  # the client went away or spoke nonsense: its connection ends, nothing else
        finally:
            writer.close()

    async def _answer(self, request: list, writer: asyncio.StreamWriter) -> None:
        number = request[0] if request else -1
        try:
            if len(request) == 3:  # a call
                _, name, args = request
                fn = self.calls.get(name)
                if fn is None:
                    raise ValueError(f"turn channel: no call named {name!r} (served: {', '.join(sorted(self.calls))})")
                result = await fn(*args)
            else:
                _, context, params, trajectory_id, group_id, priority = request
                result = await self.handler(np.frombuffer(context, dtype=np.int32), params, None, trajectory_id,
                                            group_id, int(priority))
            body = msgpack.packb([number, 0, result], use_bin_type=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the request's error travels back to its caller
            names = [c.__name__ for c in type(exc).__mro__ if c is not object]
            body = msgpack.packb([number, 1, names, str(exc)[:4000]], use_bin_type=True)
        if not writer.is_closing():
            writer.write(_frame(body))


class TurnChannelClient:
    """The pool's end: one connection, requests multiplexed by number, bound to one event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.loop = asyncio.get_running_loop()
        self._reader, self._writer = reader, writer
        self._numbers = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self.closed = False
        self._receiver = self.loop.create_task(self._receive())

    @classmethod
    async def connect(cls, address: dict[str, Any], timeout_s: float = 10.0) -> "TurnChannelClient":
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address["host"], int(address["port"])),
                                                timeout_s)
        writer.write(bytes(address["token"]))
        return cls(reader, writer)

    @staticmethod
    def encode(context: np.ndarray, sampling_kwargs: dict[str, Any], trajectory_id: str | None,
               group_id: str | None, priority: int) -> bytes:
        """A request's fields, packed once (msgpack's items of the request array after its number);
        raises ``TypeError`` when msgpack cannot carry the sampling kwargs."""
        fields = (np.ascontiguousarray(context, dtype=np.int32).tobytes(), sampling_kwargs, trajectory_id, group_id,
                  int(priority))
        return b"".join(msgpack.packb(f, use_bin_type=True) for f in fields)

    async def request(self, fields: bytes) -> dict[str, Any]:
        """Send a request :meth:`encode` packed; its answer (or the engine's :class:`RemoteError`)."""
        # a 6-item array: its number, then the packed fields
        return await self._send(lambda number: b"\x96" + msgpack.packb(number) + fields)

    async def call(self, name: str, *args: Any) -> Any:
        """One of the server's ``calls`` (msgpack-native arguments); its result, or the engine's
        :class:`RemoteError`."""
        # a 3-item array: its number, the name, the arguments
        return await self._send(lambda number: msgpack.packb([number, name, list(args)], use_bin_type=True))

    async def _send(self, body: Callable[[int], bytes]) -> Any:
        """Frame ``body(number)`` under the next request number and wait for its answer."""
        if self.closed:
            raise ChannelClosed("turn channel closed")
        number = next(self._numbers)
        future = self.loop.create_future()
        self._waiting[number] = future
        try:
            self._writer.write(_frame(body(number)))
            if self._writer.transport.get_write_buffer_size() > (4 << 20):
                await self._writer.drain()
            return await future
        finally:
            self._waiting.pop(number, None)

    async def _receive(self) -> None:
        why: BaseException | None = None
        try:
            while True:
                answer = msgpack.unpackb(await _read_frame(self._reader), raw=False)
                future = self._waiting.get(answer[0])
                if future is None or future.done():
                    continue  # its caller stopped waiting (a timeout): the answer is dropped
                if answer[1] == 0:
                    future.set_result(answer[2])
                else:
                    future.set_exception(RemoteError(answer[2], answer[3]))
        except asyncio.CancelledError:
            why = ChannelClosed("turn channel closed by the pool")
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            why = ChannelClosed(f"turn channel lost: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a garbled answer: the connection is unusable
            why = ChannelClosed(f"turn channel broken: {type(exc).__name__}: {exc}")
        finally:
            self.closed = True
            if not self.loop.is_closed():  # else: collected after its batch's loop ended, nothing waits
                for future in self._waiting.values():
                    if not future.done():
                        future.set_exception(why or ChannelClosed("turn channel closed"))
                self._writer.close()

    def close(self) -> None:
        """Close from the loop the channel runs on (requests waiting get :class:`ChannelClosed`)."""
        if self.closed:
            return
        self.closed = True
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self._receiver.cancel()
            self._writer.close()
        elif not self.loop.is_closed():  # another thread's loop: ask it
            self.loop.call_soon_threadsafe(self._receiver.cancel)
        else:  # its loop is gone (a batch's asyncio.run ended): drop the socket itself
            sock = getattr(self._writer.transport, "_sock", None)  # asyncio's own socket of the transport
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
