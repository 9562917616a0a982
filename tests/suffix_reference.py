"""Brute-force, plain-Python reference for arctic-inference suffix speculation.

This module re-states, as directly as possible, what
``arctic_inference.suffix_decoding._C.SuffixTree`` (arctic-inference 0.3.0,
``csrc/suffix_decoding/suffix_tree.cc``) computes in *path* mode
(``use_tree_spec=False``).  It keeps the raw sequences and answers every
question by scanning all of them; there is no tree.

The rule (as implemented by the C++ code and reproduced here)
-------------------------------------------------------------

Index contents.  For every stored sequence ``s`` and every start ``i`` in
``range(len(s))`` the index holds the depth-limited suffix
``s[i:i + max_depth]``.  ``count(p)`` is the number of those suffixes that
have ``p`` as a prefix (``count(())`` is the total number of tokens stored).
``extend`` appends to a sequence (a new id starts a new sequence; extending in
several chunks is the same as extending once with the concatenation),
``remove`` forgets a whole sequence.

``speculate(context, max_spec_tokens, factor, offset, min_token_prob)``:

1. ``best = (match_len=0, tokens=[], probs=[], score=0.0)``.
2. For ``match_len = 1, 2, ..., len(context) - 1`` (note: the *whole* context
   is never matched, the loop bound is strict):

   a. ``pattern = context[-match_len:]``; if ``count(pattern) == 0`` stop the
      loop (``break``; every longer pattern would fail too).
   b. ``cap = min(max_spec_tokens, int(f32(f32(match_len * factor) + offset)
      + 1e-6))`` and ``cap = max(cap, 0)``; the product and sum are float32,
      ``+ 1e-6`` is done in double, ``int`` truncates toward zero.
   c. Path walk with ``S = pattern``, ``prob = 1.0f``, ``score = 0.0f``:
      repeat while ``len(tokens) < cap and prob >= f32(min_token_prob)``:
      let ``kids = {t: count(S + (t,)) > 0}``; if empty stop; choose ``t``
      with the maximal ``count(S + (t,))`` (*any* of them on a tie, see
      below); ``prob = f32(prob * f32(f32(count(S+t)) / f32(count(S))))``;
      if now ``prob < min_token_prob`` stop; otherwise emit ``t`` with this
      prob, ``score = f32(score + prob)``, ``S = S + (t,)``.
      (In the C++ tree the ratio is exactly 1 inside a path-compressed node
      and the bound check is re-done after moving to a child; the unified
      formulation above is equivalent.)
   d. If ``score >= best.score`` (float32 values; ``>=`` so that a later,
      longer match wins ties -- including an *empty* draft of score 0, which
      still moves ``best.match_len`` forward) then ``best`` becomes this draft
      with this ``match_len``.
3. Return ``best``.  ``parents`` of a path draft is ``[-1, 0, 1, ...]``.

Equivalently: the result has match length ``m`` iff ``score_m >= score_L``
for every ``L < m`` and ``score_m > score_L`` for every matched ``L > m``.

Ties.  The C++ tree keeps siblings in a list sorted by non-increasing count
and takes the head; the order *among equal counts* depends on the insertion /
removal history.  The reference therefore admits any of the tied children.
Two consequences that the reference handles exactly (instead of assuming them
away):

* Different tied children generally lead to different continuations, so the
  per-match-length *score* (not only the tokens) may depend on the tie order,
  and so may the winning ``match_len``.  (Example: sequences ``[1,2,3]`` and
  ``[1,4]``, context ``[0,1]``, factor 2: the draft is ``[2,3]`` with score
  1.0 or ``[4]`` with score 0.5 depending on which sequence came first.)
* The C++ tree has one fixed child order per node, and the same node can be
  reached from several match lengths (e.g. context ``[1,1,1]``: the walk from
  pattern ``[1]`` passes through the node of pattern ``[1,1]``).  A tie
  decision is therefore keyed by the full string ``S`` at which it is taken
  and must be the same for every match length that reaches ``S``.

``acceptable_drafts`` enumerates every joint assignment of tie decisions that
is reachable and returns the set of resulting final drafts; a C++ result is
correct iff it is one of them (``check_draft``).  Float32 arithmetic is
emulated exactly (every ``+ * /`` on two float32 values is computed in double,
which is exact or correctly rounded, then rounded to float32), so the
reference scores/probs are bit-exact; ``check_draft`` still uses small
tolerances (1e-6 for probs, 1e-5 for the score) when comparing.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "f32",
    "BruteForceSuffixIndex",
    "PathDraft",
    "RefDraft",
    "check_draft",
]

_F32 = struct.Struct("<f")


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 (returned as a float)."""
    return _F32.unpack(_F32.pack(x))[0]


