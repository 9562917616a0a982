"""The pool process's heap kept out of Python's garbage collections while a batch runs.

A batch of thousands of episodes allocates fast enough to trigger the collector's full passes
many times a step, and each full pass walks every object the process holds: in a trainer's
process that is torch, transformers and the tokenizer's millions of objects, none of which the
batch makes garbage. ``gc.freeze()`` moves every object that exists when the batch starts to a
permanent generation the collector skips; ``gc.unfreeze()`` at the batch's end hands them back,
so garbage made before the batch is still collected later and nothing is held for good. vLLM
does the same for its engine core's startup heap (``vllm/v1/engine/core.py`` ~244-246,
``freeze_gc_heap``). Measured: ``docs/benchmarks.md``, "One step of thousands of episodes".
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["frozen_heap"]

_LOCK = threading.Lock()
_DEPTH = [0]  # batches inside frozen_heap now (two pools in one process may overlap)


@contextmanager
def frozen_heap(enabled: bool = True) -> Iterator[None]:
    """Freeze the heap for the ``with`` block; the last block to leave unfreezes it."""
    if not enabled:
        yield
        return
    with _LOCK:
        _DEPTH[0] += 1
        gc.freeze()  # again for a nested block: what the outer batch allocated since joins it
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                gc.unfreeze()
