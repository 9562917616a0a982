"""Property tests: the C++ SuffixTree (path mode) against the brute force, for both trees the
index can run on: arctic-inference's own and the index's compiled copy with its longest-first
speculate (``war_openrlhf.speculation.suffix_tree``).

See ``tests/suffix_reference.py`` for the rule being checked.
"""

from __future__ import annotations

import os
import sys

import pytest

from arctic_inference.suffix_decoding._C import SuffixTree as ArcticTree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suffix_reference import (  # noqa: E402
    BruteForceSuffixIndex,
    RefDraft,
    check_draft,
    f32,
)

from war_openrlhf.speculation.suffix_tree import tree_class  # noqa: E402

TREES = {"arctic": ArcticTree, "war": tree_class("war")}
each_tree = pytest.mark.parametrize("kind", list(TREES))

TOKENS = st.integers(0, 3)
SEQ_IDS = st.integers(0, 3)
FACTORS = st.sampled_from([0.5, 1.0, 2.0])
OFFSETS = st.sampled_from([0.0, 1.0])
MIN_PROBS = st.sampled_from([0.0, 0.1, 0.3])


def spec_params(max_spec_tokens=8, max_spec_factor=1.0, max_spec_offset=0.0,
                min_token_prob=0.0):
    return dict(max_spec_tokens=max_spec_tokens,
                max_spec_factor=max_spec_factor,
                max_spec_offset=max_spec_offset,
                min_token_prob=min_token_prob)


def cpp_speculate(tree, context, p):
    return tree.speculate(list(context), p["max_spec_tokens"],
                          p["max_spec_factor"], p["max_spec_offset"],
                          p["min_token_prob"], False)


def build(max_depth, seqs, kind="arctic"):
    tree, ref = TREES[kind](max_depth), BruteForceSuffixIndex(max_depth)
    for seq_id, toks in seqs:
        tree.extend(seq_id, list(toks))
        ref.extend(seq_id, list(toks))
    return tree, ref


def naive_count(seqs, max_depth, pattern):
    """Independent formula: occurrences of pattern (if short enough)."""
    p = list(pattern)
    if len(p) > max_depth:
        return 0
    return sum(1 for s in seqs for i in range(len(s))
               if s[i:i + len(p)] == p)


# ------------------------------------------------------- hand-worked cases
def test_count_hand_worked():
    # Suffixes of [1,2,3,1,2,4]: [1,2,3,1,2,4] [2,3,1,2,4] [3,1,2,4]
    # [1,2,4] [2,4] [4].
    ref = BruteForceSuffixIndex(8)
    ref.extend(0, [1, 2, 3])
    ref.extend(0, [1, 2, 4])  # second chunk of the same sequence
    expected = {(): 6, (1,): 2, (1, 2): 2, (1, 2, 3): 1, (1, 2, 4): 1,
                (2,): 2, (2, 3): 1, (2, 4): 1, (3,): 1, (4,): 1, (5,): 0,
                (3, 1, 2, 4): 1, (1, 2, 3, 1, 2, 4): 1, (2, 4, 1): 0,
                (4, 1): 0}
    for pat, n in expected.items():
        assert ref.count(pat) == n, pat
    assert ref.children((1, 2)) == {3: 1, 4: 1}
    assert ref.children((4,)) == {}
    # Depth 3 truncates: suffixes [1,2,3] [2,3,1] [3,1,2] [1,2,4] [2,4] [4].
    ref3 = BruteForceSuffixIndex(3)
    ref3.extend(0, [1, 2, 3, 1, 2, 4])
    assert ref3.count((1, 2, 3)) == 1
    assert ref3.count((1, 2, 3, 1)) == 0
    assert ref3.count((2, 3, 1)) == 1
    assert ref3.count((1, 2)) == 2
    assert ref3.children((1, 2, 3)) == {}
    # Removal forgets the whole sequence; removing an unknown id is a no-op.
    ref.extend(1, [2, 4])
    assert ref.count((2, 4)) == 2
    ref.remove(0)
    ref.remove(7)
    assert ref.count((2, 4)) == 1 and ref.count((1,)) == 0
    assert ref.count(()) == 2