Tokens = Tuple[int, ...]


@dataclass(frozen=True)
class PathDraft:
    """One admissible path walk from a fixed pattern.

    ``choices`` records the tie decisions taken on the way, as
    ``((S, chosen_token), ...)`` where ``S`` is the full string (pattern +
    tokens so far) at which two or more children had the maximal count.
    """

    tokens: Tokens
    probs: Tuple[float, ...]
    score: float
    choices: Tuple[Tuple[Tokens, int], ...] = ()


@dataclass(frozen=True)
class RefDraft:
    """A final speculation result admissible under some tie order."""

    match_len: int
    tokens: Tokens
    probs: Tuple[float, ...]
    score: float

    @property
    def parents(self) -> Tuple[int, ...]:
        return tuple(range(-1, len(self.tokens) - 1))


class TooManyTieCombinations(RuntimeError):
    pass


class BruteForceSuffixIndex:
    """Stores raw sequences; every query is a linear scan.

    API:
      * ``BruteForceSuffixIndex(max_depth)``
      * ``extend(seq_id, tokens)``, ``remove(seq_id)`` (removing an unknown id
        is a no-op, like the C++ tree)
      * ``count(pattern) -> int``
      * ``children(pattern) -> {token: count(pattern + (token,))}``
      * ``max_tokens(match_len, max_spec_tokens, factor, offset) -> int``
      * ``path_drafts(pattern, max_tokens, min_token_prob, fixed=None)
        -> list[PathDraft]`` (all tie-admissible walks from ``pattern``)
      * ``per_match_len(context, ...) -> {match_len: list[PathDraft]}``
      * ``acceptable_drafts(context, ...) -> set[RefDraft]``
      * ``acceptable_summary(context, ...) -> (match_lens, scores,
        token_tuples, {tokens: probs})`` convenience view of the above.
    """

    def __init__(self, max_depth: int, max_tie_combinations: int = 200_000):
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.max_depth = int(max_depth)
        self.seqs: Dict[int, List[int]] = {}
        self.max_tie_combinations = max_tie_combinations

    # ------------------------------------------------------------------ data
    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        tokens = [int(t) for t in tokens]
        if not tokens and seq_id not in self.seqs:
            # C++ extend() with no tokens never creates the sequence.
            return
        self.seqs.setdefault(seq_id, []).extend(tokens)

    def remove(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def num_seqs(self) -> int:
        return len(self.seqs)

    def suffixes(self) -> Iterable[Tokens]:
        """All depth-limited suffixes ``s[i:i+max_depth]`` (with repetition)."""
        for seq in self.seqs.values():
            for i in range(len(seq)):
                yield tuple(seq[i:i + self.max_depth])

    def count(self, pattern: Sequence[int]) -> int:
        p = tuple(int(t) for t in pattern)
        n = len(p)
        return sum(1 for suf in self.suffixes() if suf[:n] == p)

    def children(self, pattern: Sequence[int]) -> Dict[int, int]:
        p = tuple(int(t) for t in pattern)
        n = len(p)
        out: Dict[int, int] = {}
        for suf in self.suffixes():
            if len(suf) > n and suf[:n] == p:
                out[suf[n]] = out.get(suf[n], 0) + 1
        return out

    # ----------------------------------------------------------- speculation
    @staticmethod
    def max_tokens(match_len: int, max_spec_tokens: int,
                   max_spec_factor: float, max_spec_offset: float) -> int:
        # float32: match_len * factor, then + offset; then + 1e-6 in double.
        v = f32(f32(float(match_len)) * f32(max_spec_factor))
        v = f32(v + f32(max_spec_offset))
        cap = min(int(max_spec_tokens), int(v + 1e-6))  # int() truncates
        return max(cap, 0)

    def path_drafts(self, pattern: Sequence[int], max_tokens: int,
                    min_token_prob: float,
                    fixed: Optional[Dict[Tokens, int]] = None
                    ) -> List[PathDraft]:
        """All path drafts from ``pattern`` allowed by some tie order.

        ``fixed`` maps strings ``S`` to an already-decided tied child; those
        decisions are honoured (used for cross-match-length consistency).
        """
        fixed = fixed or {}
        min_p = f32(min_token_prob)
        out: List[PathDraft] = []

        def walk(S: Tokens, tokens: Tokens, probs: Tuple[float, ...],
                 prob: float, score: float,
                 choices: Tuple[Tuple[Tokens, int], ...]) -> None:
            if len(tokens) >= max_tokens or prob < min_p:
                out.append(PathDraft(tokens, probs, score, choices))
                return
            kids = self.children(S)
            if not kids:
                out.append(PathDraft(tokens, probs, score, choices))
                return
            best = max(kids.values())
            tied = sorted(t for t, c in kids.items() if c == best)
            if len(tied) > 1:
                if S in fixed:
                    assert fixed[S] in tied, (S, fixed[S], tied)
                    options = [(fixed[S], choices)]
                else:
                    options = [(t, choices + ((S, t),)) for t in tied]
            else:
                options = [(tied[0], choices)]
            parent_count = self.count(S)
            ratio = f32(f32(float(best)) / f32(float(parent_count)))
            new_prob = f32(prob * ratio)
            if new_prob < min_p:
                # Stops before emitting; which tied child was entered is not
                # observable, so no tie decision is recorded.
                out.append(PathDraft(tokens, probs, score, choices))
                return
            for t, ch in options:
                walk(S + (t,), tokens + (t,), probs + (new_prob,),
                     new_prob, f32(score + new_prob), ch)

        walk(tuple(int(t) for t in pattern), (), (), 1.0, 0.0, ())
        return out

    def matched_lengths(self, context: Sequence[int]) -> List[int]:
        """Match lengths the C++ loop visits (stops at the first failure)."""
        ctx = tuple(int(t) for t in context)
        lens = []
        for m in range(1, len(ctx)):
            if self.count(ctx[len(ctx) - m:]) == 0:
                break
            lens.append(m)
        return lens

    def per_match_len(self, context: Sequence[int], max_spec_tokens: int,
                      max_spec_factor: float, max_spec_offset: float,
                      min_token_prob: float) -> Dict[int, List[PathDraft]]:
        """Per match length, all tie-admissible path drafts (independently)."""
        ctx = tuple(int(t) for t in context)
        res = {}
        for m in self.matched_lengths(ctx):
            cap = self.max_tokens(m, max_spec_tokens, max_spec_factor,
                                  max_spec_offset)
            res[m] = self.path_drafts(ctx[len(ctx) - m:], cap, min_token_prob)
        return res

    def acceptable_drafts(self, context: Sequence[int], max_spec_tokens: int,
                          max_spec_factor: float, max_spec_offset: float,
                          min_token_prob: float) -> set:
        """Set of ``RefDraft`` the C++ tree may return, over all tie orders.

        Enumerates joint tie decisions across all match lengths (a decision
        at string ``S`` is shared by every match length whose walk reaches
        ``S``) and applies the ``score >= best`` selection to each.
        """
        ctx = tuple(int(t) for t in context)
        lens = self.matched_lengths(ctx)
        caps = {m: self.max_tokens(m, max_spec_tokens, max_spec_factor,
                                   max_spec_offset) for m in lens}
        results = set()
        budget = [self.max_tie_combinations]

        def dfs(i: int, fixed: Dict[Tokens, int], chosen: List[PathDraft]):
            if i == len(lens):
                budget[0] -= 1
                if budget[0] < 0:
                    raise TooManyTieCombinations(
                        f"more than {self.max_tie_combinations} tie "
                        f"combinations for context {ctx}")
                best = RefDraft(0, (), (), 0.0)
                for m, d in zip(lens, chosen):
                    if d.score >= best.score:
                        best = RefDraft(m, d.tokens, d.probs, d.score)
                results.add(best)
                return
            m = lens[i]
            for d in self.path_drafts(ctx[len(ctx) - m:], caps[m],
                                      min_token_prob, fixed):
                new_fixed = dict(fixed)
                new_fixed.update(dict(d.choices))
                dfs(i + 1, new_fixed, chosen + [d])

        dfs(0, {}, [])
        return results

    def acceptable_summary(self, context: Sequence[int], max_spec_tokens: int,
                           max_spec_factor: float, max_spec_offset: float,
                           min_token_prob: float):
        """``(match_lens, scores, token_tuples, probs_by_tokens)`` view.

        When there are no relevant ties every component has one element.
        """
        acc = self.acceptable_drafts(context, max_spec_tokens,
                                     max_spec_factor, max_spec_offset,
                                     min_token_prob)
        return ({d.match_len for d in acc}, {d.score for d in acc},
                {d.tokens for d in acc},
                {(d.match_len, d.tokens): d.probs for d in acc})

    def speculate_unique(self, context: Sequence[int], max_spec_tokens: int,
                         max_spec_factor: float, max_spec_offset: float,
                         min_token_prob: float) -> RefDraft:
        """The draft, when it does not depend on tie order; else ValueError."""
        acc = self.acceptable_drafts(context, max_spec_tokens,
                                     max_spec_factor, max_spec_offset,
                                     min_token_prob)
        if len(acc) != 1:
            raise ValueError(f"tie-dependent result: {sorted(acc, key=str)}")
        return next(iter(acc))


# ---------------------------------------------------------------- checking
def _fmt(d: Any) -> str:
    return (f"match_len={d.match_len} tokens={list(d.tokens)} "
            f"probs={[round(p, 7) for p in d.probs]} score={d.score:.7g}")


def check_draft(reference: BruteForceSuffixIndex, draft: Any,
                context: Sequence[int], *, max_spec_tokens: int,
                max_spec_factor: float, max_spec_offset: float,
                min_token_prob: float, prob_tol: float = 1e-6,
                score_tol: float = 1e-5, exact: bool = False) -> RefDraft:
    """Assert that a C++ path-mode ``Draft`` is one the rule allows.

    ``draft`` needs ``token_ids``, ``parents``, ``probs``, ``score`` and
    ``match_len``.  Passes iff some ``RefDraft`` from
    ``reference.acceptable_drafts`` has the same ``match_len`` and tokens,
    probs within ``prob_tol``, score within ``score_tol`` (bit-exact float32
    equality if ``exact``), and ``parents == [-1, 0, ..., n-2]``.  Returns
    the matching ``RefDraft``; raises ``AssertionError`` otherwise.
    """
    tokens = tuple(int(t) for t in draft.token_ids)
    probs = tuple(float(p) for p in draft.probs)
    parents = tuple(int(p) for p in draft.parents)
    score = float(draft.score)
    match_len = int(draft.match_len)
    got = RefDraft(match_len, tokens, probs, score)
    params = dict(max_spec_tokens=max_spec_tokens,
                  max_spec_factor=max_spec_factor,
                  max_spec_offset=max_spec_offset,
                  min_token_prob=min_token_prob)
    acc = reference.acceptable_drafts(context, **params)

    def header() -> str:
        seqs = {k: list(v) for k, v in sorted(reference.seqs.items())}
        lines = [
            f"context={list(context)} params={params} "
            f"max_depth={reference.max_depth}",
            f"sequences={seqs}",
            f"C++ draft:  {_fmt(got)} parents={list(parents)}",
            "acceptable:",
        ]
        lines += ["  " + _fmt(d) for d in
                  sorted(acc, key=lambda d: (d.match_len, d.tokens))]
        return "\n".join(lines)

    assert len(probs) == len(tokens) == len(parents), (
        "token_ids/probs/parents lengths differ\n" + header())
    assert parents == tuple(range(-1, len(tokens) - 1)), (
        "path-mode parents must be [-1, 0, 1, ...]\n" + header())

    def close(a: float, b: float, tol: float) -> bool:
        return a == b if exact else math.isclose(a, b, rel_tol=0.0,
                                                 abs_tol=tol)

    same_len = [d for d in acc if d.match_len == match_len]
    assert same_len, "match_len not admissible\n" + header()
    same_tok = [d for d in same_len if d.tokens == tokens]
    assert same_tok, ("token_ids not admissible for this match_len\n"
                      + header())
    for d in same_tok:
        if (close(d.score, score, score_tol)
                and all(close(a, b, prob_tol)
                        for a, b in zip(d.probs, probs))):
            return d
    raise AssertionError("probs/score mismatch\n" + header())
