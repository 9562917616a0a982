"""Engine supervision: health, stats, recovery of dead-marked engines, shutdown.

Every call that is not a turn or a log push goes through here (and from here only through
:class:`~.engine_client.EngineClient`). An engine marked dead (its actor died, its vLLM died, or a
turn went unanswered) is probed on a thread of its own, since batches come and go on short-lived
event loops and a restart takes longer than a batch: an answer with the current weights puts it
back (``engine_recovery: reinstate``); otherwise, with ``restart`` on a pool that started its
engines and whose weights are still the model file's, its actor is replaced. The pool's loop
installs what the threads brought back (:meth:`take_recovered`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import numpy as np

from ..engine.stats import EngineStats
from .config import RolloutConfig
from .engine_client import EngineClient, kill_actor

__all__ = ["EngineSupervisor"]

log = logging.getLogger(__name__)


class EngineSupervisor:
    """The pool's engines: their reports, their recovery, their end."""

    def __init__(self, config: RolloutConfig, engines: Sequence[EngineClient], *, launcher: Any = None,
                 started_here: bool = False) -> None:
        self.config = config
        self.engines = list(engines)
        self.launcher = launcher  # the pool can restart only engines it started
        self.started_here = started_here
        self.policy_version = 0  # the pool's; a probed engine must answer with at least these weights
        self.recovered_total = 0
        self._lock = threading.Lock()
        self._recovering: set[int] = set()
        self._recovered: dict[int, tuple[Any, bool]] = {}
        self._closed = threading.Event()
        for e in self.engines:
            e.on_dead = self._engine_died

    # ------------------------------------------------------------------ reports
    async def stats(self) -> list[EngineStats]:
        """Every engine's report (the last one for an engine that died, with ``healthy`` False)."""
        return [await e.stats() for e in self.engines]

    def speculating_fraction(self) -> float | None:
        fr = [e.last_stats.spec_step_fraction for e in self.engines if e.healthy]
        fr = [f for f in fr if f is not None]
        return float(np.mean(fr)) if fr else None

    def any_healthy(self) -> bool:
        return any(e.healthy for e in self.engines)

    # ------------------------------------------------------------------ recovery
    @property
    def has_recovered(self) -> bool:
        return bool(self._recovered)

    def take_recovered(self) -> list[tuple[EngineClient, bool]]:
        """The engines the recovery threads brought back since the last call, revived (healthy,
        on their new handle); ``True`` beside one whose actor was restarted (its caches are empty)."""
        with self._lock:
            items = list(self._recovered.items())
            self._recovered.clear()
        out = []
        for index, (handle, restarted) in items:
            self.engines[index].revive(handle)
            self.recovered_total += 1
            log.warning("engine %d %s: back in service", index, "restarted" if restarted else "answers again")
            out.append((self.engines[index], restarted))
        return out

    def _engine_died(self, engine: EngineClient) -> None:
        """Unless ``engine_recovery`` is off, probe (or restart) a dead-marked engine on a thread.
        Only Ray actors are recovered (an in-process engine dies with its process)."""
        if self.config.engine_recovery == "off" or not engine.remote or self._closed.is_set():
            return
        with self._lock:
            if engine.index in self._recovering:
                return
            self._recovering.add(engine.index)
        threading.Thread(target=self._recover, args=(engine,), daemon=True,
                         name=f"war-recover-engine{engine.index}").start()

    def _recover(self, engine: EngineClient) -> None:
        """Retries every ``recovery_probe_interval_s`` until the engine is back, gone for good, or
        the pool shuts down."""
        index = engine.index
        restart = self.config.engine_recovery == "restart" and self.launcher is not None
        probe_s = min(self.config.turn_timeout_s, 30.0)
        try:
            while not self._closed.is_set():
                wire, gone = engine.probe_stats(probe_s)
                if wire is not None and int(wire.get("weight_version", 0)) >= self.policy_version:
                    self._post(index, engine.handle, restarted=False)
                    return
                if restart and self.policy_version == 0:
                    try:
                        new = self.launcher.restart(index, engine.handle)
                    except Exception as exc:  # noqa: BLE001 - retried after the interval
                        log.warning("engine %d: restart failed (%s); retrying in %g s", index, exc,
                                    self.config.recovery_probe_interval_s)
                    else:
                        if self._closed.is_set():  # the pool shut down meanwhile: no orphan actor
                            kill_actor(new)
                            return
                        self._post(index, new, restarted=True)
                        return
                elif gone or wire is not None:  # gone, or answering with weights a sync moved past
                    why = ("its actor is gone" if gone else
                           f"it answers with weights {wire.get('weight_version')} < {self.policy_version}")
                    hint = ("a new actor would roll out the model file's weights, not the trained ones"
                            if restart else "engine_recovery: restart starts a new actor in pools that started their engines")
                    log.warning("engine %d stays out of service: %s (%s)", index, why, hint)
                    return
                self._closed.wait(self.config.recovery_probe_interval_s)
        finally:
            with self._lock:
                self._recovering.discard(index)

    def _post(self, index: int, handle: Any, restarted: bool) -> None:
        with self._lock:
            self._recovered[index] = (handle, restarted)

    # ------------------------------------------------------------------ end
    def shutdown(self) -> None:
        """Stop recovery; end the engines this pool started (and actors restarted but not yet in service)."""
        self._closed.set()
        if not self.started_here:
            return
        with self._lock:
            for handle, restarted in self._recovered.values():
                if restarted:
                    kill_actor(handle)
            self._recovered.clear()
        for e in self.engines:
            e.stop()
