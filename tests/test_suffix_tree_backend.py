"""The index's compiled suffix tree drafts exactly what arctic-inference's tree drafts.

The reference is arctic-inference's own compiled ``_C.SuffixTree`` (the tree vLLM's
``suffix`` method uses), fed the same operations: random sequences over a small vocabulary
(so matches are long and ambiguous), extended in chunks, some removed; contexts cut from
the stored text (long matches) or random (short ones); random draft rules.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from arctic_inference.suffix_decoding._C import SuffixTree as ArcticTree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from war_openrlhf.speculation.suffix_tree import default_backend, tree_class

WarTree = tree_class("war")
ROOT = Path(__file__).resolve().parents[1]


def test_the_index_uses_the_compiled_tree_unless_told_otherwise():
    if os.environ.get("WAR_SUFFIX_TREE", "war") == "war":
        assert default_backend() == "war"
        assert tree_class() is WarTree
        assert WarTree.__module__ == "_war_suffix_tree"
        assert hasattr(WarTree, "speculate_reference_ndarray")


def draft_tuple(d):
    return (list(d.token_ids), list(d.parents), [float(p) for p in d.probs], float(d.score), int(d.match_len))


@st.composite
def tree_ops(draw):
    depth = draw(st.integers(2, 24))
    vocab = draw(st.integers(1, 6))
    n_seqs = draw(st.integers(1, 5))
    seqs = [draw(st.lists(st.integers(0, vocab - 1), min_size=0, max_size=60)) for _ in range(n_seqs)]
    chunks = [draw(st.integers(1, 7)) for _ in range(n_seqs)]
    removed = draw(st.lists(st.integers(0, n_seqs - 1), max_size=2, unique=True))
    return depth, vocab, seqs, chunks, removed


def build(tree_cls, depth, seqs, chunks, removed):
    tree = tree_cls(depth)
    for seq_id, (seq, chunk) in enumerate(zip(seqs, chunks)):
        for start in range(0, len(seq), chunk):
            tree.extend_ndarray(seq_id, np.asarray(seq[start : start + chunk], dtype=np.int32))
    for seq_id in removed:
        if seqs[seq_id]:
            tree.remove(seq_id)
    return tree


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=tree_ops(), data=st.data())
def test_longest_first_speculate_equals_arctics_speculate(ops, data):
    depth, vocab, seqs, chunks, removed = ops
    ours, arctic = build(WarTree, depth, seqs, chunks, removed), build(ArcticTree, depth, seqs, chunks, removed)
    assert ours.check_integrity() == ""
    text = [t for s in seqs for t in s] or [0]
    for _ in range(8):
        if data.draw(st.booleans()):  # a context ending inside stored text: long matches
            end = data.draw(st.integers(1, len(text)))
            length = data.draw(st.integers(0, min(end, depth + 2)))
            ctx = text[end - length : end]
        else:
            ctx = data.draw(st.lists(st.integers(0, vocab), max_size=depth + 2))
        ctx = np.asarray(ctx, dtype=np.int32)
        k = data.draw(st.integers(0, 12))
        factor = data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
        offset = data.draw(st.sampled_from([0.0, 1.0, 3.0]))
        min_prob = data.draw(st.sampled_from([0.0, 0.1, 0.3, 0.6, 1.0]))
        args = (ctx, k, factor, offset, min_prob, False)
        expected = draft_tuple(arctic.speculate_ndarray(*args))
        assert draft_tuple(ours.speculate_ndarray(*args)) == expected, (ctx.tolist(), k, factor, offset, min_prob)
        assert draft_tuple(ours.speculate_reference_ndarray(*args)) == expected
        assert draft_tuple(ours.speculate(ctx.tolist(), k, factor, offset, min_prob, False)) == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=tree_ops(), data=st.data())
def test_incremental_calls_equal_arctics_speculate_along_a_decode(ops, data):
    """Calls with a handle (what the index does per request) along a decode: the context
    advances by a few tokens per call, sometimes jumps elsewhere, sometimes shrinks or grows
    its window; between calls the tree sometimes gains or loses a sequence. Every draft
    equals arctic's, and a handle never outlives ``forget_handle``."""
    depth, vocab, seqs, chunks, removed = ops
    ours, arctic = build(WarTree, depth, seqs, chunks, removed), build(ArcticTree, depth, seqs, chunks, removed)
    text = [t for s in seqs for t in s] + data.draw(st.lists(st.integers(0, vocab), max_size=30))
    if not text:
        text = [0]
    handles = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True))
    pos = {h: data.draw(st.integers(0, len(text))) for h in handles}
    next_seq = len(seqs)
    for _ in range(data.draw(st.integers(1, 25))):
        h = data.draw(st.sampled_from(handles))
        move = data.draw(st.sampled_from(["advance", "advance", "advance", "stay", "jump", "mutate"]))
        if move == "advance":
            pos[h] = min(len(text), pos[h] + data.draw(st.integers(1, 5)))
        elif move == "jump":
            pos[h] = data.draw(st.integers(0, len(text)))
        elif move == "mutate":
            if data.draw(st.booleans()):
                if data.draw(st.booleans()):  # the text around a context: a new, longer continuation
                    at = pos[data.draw(st.sampled_from(handles))]
                    new = text[max(0, at - data.draw(st.integers(1, depth))) : at + 3] or [0]
                else:
                    new = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12))
                for t in (ours, arctic):
                    t.extend_ndarray(next_seq, np.asarray(new, dtype=np.int32))
                next_seq += 1
            elif seqs[0]:
                for t in (ours, arctic):
                    if 0 not in removed:
                        t.remove(0)
                removed = removed + [0]
        window = data.draw(st.integers(0, depth + 2))
        ctx = np.asarray(text[max(0, pos[h] - window) : pos[h]], dtype=np.int32)
        k = data.draw(st.integers(1, 12))
        min_prob = data.draw(st.sampled_from([0.0, 0.1, 0.3]))
        factor = data.draw(st.sampled_from([0.5, 1.0, 2.0]))
        got = ours.speculate_handle_ndarray(ctx, k, factor, 0.0, min_prob, h)
        assert draft_tuple(got) == draft_tuple(arctic.speculate_ndarray(ctx, k, factor, 0.0, min_prob, False))
        assert got.next_len == ours.speculate_ndarray(ctx, k, factor, 0.0, min_prob, False).next_len
    for h in handles:
        ours.forget_handle(h)
    assert ours.num_handles() == 0


