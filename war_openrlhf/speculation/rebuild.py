"""Stored records and the trees rebuilt from them.

A replica's global tree (and each group tree) is always exactly "the surviving records,
appended in log order". After an eviction the global tree is rebuilt that way: a shadow
tree filled in slices (:class:`RebuildJob`) while the old one keeps drafting, then swapped
in. Group trees are small and rebuilt at once (:func:`rebuild_group_trees`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

import numpy as np

from .suffix_tree import SuffixTree

#: Sequence ids handed to the C++ tree are 31-bit.
SEQ_MASK = 0x7FFFFFFF


@dataclass
class StoredRecord:
    """A record as a replica keeps it."""

    seq: int
    trajectory_id: str
    group_id: str
    policy_version: int
    tokens: np.ndarray  # what went into the trees (lead-in + response)


class GroupTree(NamedTuple):
    """One GRPO group's tree and the log seqs of the records it holds, in order."""

    tree: SuffixTree
    seqs: list[int]


@dataclass
class RebuildJob:
    """A shadow global tree filled from ``survivors`` (in log order) a slice at a time."""

    tree: SuffixTree
    survivors: list[StoredRecord]
    next_record: int = 0  # index into survivors
    offset: int = 0  # tokens of survivors[next_record] already in the tree
    seconds: float = field(default=0.0)

    @property
    def finished(self) -> bool:
        return self.next_record >= len(self.survivors)

    def step(self, chunk: int) -> int:
        """Insert about ``chunk`` more tokens; returns how many were inserted."""
        t0 = time.perf_counter()
        i, offset = self.next_record, self.offset
        survivors, tree = self.survivors, self.tree
        done = 0
        while i < len(survivors) and done < chunk:
            r = survivors[i]
            part = r.tokens[offset : offset + chunk - done]
            tree.extend_ndarray(r.seq & SEQ_MASK, part)
            done += int(part.size)
            offset += int(part.size)
            if offset >= r.tokens.size:
                i, offset = i + 1, 0
        self.next_record, self.offset = i, offset
        self.seconds += time.perf_counter() - t0
        return done


def rebuild_group_trees(
    records: Iterable[StoredRecord], old: dict[str, GroupTree], new_tree: Callable[[], SuffixTree]
) -> dict[str, GroupTree]:
    """Group trees holding exactly ``records`` (in order); a group whose records did not
    change keeps its tree from ``old``."""
    by_seq: dict[int, StoredRecord] = {}
    alive: dict[str, list[int]] = {}
    for r in records:
        by_seq[r.seq] = r
        alive.setdefault(r.group_id, []).append(r.seq)
    groups: dict[str, GroupTree] = {}
    for gid, seqs in alive.items():
        kept = old.get(gid)
        if kept is not None and kept.seqs == seqs:
            groups[gid] = kept  # untouched group keeps its tree
            continue
        tree = new_tree()
        for s in seqs:
            tree.extend_ndarray(s & SEQ_MASK, by_seq[s].tokens)
        groups[gid] = GroupTree(tree, seqs)
    return groups
