"""The record channel: every finished turn, once, to every engine's index replica.

The pool hands each finished turn to :meth:`LogShipper.record`. The record keeps only what a
replica keeps (the last ``prompt_lead_in`` tokens of the context, the response, the ids and the
policy version: ``GlobalSuffixIndex`` inserts nothing else), gets the next sequence number of the
one :class:`~war_openrlhf.speculation.CompletedSequenceLog`, and is encoded to its wire form
(:func:`war_openrlhf.engine.wire.entries_to_wire`) once, however many engines receive it. Every
``log_sync_interval_s`` (and at the end of a batch, with ``flush``) :meth:`sync` pushes each
healthy engine the entries after its own position; the engine queues them and its worker applies
them between steps within ``sync_max_lag_*``, decoding and checking each once
(``entries_from_wire``). Entries every live replica holds are truncated from the log.

One position per engine (:attr:`EngineClient.log_sent`), one knob for how often
(``log_sync_interval_s``); the engine's bound on how long a replica may lag is its own
(``EngineConfig.sync_max_lag_records`` / ``_seconds``).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from ..engine.drafting import drafting_for
from ..engine.stats import EngineStats
from ..engine.wire import entries_to_wire
from ..engine.wire import tokens_from_wire
from ..speculation import CompletedSequence, CompletedSequenceLog, InflightChunk
from .config import RolloutConfig
from .engine_client import EngineClient, EngineDead
from .record_archive import RecordArchive

__all__ = ["LogShipper"]

log = logging.getLogger(__name__)


class LogShipper:
    """The global log and its delivery to every engine's replica."""

    def __init__(self, config: RolloutConfig, engines: Sequence[EngineClient], owner: str) -> None:
        self.engines = list(engines)
        self.owner = owner  # the replicas follow this owner's log (a pool id)
        # engines without a replica (plain, or vLLM's own suffix method) get no log: the config's
        # kind until an engine's stats name its own (a pool may mix kinds)
        for e in self.engines:
            e.has_war_index = config.engine.drafting.has_war_index
        self.lead_in = int(config.engine.index.prompt_lead_in)
        self.inflight = bool(config.engine.index.inflight_sharing)
        self.inflight_chunks = 0
        self.log = CompletedSequenceLog()
        # what the replicas hold, for a checkpoint (engines without a replica: nothing to keep)
        self.archive = RecordArchive(config.engine.index)
        self._archiving = config.engine.drafting.has_war_index
        self._wire: dict[int, dict[str, Any]] = {}  # seq -> wire form, until every live replica has it
        self.errors = 0  # background sync failures (logged)

    @property
    def policy_version(self) -> int:
        return self.log.policy_version

    def record(self, trajectory_id: str, group_id: str, policy_version: int, context: np.ndarray,
               response: np.ndarray) -> None:
        """One finished turn: appended to the log with only what a replica keeps."""
        lead = context[-self.lead_in:] if self.lead_in else context[:0]
        record = CompletedSequence.create(trajectory_id, group_id, policy_version, lead, response)
        self.log.append(record)
        if self._archiving:
            self.archive.add(record)

    def advance_policy_version(self, version: int) -> None:
        self.log.advance_policy_version(version)
        self.archive.advance_policy_version(version)

    async def forget(self) -> int:
        """Drop every record kept so far (the log's entries, the archive, every replica's index,
        re-attached empty); the policy version stays. Returns the records the replicas held."""
        dropped = len(self.archive)
        self.log.truncate(self.log.last_seq)
        self.archive.clear()
        self._wire.clear()
        for e in self.engines:
            if e.healthy:
                await self.attach(e)
        return dropped

    def _wire_after(self, seq: int) -> list[dict[str, Any]]:
        """The log's entries after ``seq`` in wire form (each entry encoded once)."""
        entries = self.log.read(seq)
        missing = [e for e in entries if e.seq not in self._wire]
        if missing:
            for e, w in zip(missing, entries_to_wire(missing)):
                self._wire[e.seq] = w
        return [self._wire[e.seq] for e in entries]

    def _receivers(self) -> list[EngineClient]:
        """Engines whose replica follows this log now: a WAR replica, healthy, not refusing entries."""
        return [e for e in self.engines if e.has_war_index and e.healthy and not e.last_sync_error]

    def unsent_records(self) -> int:
        """Records on the log the slowest live replica has not been sent yet (0 with none)."""
        sent = [e.log_sent for e in self._receivers()]
        return max(0, self.log.last_seq - min(sent)) if sent else 0

    async def sync(self, flush: bool = False) -> None:
        """Ship entries each healthy engine has not seen yet; truncate what all have.
        ``flush``: also make every replica apply them now (end of a batch), instead of within
        the engine's lag bound. A dead engine is marked so and skipped; an engine that refuses
        the entries (its index was reset by another client) is counted in ``sync_errors`` and
        re-attached at the next batch: drafting is lost there meanwhile, rollouts are not.
        With no engine holding a replica, nothing is shipped and the log keeps no entries."""
        if self.inflight:
            await self._collect_inflight()
        last = self.log.last_seq
        for e in self._receivers():
            if e.log_sent >= last:
                continue
            wire = self._wire_after(e.log_sent)
            try:
                await e.push_log(wire)
                e.log_sent = wire[-1]["seq"] if wire else e.log_sent
            except EngineDead:
                pass
            except Exception as exc:  # noqa: BLE001 - reported, and repaired at the next batch
                e.sync_failed(exc)
        if flush:
            for e in self._receivers():
                try:
                    await e.flush_log()
                except EngineDead:
                    pass
                except Exception as exc:  # noqa: BLE001
                    e.sync_failed(exc)
        if not any(e.has_war_index for e in self.engines):
            upto = last  # no replica will ever read them
        else:
            alive = [e.log_sent for e in self._receivers()]
            upto = min(alive) if alive else 0
        if upto >= self.log.first_seq:
            self.log.truncate(upto)
            first = self.log.first_seq
            for seq in [s for s in self._wire if s < first]:
                del self._wire[seq]

    async def _collect_inflight(self) -> None:
        """Put the receiving engines' new in-flight tokens on the log (a failed engine is skipped:
        its siblings draft a little less until the next sync). Only engines drafting by their
        last report are asked: an engine hands out tokens only while its drafter runs, and at
        high load, where the switch keeps drafting off, the call would be a cost for nothing."""
        for e in self._receivers():
            war = e.last_stats.war or {}
            mode = war.get("mode")
            if mode == "off" or (mode == "auto" and not (war.get("switch") or {}).get("speculating", True)):
                continue
            try:
                chunks = await e.inflight_chunks()
            except EngineDead:
                continue
            except Exception:  # noqa: BLE001 - drafting degrades, rollouts go on
                self.errors += 1
                log.exception("in-flight chunks from engine %d failed (rollouts go on)", e.index)
                continue
            for i, c in enumerate(chunks):
                seq = self.log.append_chunk(InflightChunk.create(
                    c["key"], c["trajectory_id"], c["group_id"], c["offset"],
                    tokens_from_wire(c["token_ids"], f"engine {e.index} chunk {i}: token_ids")))
                # already in wire form (the worker's): shipped as it came, not encoded again
                self._wire[seq] = {"seq": seq, "policy_version": None, "record": None, "chunk": c}
            self.inflight_chunks += len(chunks)

    async def sync_in_background(self) -> None:
        """One background round: a failure is logged and counted; rollouts go on."""
        try:
            await self.sync()
        except Exception:  # noqa: BLE001 - reported; drafting degrades, rollouts go on
            self.errors += 1
            log.exception("index log sync failed (rollouts go on; drafting may lag)")

    async def attach(self, engine: EngineClient) -> bool:
        """Make ``engine``'s replica follow this log afresh from its first retained entry."""
        if not engine.has_war_index:
            return True
        try:
            await engine.reset_index(self.owner, self.log.first_seq - 1)
        except EngineDead:
            return False
        engine.log_sent = self.log.first_seq - 1
        engine.last_sync_error = None
        return True

    async def attach_all(self, stats: Sequence[EngineStats]) -> None:
        """Attach every healthy engine never attached, taken over by another owner since
        (``index_owner`` in ``stats``), or that refused entries."""
        for e, s in zip(self.engines, stats):
            if s.speculation:
                e.has_war_index = drafting_for(s.speculation).has_war_index
            if e.has_war_index and e.healthy and (s.index_owner != self.owner or e.last_sync_error):
                await self.attach(e)