def test_a_handle_learns_nothing_stale_from_a_changed_tree():
    """A handle's bound holds only for the tree it was learned on: after a sequence arrives
    that continues a longer suffix of the same context, the longer match drafts."""
    ctx = np.array([7, 5, 2, 3], dtype=np.int32)
    ours, arctic = WarTree(8), ArcticTree(8)
    for t in (ours, arctic):
        t.extend_ndarray(0, np.array([1, 2, 3, 9], dtype=np.int32))
    first = ours.speculate_handle_ndarray(ctx, 3, 1.0, 0.0, 0.0, 1)
    assert first.next_len == 2 and ours.num_handles() == 1  # [5, 2, 3] does not occur: a bound is kept
    for t in (ours, arctic):
        t.extend_ndarray(1, np.array([5, 2, 3, 4, 4, 4], dtype=np.int32))
    again = ours.speculate_handle_ndarray(ctx, 3, 1.0, 0.0, 0.0, 1)
    assert draft_tuple(again) == draft_tuple(arctic.speculate_ndarray(ctx, 3, 1.0, 0.0, 0.0, False))
    assert again.token_ids == [4, 4, 4] and again.match_len == 3


def test_a_handle_spares_walks_along_a_match():
    """A request decodes along stored text behind a context the tree never saw, so its
    longest continued match grows by one token a call and stays below the window. With a
    handle each call probes the bound its last call proved (and the length above it); without
    one it bisects. Counted in walks from the root (the tree's ``walks()``), not timed; the
    drafts are the same either way."""
    rng = np.random.default_rng(5)
    seq = rng.integers(100, 200, size=300, dtype=np.int32)
    junk = np.arange(1000, 1017, dtype=np.int32)  # never stored: every match stops at it
    plain, incremental = WarTree(32), WarTree(32)
    for t in (plain, incremental):
        t.extend_ndarray(0, seq)
    spent = {}
    for tree, handle in ((plain, None), (incremental, 9)):
        before = tree.walks()
        drafts = []
        for k in range(1, 14):
            ctx = np.ascontiguousarray(np.concatenate([junk, seq[50 : 50 + k]])[-17:])
            d = (tree.speculate_ndarray(ctx, 4, 1.0, 0.0, 0.0, False) if handle is None
                 else tree.speculate_handle_ndarray(ctx, 4, 1.0, 0.0, 0.0, handle))
            assert d.next_len == k
            drafts.append(draft_tuple(d))
        spent[handle] = (tree.walks() - before, drafts)
    assert spent[9][1] == spent[None][1]
    assert spent[9][0] <= 2 * 13 + 2  # the bound, then the length above it (the first call bisects)
    assert spent[9][0] < spent[None][0]
    # the handle's knowledge is tied to the tree as it was: a change is counted
    before = incremental.mutations()
    incremental.extend_ndarray(1, np.array([1, 2], dtype=np.int32))
    assert incremental.mutations() == before + 2
    with pytest.raises(ValueError, match="handle"):
        incremental.speculate_handle_ndarray(np.ascontiguousarray(seq[:5]), 4, 1.0, 0.0, 0.0, -1)