@each_tree
def test_example_unique_long_match(kind):
    # seq [1,2,3,1,2,4], context [2,3,1], cap = int(m*1 + 1):
    #  m=1 pattern [1]  (count 2): ->2 (2/2=1.0), [1,2] has children 3 and 4
    #      with count 1 each -> 0.5; cap 2 -> [2,3] or [2,4], score 1.5
    #  m=2 pattern [3,1] (count 1): ->2 (1.0) ->4 (1.0), then no child;
    #      cap 3 -> [2,4], score 2.0 >= 1.5 -> wins.
    tree, ref = build(8, [(0, [1, 2, 3, 1, 2, 4])], kind)
    p = spec_params(8, 1.0, 1.0, 0.0)
    acc = ref.acceptable_drafts([2, 3, 1], **p)
    assert acc == {RefDraft(2, (2, 4), (1.0, 1.0), 2.0)}
    d = cpp_speculate(tree, [2, 3, 1], p)
    assert (d.match_len, list(d.token_ids), list(d.probs), d.score) == \
        (2, [2, 4], [1.0, 1.0], 2.0)
    assert list(d.parents) == [-1, 0]
    check_draft(ref, d, [2, 3, 1], **p, exact=True)

    # context [0,1,2], cap = m: m=1 [2]: tie 3/4 -> [3] or [4], 0.5.
    # m=2 [1,2]: tie -> [3,1] (0.5, 0.5; [1,2,3]->[1] has ratio 1) score 1.0
    # or [4] score 0.5; either way m=2 wins (>= on the 0.5 tie).
    p = spec_params(8, 1.0, 0.0, 0.0)
    acc = ref.acceptable_drafts([0, 1, 2], **p)
    assert acc == {RefDraft(2, (3, 1), (0.5, 0.5), 1.0),
                   RefDraft(2, (4,), (0.5,), 0.5)}
    check_draft(ref, cpp_speculate(tree, [0, 1, 2], p), [0, 1, 2], **p)


@each_tree
def test_example_probabilities_and_min_prob(kind):
    # [1] occurs 3 times: children 2 (count 1) and 3 (count 2).
    tree, ref = build(8, [(0, [1, 2]), (1, [1, 3, 4]), (2, [1, 3, 4])], kind)
    two_thirds = f32(f32(2.0) / f32(3.0))
    p = spec_params(8, 2.0, 1.0, 0.0)  # cap = int(1*2 + 1) = 3
    want = RefDraft(1, (3, 4), (two_thirds, two_thirds),
                    f32(two_thirds + two_thirds))
    assert ref.acceptable_drafts([0, 1], **p) == {want}
    d = cpp_speculate(tree, [0, 1], p)
    assert list(d.token_ids) == [3, 4] and d.match_len == 1
    assert list(d.probs) == pytest.approx([2 / 3, 2 / 3], abs=1e-6)
    check_draft(ref, d, [0, 1], **p, exact=True)

    # min_token_prob above 2/3: the walk stops before the first token, the
    # empty draft (score 0) still wins over the initial one -> match_len 1.
    p = spec_params(8, 2.0, 1.0, 0.7)
    assert ref.acceptable_drafts([0, 1], **p) == {RefDraft(1, (), (), 0.0)}
    d = cpp_speculate(tree, [0, 1], p)
    assert (d.match_len, list(d.token_ids), d.score) == (1, [], 0.0)

    # After removing one [1,3,4]: tie 2 vs 3 at [1] -> [2] (0.5) or
    # [3,4] (0.5, 0.5).
    tree.remove(1)
    ref.remove(1)
    p = spec_params(8, 2.0, 1.0, 0.0)
    assert ref.acceptable_drafts([0, 1], **p) == {
        RefDraft(1, (2,), (0.5,), 0.5), RefDraft(1, (3, 4), (0.5, 0.5), 1.0)}
    check_draft(ref, cpp_speculate(tree, [0, 1], p), [0, 1], **p)


@each_tree
def test_example_depth_limit_and_loop_bounds(kind):
    # max_depth 2: suffixes [1,2] [2,3] [3,4] [4].
    tree, ref = build(2, [(0, [1, 2, 3, 4])], kind)
    p = spec_params(8, 1.0, 0.0, 0.0)
    # m=1 [2] -> [3] (1.0); m=2 [1,2] has no child at depth 2 -> empty,
    # score 0 < 1 -> m=1 kept.
    assert ref.acceptable_drafts([0, 1, 2], **p) == {
        RefDraft(1, (3,), (1.0,), 1.0)}
    check_draft(ref, cpp_speculate(tree, [0, 1, 2], p), [0, 1, 2], **p,
                exact=True)
    # [4] and [3,4] both give empty drafts; m=2 wins the 0 >= 0 tie; m=3
    # pattern [2,3,4] is longer than max_depth -> count 0 -> loop stops.
    p = spec_params(8, 2.0, 0.0, 0.0)
    assert ref.acceptable_drafts([1, 2, 3, 4], **p) == {
        RefDraft(2, (), (), 0.0)}
    d = cpp_speculate(tree, [1, 2, 3, 4], p)
    assert (d.match_len, list(d.token_ids), d.score) == (2, [], 0.0)
    # The whole context is never matched (match_len < len(context)).
    t2, r2 = build(8, [(0, [1, 2])], kind)
    assert r2.acceptable_drafts([1], **p) == {RefDraft(0, (), (), 0.0)}
    d = cpp_speculate(t2, [1], p)
    assert (d.match_len, list(d.token_ids)) == (0, [])
    # factor 0.5, offset 0: cap(m=1) = int(0.5 + 1e-6) = 0 -> empty draft
    # with match_len 1.
    p = spec_params(8, 0.5, 0.0, 0.0)
    assert r2.acceptable_drafts([0, 1], **p) == {RefDraft(1, (), (), 0.0)}
    d = cpp_speculate(t2, [0, 1], p)
    assert (d.match_len, list(d.token_ids)) == (1, [])


