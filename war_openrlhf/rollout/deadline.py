"""A coroutine awaited within a deadline, without a task of its own.

``asyncio.wait_for`` wraps its coroutine in a new task (one more task and one more event-loop
iteration per call); the pool sets a deadline on every turn and every agent call, so on Python
3.11+ ``asyncio.timeout`` does it in the caller's own task instead. Both raise
``asyncio.TimeoutError`` (on 3.11+ the built-in ``TimeoutError``) when the deadline passes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11+


async def within(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    """``await awaitable``, cancelled with ``asyncio.TimeoutError`` after ``timeout_s`` seconds."""
    if _TIMEOUT is None:
        return await asyncio.wait_for(awaitable, timeout_s)
    async with _TIMEOUT(timeout_s):
        return await awaitable