def test_equal_on_real_token_text_at_the_index_depth():
    """Long natural text (a real tokenizer's ids would do; here a seeded Zipf stream with
    repeats, as agent turns repeat tool schemas) at depth 32: every suffix of every prefix."""
    rng = np.random.default_rng(7)
    base = rng.zipf(1.3, size=400).clip(max=500).astype(np.int32)
    seq = np.concatenate([base, base[50:250], rng.integers(0, 500, 100, dtype=np.int32), base[100:300]])
    ours, arctic = WarTree(32), ArcticTree(32)
    for t in (ours, arctic):
        t.extend_ndarray(0, seq[:600])
        t.extend_ndarray(1, seq[600:])
    checked = 0
    for end in range(2, seq.size, 3):
        ctx = np.ascontiguousarray(seq[max(0, end - 17) : end])
        for k, min_prob in ((16, 0.1), (4, 0.0)):
            args = (ctx, k, 1.0, 0.0, min_prob, False)
            assert draft_tuple(ours.speculate_ndarray(*args)) == draft_tuple(arctic.speculate_ndarray(*args))
            checked += 1
    assert checked > 500


def test_tree_speculation_still_goes_to_arctics_loop():
    ours, arctic = WarTree(8), ArcticTree(8)
    for t in (ours, arctic):
        t.extend_ndarray(0, np.array([1, 2, 3, 1, 2, 4, 1, 2, 3], dtype=np.int32))
    ctx = np.array([5, 1, 2], dtype=np.int32)
    assert draft_tuple(ours.speculate_ndarray(ctx, 4, 1.0, 0.0, 0.0, True)) == draft_tuple(
        arctic.speculate_ndarray(ctx, 4, 1.0, 0.0, 0.0, True))


def test_a_wrong_array_is_refused_not_cast():
    tree = WarTree(8)
    with pytest.raises(TypeError):
        tree.extend_ndarray(0, np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="1-D"):
        tree.speculate_ndarray(np.zeros((2, 2), dtype=np.int32), 4, 1.0, 0.0, 0.1, False)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=240)


def test_backend_choice_by_environment(tmp_path):
    code = "from war_openrlhf.speculation import suffix_tree as s; print(s.default_backend(), s.tree_class().__module__)"
    arctic = _run(code, WAR_SUFFIX_TREE="arctic")
    assert arctic.returncode == 0, arctic.stderr
    assert arctic.stdout.split() == ["arctic", "arctic_inference.suffix_decoding._C"]
    bad = _run(code, WAR_SUFFIX_TREE="fast")
    assert bad.returncode != 0 and "WAR_SUFFIX_TREE" in bad.stderr and "'fast'" in bad.stderr
    # a compiler that cannot run: the error names it and the way out, nothing falls back silently
    broken = _run(code, CXX=str(tmp_path / "no-such-compiler"), WAR_EXTENSION_DIR=str(tmp_path / "ext"))
    assert broken.returncode != 0
    assert "no-such-compiler" in broken.stderr and "WAR_SUFFIX_TREE=arctic" in broken.stderr


def test_an_index_configured_for_arctics_tree_needs_no_compiler(tmp_path):
    """``SuffixIndexConfig.suffix_tree: arctic`` is the way out on a node without a compiler:
    importing the package and building such an index compiles nothing."""
    code = ("import numpy as np; from war_openrlhf.speculation import GlobalSuffixIndex, SuffixIndexConfig; "
            "ix = GlobalSuffixIndex(SuffixIndexConfig(suffix_tree='arctic')); "
            "ix.start_request('r', np.array([1, 2, 3, 1, 2], dtype=np.int32)); "
            "print(ix.speculate('r', np.array([1, 2], dtype=np.int32), 2).token_ids)")
    ext = tmp_path / "ext"
    done = _run(code, CXX=str(tmp_path / "no-such-compiler"), WAR_EXTENSION_DIR=str(ext), WAR_SUFFIX_TREE="war")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[3]"  # a match of one token drafts one (factor 1)
    assert not ext.exists()
    with pytest.raises(ValueError, match="suffix_tree"):
        from war_openrlhf.speculation import SuffixIndexConfig

        SuffixIndexConfig(suffix_tree="fast")