def test_max_tokens_arithmetic():
    mt = BruteForceSuffixIndex.max_tokens
    assert mt(1, 8, 0.5, 0.0) == 0
    assert mt(3, 8, 0.5, 0.0) == 1
    assert mt(3, 8, 0.5, 1.0) == 2
    assert mt(5, 3, 2.0, 1.0) == 3
    assert mt(3, 8, 0.1, 0.0) == 0  # f32(0.3) = 0.30000001...
    assert mt(10, 8, 0.1, 0.0) == 1  # f32(1.0000000149) + 1e-6
    assert mt(4, 8, -1.0, 0.0) == 0  # clamped at 0


@each_tree
def test_tie_order_changes_match_len(kind):
    """Tie order can change the per-length *score* and the winning length.

    [1] has children 2 and 4 with count 3 each (of 8); via 2 the walk goes
    on to 3 (score 0.375 + 0.375), via 4 it stops (score 0.375).  Pattern
    [7,1] (m=2) gives score 0.5.  So the answer is (1, [2,3]) or (2, [5|6])
    depending on which of the tied children the C++ tree keeps first, which
    depends on insertion history.
    """
    a, b, c1, c2 = [1, 2, 3], [1, 4], [7, 1, 5], [7, 1, 6]
    p = spec_params(8, 2.0, 0.0, 0.0)
    ctx = [0, 7, 1]
    seen = set()
    for order in ([a] * 3 + [b] * 3 + [c1, c2], [b] * 3 + [a] * 3 + [c1, c2]):
        tree, ref = build(8, list(enumerate(order)), kind)
        acc = ref.acceptable_drafts(ctx, **p)
        assert {d.match_len for d in acc} == {1, 2}
        got = check_draft(ref, cpp_speculate(tree, ctx, p), ctx, **p,
                          exact=True)
        seen.add(got.match_len)
    # Both outcomes are really produced by the C++ tree.
    assert seen == {1, 2}


@each_tree
def test_tie_decisions_shared_across_match_lengths(kind):
    """A tie decision at string S is shared by all match lengths reaching S.

    max_depth 4, sequences [1,2,0,0,1] and [2,0,0,2,0], context [3,2,0,0],
    cap = int(2m + 1).  Pattern [0] (m=1) walks 0 -> [0,0], where children
    1 and 2 tie; pattern [0,0] (m=2) starts at that same [0,0] tie.  Choosing
    2 there gives m=1 the draft [0,2,0] (score 0.8) but also gives m=2 the
    draft [2,0] (score 1.0), which wins.  So (1, [0,2,0]) is admissible per
    length in isolation but never as a final answer.
    """
    seqs = [(0, [1, 2, 0, 0, 1]), (1, [2, 0, 0, 2, 0])]
    ctx = [3, 2, 0, 0]
    p = spec_params(8, 2.0, 1.0, 0.0)
    ref = BruteForceSuffixIndex(4)
    for sid, s in seqs:
        ref.extend(sid, s)
    per = ref.per_match_len(ctx, **p)
    joint = ref.acceptable_drafts(ctx, **p)
    indep = set()
    for d1 in per[1]:
        for d2 in per[2]:
            best = RefDraft(0, (), (), 0.0)
            for m, d in ((1, d1), (2, d2)):
                if d.score >= best.score:
                    best = RefDraft(m, d.tokens, d.probs, d.score)
            indep.add(best)
    assert joint < indep
    assert {(d.match_len, d.tokens) for d in indep - joint} == {(1, (0, 2, 0))}
    assert {(d.match_len, d.tokens) for d in joint} == {(1, (0, 1)),
                                                        (2, (2, 0))}
    # Every C++ history we build is admitted, for a few contexts/params.
    for order in (seqs, seqs[::-1]):
        tree, r = build(4, order, kind)
        for c in (ctx, [0, 0], [1, 0, 0], [3, 0]):
            for fac in (0.5, 1.0, 2.0):
                pp = spec_params(8, fac, 1.0, 0.0)
                check_draft(r, cpp_speculate(tree, c, pp), c, **pp,
                            exact=True)