def test_a_fresh_extension_directory_builds_and_caches(tmp_path):
    code = ("from war_openrlhf.speculation import suffix_tree as s; import numpy as np; t = s.tree_class()(4); "
            "t.extend_ndarray(0, np.array([1, 2, 1, 3], dtype=np.int32)); "
            "print(t.speculate_ndarray(np.array([0, 1], dtype=np.int32), 2, 1.0, 0.0, 0.0, False).token_ids)")
    ext = tmp_path / "ext"
    first = _run(code, WAR_EXTENSION_DIR=str(ext), WAR_SUFFIX_TREE="war")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "[2]"
    built = sorted(p.name for p in ext.iterdir())
    assert len(built) == 1 and built[0].startswith("_war_suffix_tree-")  # no temporary file left
    again = _run(code, WAR_EXTENSION_DIR=str(ext), WAR_SUFFIX_TREE="war")
    assert again.returncode == 0 and sorted(p.name for p in ext.iterdir()) == built


def test_an_index_on_either_tree_drafts_the_same_along_decodes():
    """Two replicas, one per tree, fed the same log; requests decode along text that repeats
    stored records (drafts get accepted, contexts advance by accepted + 1) while more records
    arrive between steps (the global tree changes under the requests' handles)."""
    from war_openrlhf.speculation import CompletedSequence, CompletedSequenceLog, GlobalSuffixIndex, SuffixIndexConfig

    rng = np.random.default_rng(3)
    phrases = [rng.integers(0, 40, size=int(rng.integers(5, 30)), dtype=np.int32) for _ in range(12)]

    def text(n):
        return np.concatenate([phrases[int(i)] for i in rng.integers(0, len(phrases), size=n)])

    log = CompletedSequenceLog()
    log.append_many([CompletedSequence.create(f"t{i}", f"g{i % 3}", 0, text(2), text(6)) for i in range(20)])
    war, arctic = (GlobalSuffixIndex(SuffixIndexConfig(suffix_tree=b)) for b in ("war", "arctic"))
    assert war._incremental and not arctic._incremental
    for ix in (war, arctic):
        ix.sync(log)
    compared = 0
    for r in range(20):
        prompt, resp = text(3), text(5)
        for ix in (war, arctic):
            ix.start_request(f"r{r}", prompt, f"g{r % 3}", f"traj{r}")
        pos = 1
        for ix in (war, arctic):
            ix.extend_request(f"r{r}", resp[:pos])
        while pos < resp.size:
            ctx = np.concatenate([prompt, resp[:pos]])
            d_war, d_arctic = (ix.speculate(f"r{r}", ctx, 8) for ix in (war, arctic))
            assert (d_war.token_ids, d_war.probs, d_war.score, d_war.match_len, d_war.source) == \
                (d_arctic.token_ids, d_arctic.probs, d_arctic.score, d_arctic.match_len, d_arctic.source)
            compared += 1
            accepted = 0
            while accepted < len(d_war.token_ids) and pos + accepted < resp.size \
                    and d_war.token_ids[accepted] == resp[pos + accepted]:
                accepted += 1
            step = min(accepted + 1, resp.size - pos)
            for ix in (war, arctic):
                ix.extend_request(f"r{r}", resp[pos : pos + step])
            pos += step
            for ix in (war, arctic):  # the live tree's count kept in Python is the tree's own
                assert ix._local.live_seqs == ix._local.live.num_seqs()
            if rng.random() < 0.1:  # a record arrives mid-decode
                log.append_many([CompletedSequence.create(f"late{r}_{pos}", "g0", 0, text(1), text(3))])
                for ix in (war, arctic):
                    ix.sync(log)
        for ix in (war, arctic):
            ix.stop_request(f"r{r}")
    assert compared > 200
    assert war._replica.global_tree.num_handles() == 0  # every finished request's handle forgotten


def test_a_request_trees_handle_is_forgotten_when_the_request_stops():
    from war_openrlhf.speculation import GlobalSuffixIndex, SuffixIndexConfig

    ix = GlobalSuffixIndex(SuffixIndexConfig(suffix_tree="war"))
    prompt = np.array([1, 2, 3, 4, 1, 2, 3, 5, 1, 2], dtype=np.int32)
    ix.start_request("a", prompt, "g", "traj")
    ix.speculate("a", prompt, 4)
    tree = ix._local.trajectories["traj:traj"].tree
    assert tree.num_handles() == 1
    ix.stop_request("a")  # the trajectory's tree lives on for its next turn; the handle does not
    assert tree.num_handles() == 0