def test_check_draft_rejects_wrong_answers():
    tree, ref = build(8, [(0, [1, 2, 3, 1, 2, 4])])
    p = spec_params(8, 1.0, 1.0, 0.0)
    good = cpp_speculate(tree, [2, 3, 1], p)

    class Fake:
        def __init__(self, **kw):
            self.token_ids = list(good.token_ids)
            self.parents = list(good.parents)
            self.probs = list(good.probs)
            self.score = good.score
            self.match_len = good.match_len
            self.__dict__.update(kw)

    check_draft(ref, Fake(), [2, 3, 1], **p)
    for bad in (Fake(match_len=1), Fake(token_ids=[2, 3]),
                Fake(probs=[1.0, 0.5]), Fake(score=1.9),
                Fake(parents=[-1, -1])):
        with pytest.raises(AssertionError):
            check_draft(ref, bad, [2, 3, 1], **p)


# ------------------------------------------------------- property tests
@st.composite
def contexts(draw, seqs):
    live = [s for s in seqs.values() if s]
    if live and draw(st.booleans()):
        s = draw(st.sampled_from(live))
        i = draw(st.integers(0, len(s) - 1))
        j = draw(st.integers(i + 1, min(len(s), i + 10)))
        pre = draw(st.lists(TOKENS, max_size=3))
        post = draw(st.lists(TOKENS, max_size=1))
        return pre + s[i:j] + post
    return draw(st.lists(TOKENS, max_size=12))


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(max_depth=st.integers(1, 8), data=st.data())
@each_tree
def test_cpp_tree_matches_reference(kind, max_depth, data):
    tree = TREES[kind](max_depth)
    ref = BruteForceSuffixIndex(max_depth)
    n_ops = data.draw(st.integers(1, 14), label="n_ops")
    for _ in range(n_ops):
        op = data.draw(st.sampled_from(
            ["extend", "extend", "extend", "remove", "speculate",
             "speculate", "speculate"]), label="op")
        if op == "extend":
            sid = data.draw(SEQ_IDS, label="seq_id")
            toks = data.draw(st.lists(TOKENS, max_size=30), label="tokens")
            tree.extend(sid, toks)
            ref.extend(sid, toks)
        elif op == "remove":
            sid = data.draw(SEQ_IDS, label="remove_id")  # may be unknown
            tree.remove(sid)
            ref.remove(sid)
        else:
            ctx = data.draw(contexts(ref.seqs), label="context")
            p = spec_params(
                data.draw(st.integers(1, 8), label="max_spec_tokens"),
                data.draw(FACTORS, label="factor"),
                data.draw(OFFSETS, label="offset"),
                data.draw(MIN_PROBS, label="min_prob"))
            check_draft(ref, cpp_speculate(tree, ctx, p), ctx, **p,
                        exact=True)
        assert tree.num_seqs() == ref.num_seqs()
        # check_integrity() indexes _seqs[0 .. size-1] with operator[], which
        # inserts missing ids; only call it when the ids are 0..n-1.
        if set(ref.seqs) == set(range(len(ref.seqs))):
            assert tree.check_integrity() == ""
    # Final sweep: every suffix-derived context of every live sequence.
    for s in list(ref.seqs.values()):
        for i in range(len(s)):
            ctx = [0] + s[max(0, i - max_depth):i + 1]
            p = spec_params(8, 2.0, 1.0, 0.0)
            check_draft(ref, cpp_speculate(tree, ctx, p), ctx, **p,
                        exact=True)


@settings(max_examples=150, deadline=None)
@given(max_depth=st.integers(1, 8),
       seqs=st.lists(st.lists(TOKENS, max_size=30), max_size=4),
       pattern=st.lists(TOKENS, max_size=9))
def test_count_matches_naive_occurrences(max_depth, seqs, pattern):
    ref = BruteForceSuffixIndex(max_depth)
    for i, s in enumerate(seqs):
        # extend in two chunks to exercise appending to an existing sequence
        ref.extend(i, s[:len(s) // 2])
        ref.extend(i, s[len(s) // 2:])
    assert ref.count(pattern) == naive_count(seqs, max_depth, pattern)
    kids = ref.children(pattern)
    for t in range(4):
        assert kids.get(t, 0) == naive_count(seqs, max_depth, pattern + [t])
