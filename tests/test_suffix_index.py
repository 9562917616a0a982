"""The global suffix index against a brute-force reference, plus replication,
eviction, persistence and bad-input behaviour."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from suffix_reference import BruteForceSuffixIndex, f32
from war_openrlhf.speculation import (
    CompletedSequence,
    CompletedSequenceLog,
    GlobalSuffixIndex,
    LogTruncatedError,
    SuffixIndexConfig,
)

tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)


def _candidates_reference(index: GlobalSuffixIndex, request_tokens, group_records, live_seqs, records, group_bias):
    """Brute-force indexes for each draft source, in the index's order, with weights."""
    depth = index.config.max_tree_depth
    out = []
    for name, seqs, weight in (
        ("request", [request_tokens], 1.0),
        ("group", group_records, group_bias),
        ("live", live_seqs, 1.0),
        ("global", records, 1.0),
    ):
        ref = BruteForceSuffixIndex(depth)
        for i, s in enumerate(seqs):
            if len(s):
                ref.extend(i, s)
        out.append((name, ref, weight))
    return out


def _check_selection(draft, candidates, context, max_tokens, cfg):
    """The index's draft must be what 'highest weighted score, earlier source on
    ties' picks for *some* admissible tie order of every tree."""
    kw = dict(max_spec_tokens=max_tokens, max_spec_factor=cfg.max_spec_factor,
              max_spec_offset=cfg.max_spec_offset, min_token_prob=cfg.min_token_prob)
    acceptable = [(name, ref.acceptable_drafts(context, **kw), w) for name, ref, w in candidates]
    chosen = tuple(draft.token_ids)
    if not chosen:
        # every source must admit an empty draft (score 0)
        for name, acc, _ in acceptable:
            assert any(d.score == 0.0 for d in acc), f"{name} admits only non-empty drafts {acc}"
        return
    names = [a[0] for a in acceptable]
    assert draft.source in names, draft
    k = names.index(draft.source)
    mine = [d for d in acceptable[k][1] if d.tokens == chosen and d.match_len == draft.match_len]
    assert mine, f"{draft.source} draft {draft} not admissible: {acceptable[k][1]}"
    ref_d = mine[0]
    assert abs(ref_d.score - draft.score) < 1e-5
    assert np.allclose(ref_d.probs, draft.probs, atol=1e-6)
    score = f32(ref_d.score * acceptable[k][2])
    for j, (name, acc, w) in enumerate(acceptable):
        if j < k:  # earlier sources must be able to lose strictly
            assert any(f32(d.score * w) < score for d in acc), f"{name} should have won: {acc} vs {draft}"
        elif j > k:  # later sources must be able not to beat it
            assert any(f32(d.score * w) <= score for d in acc), f"{name} should have won: {acc} vs {draft}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    depth=st.integers(2, 8),
    lead_in=st.integers(0, 3),
    factor=st.sampled_from([1.0, 2.0]),
    offset=st.sampled_from([0.0, 1.0]),
    min_prob=st.sampled_from([0.0, 0.1, 0.3]),
    group_trees=st.booleans(),
    group_bias=st.sampled_from([1.0, 2.0]),
    records=st.lists(st.tuples(st.sampled_from(["g0", "g1"]), tokens, tokens), max_size=6),
    prompt=tokens,
    generated=st.lists(st.integers(0, 3), max_size=6),
    sibling=st.lists(st.integers(0, 3), max_size=8),
    ctx_extra=st.lists(st.integers(0, 3), max_size=4),
    max_tokens=st.integers(1, 8),
)
def test_drafts_match_brute_force_reference(depth, lead_in, factor, offset, min_prob, group_trees, group_bias,
                                            records, prompt, generated, sibling, ctx_extra, max_tokens):
    cfg = SuffixIndexConfig(max_tree_depth=depth, prompt_lead_in=lead_in, max_spec_factor=factor,
                            max_spec_offset=offset, min_token_prob=min_prob, group_trees=group_trees,
                            group_bias=group_bias)
    log = CompletedSequenceLog()
    inserted, by_group = [], {"g0": [], "g1": []}
    for i, (g, p, r) in enumerate(records):
        log.append(CompletedSequence.create(f"t{i}", g, 0, p, r))
        ins = (p[-lead_in:] if lead_in else []) + r
        inserted.append(ins)
        by_group[g].append(ins)
    index = GlobalSuffixIndex(cfg)
    index.sync(log)
    index.start_request("sib", [0], group_id="g1")
    index.extend_request("sib", sibling)
    index.start_request("me", prompt, group_id="g0", trajectory_id="traj")
    index.extend_request("me", generated)
    window = max(2, depth - max_tokens + 1)  # default match_window
    context = (prompt + generated + ctx_extra)[-window:]
    draft = index.speculate("me", prompt + generated + ctx_extra, max_tokens)
    cands = _candidates_reference(
        index, prompt + generated, by_group["g0"] if group_trees else [],
        # the live tree counts only when it holds another request's tokens (its own are in its tree)
        [s for s in (sibling, generated) if s] if sibling else [], inserted, group_bias,
    )
    _check_selection(draft, cands, context, max_tokens, cfg)


def _fill(log: CompletedSequenceLog, rng: np.random.Generator, n: int, version: int = 0, vocab: int = 5):
    for i in range(n):
        p = rng.integers(0, vocab, size=rng.integers(1, 20)).tolist()
        r = rng.integers(0, vocab, size=rng.integers(1, 40)).tolist()
        log.append(CompletedSequence.create(f"traj{log.last_seq}", f"g{i % 3}", version, p, r))


def _drafts(index: GlobalSuffixIndex, contexts, max_tokens=8):
    out = []
    for i, ctx in enumerate(contexts):
        rid = f"probe{i}"
        index.start_request(rid, ctx[:3])
        d = index.speculate(rid, ctx, max_tokens)
        index.stop_request(rid)
        out.append((tuple(d.token_ids), d.match_len, round(d.score, 6), d.source))
    return out


def _three_versions_and_two_replicas(rng, budget, lag, group_trees):
    """A log of 24 records over three policy versions, and two empty replicas of one config."""
    log = CompletedSequenceLog()
    for v in range(3):
        _fill(log, rng, 8, version=v)
        log.advance_policy_version(v + 1)
    cfg = SuffixIndexConfig(max_tree_depth=6, token_budget=budget, max_policy_lag=lag, group_trees=group_trees)
    return log, GlobalSuffixIndex(cfg), GlobalSuffixIndex(cfg)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), chunks=st.lists(st.integers(1, 7), min_size=1, max_size=8),
       budget=st.integers(40, 400), lag=st.sampled_from([None, 0, 1]), group_trees=st.booleans())
def test_replicas_converge_whatever_the_batching(seed, chunks, budget, lag, group_trees):
    rng = np.random.default_rng(seed)
    log, a, b = _three_versions_and_two_replicas(rng, budget, lag, group_trees)
    a.sync(log)
    i = 0
    while b.applied_seq < log.last_seq:  # b catches up in uneven chunks
        b.sync(log, limit=chunks[i % len(chunks)])
        i += 1
    assert a.applied_seq == b.applied_seq == log.last_seq
    assert a.stats()["records"] == b.stats()["records"]
    contexts = [rng.integers(0, 5, size=10).tolist() for _ in range(40)]
    assert _drafts(a, contexts) == _drafts(b, contexts)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), chunk=st.integers(1, 9), budget=st.integers(40, 400),
       lag=st.sampled_from([None, 0, 1]), group_trees=st.booleans(), probe_every=st.integers(1, 5))
def test_sliced_application_ends_in_the_state_of_applying_at_once(seed, chunk, budget, lag, group_trees, probe_every):
    """An engine applies the log in bounded slices between steps (records in chunks, an
    eviction's rebuild as a shadow tree): every slice is bounded, drafting works between
    slices, and once drained the replica is exactly the one that applied everything at once."""
    rng = np.random.default_rng(seed)
    log, a, b = _three_versions_and_two_replicas(rng, budget, lag, group_trees)
    b._replica.chunk = chunk
    a.sync(log)
    assert b.enqueue(log.read(0)) == log.last_seq
    assert b.applied_seq == 0 and b.pending_entries == log.last_seq
    contexts = [rng.integers(0, 5, size=10).tolist() for _ in range(40)]
    slices = 0
    while b.has_pending_work:
        done = b.work(0.0)  # the smallest slice: one chunk
        assert done["tokens"] <= chunk
        slices += 1
        if slices % probe_every == 0:
            _drafts(b, contexts[:3])  # drafting mid-application works
    assert slices >= log.last_seq  # one entry per slice at most (with chunk-sized records, more)
    assert b.applied_seq == a.applied_seq == log.last_seq and b._replica.rebuilding is None
    assert {k: v for k, v in b.stats().items() if "seconds" not in k} == {
        k: v for k, v in a.stats().items() if "seconds" not in k}
    assert _drafts(a, contexts) == _drafts(b, contexts)
    # already-queued entries are skipped; a gap is refused and queues nothing
    assert b.enqueue(log.read(0)) == 0
    extra = CompletedSequenceLog()
    _fill(extra, rng, log.last_seq + 3)
    with pytest.raises(ValueError, match="seq: expected entry"):
        b.enqueue(extra.read(log.last_seq + 1))
    assert b.pending_entries == 0


def test_sibling_turn_finished_on_engine_a_drafts_on_engine_b():
    log = CompletedSequenceLog()
    engine_a, engine_b = GlobalSuffixIndex(), GlobalSuffixIndex()
    prompt = list(range(100, 140))
    answer = list(range(500, 540))
    engine_a.start_request("s1/turn0", prompt, group_id="task7", trajectory_id="s1")
    engine_b.start_request("s7/turn0", prompt, group_id="task7", trajectory_id="s7")
    before = engine_b.speculate("s7/turn0", prompt + answer[:4], 16)
    assert before.token_ids == []
    engine_a.extend_request("s1/turn0", answer)
    engine_a.stop_request("s1/turn0")
    log.append(CompletedSequence.create("s1", "task7", 0, prompt, answer))
    engine_b.sync(log)
    after = engine_b.speculate("s7/turn0", prompt + answer[:4], 16)
    assert after.source == "global"
    # the record's prompt lead-in extends the match past the 4 answer tokens: a full draft
    assert after.token_ids == answer[4:20]


def test_lead_in_lets_the_first_response_token_be_drafted():
    prompt, answer = [7, 8, 9, 1, 2, 3], [40, 41, 42, 43]
    for lead_in, expect in ((0, []), (3, answer[:4])):
        log = CompletedSequenceLog()
        log.append(CompletedSequence.create("a", "g", 0, prompt, answer))
        index = GlobalSuffixIndex(prompt_lead_in=lead_in, max_spec_factor=2.0)
        index.sync(log)
        index.start_request("b", [5, 5, 1, 2, 3])
        assert index.speculate("b", [5, 5, 1, 2, 3], 4).token_ids == expect


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(30, 300), frac=st.sampled_from([0.5, 0.75, 1.0]))
def test_eviction_keeps_the_budget_and_drops_oldest_first(seed, budget, frac):
    rng = np.random.default_rng(seed)
    log = CompletedSequenceLog()
    index = GlobalSuffixIndex(max_tree_depth=6, token_budget=budget, evict_to_fraction=frac, prompt_lead_in=0)
    seen = []
    for _ in range(30):
        _fill(log, rng, 1)
        seen.append(log.last_seq)
        index.sync(log)
        assert index.indexed_tokens <= budget
        held = list(index._replica.records)  # survivors are the newest records, in order
        assert held == seen[len(seen) - len(held):]
    assert index.stats()["records_evicted"] > 0
    # memory tracks the budget, not the history
    small = GlobalSuffixIndex(max_tree_depth=6)
    small.sync(log)
    assert index.memory_bytes() < small.memory_bytes()


def test_evicted_records_no_longer_draft():
    log = CompletedSequenceLog()
    old = list(range(10, 40))
    log.append(CompletedSequence.create("old", "g", 0, [1], old))
    index = GlobalSuffixIndex(token_budget=60, prompt_lead_in=0, max_spec_factor=2.0)
    index.sync(log)
    index.start_request("q", [0])
    assert index.speculate("q", old[:5], 8).token_ids == old[5:13]
    log.append(CompletedSequence.create("new", "g", 0, [1], list(range(100, 140))))
    index.sync(log)
    assert index.speculate("q", old[:5], 8).token_ids == []
    assert index.num_records == 1


def test_policy_lag_drops_old_versions():
    log = CompletedSequenceLog()
    log.append(CompletedSequence.create("a", "g", 0, [1], [20, 21, 22, 23, 24]))
    index = GlobalSuffixIndex(max_policy_lag=1, prompt_lead_in=0)
    index.sync(log)
    log.advance_policy_version(1)
    index.sync(log)
    assert index.num_records == 1  # version 0 is within lag 1 of version 1
    log.advance_policy_version(2)
    index.sync(log)
    assert index.num_records == 0
    log.append(CompletedSequence.create("late", "g", 0, [1], [5, 6]))  # stale on arrival
    index.sync(log)
    assert index.num_records == 0 and index.stats()["records_stale_dropped"] == 2


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(50, 2000), group_trees=st.booleans())
def test_save_load_round_trip_gives_identical_drafts(tmp_path_factory, seed, budget, group_trees):
    rng = np.random.default_rng(seed)
    log = CompletedSequenceLog()
    _fill(log, rng, 25)
    cfg = SuffixIndexConfig(max_tree_depth=6, token_budget=budget, group_trees=group_trees)
    index = GlobalSuffixIndex(cfg)
    index.sync(log)
    path = index.save(tmp_path_factory.mktemp("idx") / "index.npz")
    loaded = GlobalSuffixIndex.load(path)
    assert loaded.applied_seq == index.applied_seq and loaded.config == index.config
    contexts = [rng.integers(0, 5, size=8).tolist() for _ in range(40)]
    assert _drafts(loaded, contexts) == _drafts(index, contexts)
    # both continue from the log identically
    _fill(log, rng, 5)
    index.sync(log)
    loaded.sync(log)
    assert _drafts(loaded, contexts) == _drafts(index, contexts)


def test_trajectory_tree_is_extended_across_turns_not_rebuilt():
    index = GlobalSuffixIndex()
    index.start_request("t/0", [1, 2, 3], trajectory_id="t")
    index.extend_request("t/0", [4, 5, 6, 7])
    index.stop_request("t/0")
    tree_before = index._local.trajectories["traj:t"]
    index.start_request("t/1", [1, 2, 3, 4, 5, 6, 7, 9, 9])
    index.stop_request("t/1")
    index.start_request("t/2", [1, 2, 3, 4, 5, 6, 7, 9, 9, 8], trajectory_id="t")
    assert index._local.trajectories["traj:t"] is tree_before and tree_before.length == 10
    # a prompt that does not extend it replaces it
    index.stop_request("t/2")
    index.start_request("t/3", [2, 2, 2], trajectory_id="t")
    assert index._local.trajectories["traj:t"] is not tree_before


# ------------------------------------------------------------------ bad input
GOOD = dict(trajectory_id="t", group_id="g", policy_version=0, prompt_token_ids=[1, 2], response_token_ids=[3])


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(prompt_token_ids=[]), "prompt_token_ids"),
        (dict(response_token_ids=[]), "response_token_ids"),
        (dict(response_token_ids=[1, 2.5]), "response_token_ids[1]"),
        (dict(response_token_ids=["a"]), "response_token_ids[0]"),
        (dict(prompt_token_ids=[3, -1]), "prompt_token_ids[1]"),
        (dict(prompt_token_ids=np.array([1.0, 2.0])), "prompt_token_ids"),
        (dict(prompt_token_ids=[1, 2**40]), "prompt_token_ids[1]"),
        (dict(prompt_token_ids="hello"), "prompt_token_ids"),
        (dict(response_token_ids=[True]), "response_token_ids[0]"),
        (dict(policy_version=-1), "policy_version"),
        (dict(trajectory_id=""), "trajectory_id"),
        (dict(group_id=None), "group_id"),
    ],
)
def test_bad_record_fields_are_named(change, field):
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        CompletedSequence.create(**{**GOOD, **change})
    with pytest.raises(ValueError, match=field.split("[")[0]):
        CompletedSequenceLog().append({**GOOD, **change})


@pytest.mark.parametrize("missing", list(GOOD))
def test_record_missing_a_field_is_named(missing):
    data = {k: v for k, v in GOOD.items() if k != missing}
    with pytest.raises(ValueError, match=f"missing field '{missing}'"):
        CompletedSequenceLog().append(data)


def test_bad_requests_and_calls_are_named():
    index = GlobalSuffixIndex()
    with pytest.raises(ValueError, match="request_id: unknown request 'nope'"):
        index.speculate("nope", [1, 2], 4)
    with pytest.raises(ValueError, match="request_id: unknown"):
        index.extend_request("nope", [1])
    with pytest.raises(ValueError, match="request_id: unknown"):
        index.stop_request("nope")
    index.start_request("r", [1, 2])
    with pytest.raises(ValueError, match="already active"):
        index.start_request("r", [1, 2])
    with pytest.raises(ValueError, match="^context"):
        index.speculate("r", [], 4)
    with pytest.raises(ValueError, match=r"^context\[1\]"):
        index.speculate("r", [1, -5], 4)
    with pytest.raises(ValueError, match="^max_tokens"):
        index.speculate("r", [1, 2], -1)
    with pytest.raises(ValueError, match=r"^token_ids\[0\]"):
        index.extend_request("r", [0.5])
    with pytest.raises(ValueError, match="^prompt_token_ids"):
        index.start_request("r2", [])


def test_bad_config_and_log_use_are_named(tmp_path):
    with pytest.raises(ValueError, match="token_budget"):
        SuffixIndexConfig(token_budget=0)
    with pytest.raises(ValueError, match="evict_to_fraction"):
        SuffixIndexConfig(evict_to_fraction=1.5)
    with pytest.raises(ValueError, match="unknown key 'depth'"):
        SuffixIndexConfig.from_dict({"depth": 3})
    log = CompletedSequenceLog()
    log.append(GOOD)
    log.append(GOOD)
    index = GlobalSuffixIndex()
    with pytest.raises(ValueError, match="seq: expected entry 1, got 2"):
        index.apply(log.read(1))
    log.truncate(1)
    with pytest.raises(LogTruncatedError, match="after_seq"):
        log.read(0)
    with pytest.raises(ValueError, match="policy_version"):
        log.advance_policy_version(-3)
    bad = tmp_path / "junk.npz"
    bad.write_bytes(b"not an index")
    with pytest.raises(ValueError, match="junk.npz: not a saved suffix index"):
        GlobalSuffixIndex.load(bad)


def test_yaml_config_defaults_match_the_code_and_bad_keys_name_the_file(tmp_path):
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    assert SuffixIndexConfig.from_yaml(root / "configs" / "suffix_index.yaml") == SuffixIndexConfig()
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_tree_depth: 16\ntree_depth: 3\n")
    with pytest.raises(ValueError, match=r"bad.yaml: unknown key 'tree_depth'"):
        SuffixIndexConfig.from_yaml(bad)
    bad.write_text("max_tree_depth: '16'\n")
    with pytest.raises(ValueError, match=r"bad.yaml: key 'max_tree_depth' must be int"):
        SuffixIndexConfig.from_yaml(bad)
    bad.write_text("group_trees: 1\n")
    with pytest.raises(ValueError, match=r"key 'group_trees' must be bool"):
        SuffixIndexConfig.from_yaml(bad)
    bad.write_text("token_budget: 0\n")
    with pytest.raises(ValueError, match=r"bad.yaml: SuffixIndexConfig.token_budget"):
        SuffixIndexConfig.from_yaml(bad)
    ok = tmp_path / "ok.yaml"
    ok.write_text("max_spec_factor: 1\nmax_policy_lag: 2\n")
    assert SuffixIndexConfig.from_yaml(ok).max_policy_lag == 2


def test_a_replica_can_join_a_truncated_log_at_its_first_retained_entry():
    """start_at(seq): an empty replica applies from seq + 1 (earlier entries were truncated)."""
    import pytest

    from war_openrlhf.speculation import CompletedSequence, CompletedSequenceLog, GlobalSuffixIndex

    log = CompletedSequenceLog()
    for i in range(5):
        log.append(CompletedSequence.create(f"t{i}", "g", 0, [1, 2, 3], [4, 5, 6 + i]))
    log.truncate(3)
    late = GlobalSuffixIndex()
    with pytest.raises(ValueError, match="seq: expected entry 1, got 4"):
        late.apply(log.read(3))
    late = GlobalSuffixIndex()
    late.start_at(3)
    assert late.apply(log.read(3)) == 2 and late.applied_seq == 5
    with pytest.raises(ValueError, match="only an empty replica"):
        late.start_at(1)


def _saved_index(tmp_path):
    log = CompletedSequenceLog()
    for i in range(3):
        log.append(dict(trajectory_id=f"t{i}", group_id="g", policy_version=0,
                        prompt_token_ids=[1, 2, 3 + i], response_token_ids=[7, 8, 9, 10 + i]))
    index = GlobalSuffixIndex()
    index.apply(log.read(0))
    path = index.save(tmp_path / "index.npz")
    return index, path


def _rewrite(path, **changes):
    """The saved file with some arrays (or the header) replaced, as a corrupt or tampered file."""
    import json

    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    meta = json.loads(bytes(data["meta"]).decode())
    for k, v in changes.items():
        if k == "meta":
            meta.update(v)
        else:
            data[k] = v
    data["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    with open(path, "wb") as fh:
        np.savez(fh, **data)


def test_save_is_atomic_and_load_round_trips(tmp_path):
    index, path = _saved_index(tmp_path)
    again = GlobalSuffixIndex.load(path)
    assert again.stats()["records"] == 3 and again.stats()["applied_seq"] == index.stats()["applied_seq"]
    assert [p.name for p in tmp_path.iterdir()] == ["index.npz"]  # no temporary file left
    good = path.read_bytes()
    # a save that fails part-way leaves the last good file untouched
    import unittest.mock as mock

    with mock.patch("numpy.savez", side_effect=OSError("disk full")):
        with pytest.raises(OSError, match="disk full"):
            index.save(path)
    assert path.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["index.npz"]


@pytest.mark.parametrize("case, expected", [
    ("truncated", "not a saved suffix index"),
    ("tokens_cut", "checksum mismatch|array .tokens. has shape"),
    ("negative_length", "checksum mismatch|lengths"),
    ("duplicate_seq", "checksum mismatch|duplicate"),
    ("other_format", "format 'war-suffix-index/1'"),
    ("missing", "no such file"),
])
def test_every_bad_index_file_is_one_error_naming_the_file(tmp_path, case, expected):
    from war_openrlhf.speculation import IndexFileError

    _, path = _saved_index(tmp_path)
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif case == "tokens_cut":
        with np.load(path) as z:
            tokens = z["tokens"][:-2]
        _rewrite(path, tokens=tokens)
    elif case == "negative_length":
        with np.load(path) as z:
            lengths = z["lengths"].copy()
        lengths[0] = -1
        _rewrite(path, lengths=lengths)
    elif case == "duplicate_seq":
        with np.load(path) as z:
            seqs = z["seqs"].copy()
        seqs[1] = seqs[0]
        _rewrite(path, seqs=seqs)
    elif case == "other_format":
        _rewrite(path, meta={"format": "war-suffix-index/1"})
    elif case == "missing":
        path.unlink()
    with pytest.raises(IndexFileError, match=str(path).replace(".", r"\.") + ": (" + expected + ")"):
        GlobalSuffixIndex.load(path)


def test_consistent_but_wrong_arrays_are_refused_even_with_a_fresh_checksum(tmp_path):
    """A file rewritten with its header's checksum and shapes recomputed (so only the
    consistency checks can catch it): negative lengths, duplicates, records past the log."""
    import hashlib
    import json

    from war_openrlhf.speculation import IndexFileError

    for mutate, expected in ((lambda a: a["seqs"].__setitem__(1, a["seqs"][0]), "duplicate record sequence numbers"),
                             (lambda a: a["seqs"].__setitem__(2, 99), "past the applied position")):
        _, path = _saved_index(tmp_path)
        with np.load(path) as z:
            data = {k: z[k].copy() for k in z.files}
        mutate(data)
        meta = json.loads(bytes(data["meta"]).decode())
        digest = hashlib.sha256()
        for name in ("seqs", "versions", "lengths", "tokens"):
            digest.update(np.ascontiguousarray(data[name]).tobytes())
        meta["sha256"] = digest.hexdigest()
        data["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        with open(path, "wb") as fh:
            np.savez(fh, **data)
        with pytest.raises(IndexFileError, match=expected):
            GlobalSuffixIndex.load(path)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), min_prob=st.sampled_from([0.0, 0.05, 0.3, 0.6, 0.9, 1.0]))
def test_a_per_call_cut_off_drafts_as_an_index_configured_with_it(seed, min_prob):
    """The engine's cost-aware cut-off (speculate_engine's min_token_prob) is the config's
    min_token_prob for one call: same drafts as an index built with that value, and a higher
    cut-off never drafts more."""
    rng = np.random.default_rng(seed)
    log = CompletedSequenceLog()
    _fill(log, rng, 12, vocab=3)
    per_call, configured = GlobalSuffixIndex(max_tree_depth=8), GlobalSuffixIndex(max_tree_depth=8, min_token_prob=min_prob)
    for index in (per_call, configured):
        index.sync(log)
    for i in range(10):
        ctx = np.asarray(rng.integers(0, 3, size=int(rng.integers(2, 12))), dtype=np.int32)
        for index in (per_call, configured):
            index.start_request(f"r{i}", ctx[:2])
        got = per_call.speculate_engine(f"r{i}", ctx, 8, min_prob)
        want = configured.speculate_engine(f"r{i}", ctx, 8)
        assert (got.token_ids, got.source, round(got.score, 9)) == (want.token_ids, want.source, round(want.score, 9))
        looser = per_call.speculate_engine(f"r{i}", ctx, 8, min_prob / 2)
        assert len(got.token_ids) <= len(looser.token_ids) or looser.source != got.source


def _chunk(key, traj, group, offset, tokens):
    from war_openrlhf.speculation import InflightChunk

    return InflightChunk.create(key, traj, group, offset, tokens)


def test_sibling_still_generating_on_engine_a_drafts_on_engine_b():
    """In-flight sharing: the first tokens of s1's turn reach engine B's replica as a chunk while s1
    still generates; s7 of the same group drafts from them; a request of another group does not."""
    log = CompletedSequenceLog()
    engine_b = GlobalSuffixIndex()
    prompt, answer = list(range(100, 140)), list(range(500, 540))
    engine_b.start_request("s7/turn0", prompt, group_id="task7", trajectory_id="s7")
    engine_b.start_request("x/turn0", prompt, group_id="task8", trajectory_id="x")
    log.append_chunk(_chunk("e0:r1", "s1", "task7", 0, answer[:12]))
    log.append_chunk(_chunk("e0:r1", "s1", "task7", 12, answer[12:30]))
    engine_b.sync(log)
    draft = engine_b.speculate("s7/turn0", prompt + answer[:4], 16)
    assert draft.source == "inflight" and draft.token_ids == answer[4:8]  # at most the 4-token match
    assert engine_b.speculate("x/turn0", prompt + answer[:4], 16).token_ids == []
    assert engine_b.stats()["inflight_turns"] == 1 and engine_b.stats()["inflight_tokens"] == 30


def test_a_record_closes_its_turn_a_late_chunk_is_ignored_a_new_version_clears_all():
    log = CompletedSequenceLog()
    replica = GlobalSuffixIndex(prompt_lead_in=0)
    answer = list(range(500, 540))
    replica.start_request("s7", [1, 2, 3], group_id="g", trajectory_id="s7")
    log.append_chunk(_chunk("e0:r1", "s1", "g", 0, answer[:20]))
    log.append_chunk(_chunk("e0:r1", "s1", "g", 0, answer[:20]))  # a repeat adds nothing
    log.append_chunk(_chunk("e1:r2", "s2", "g", 0, [9, 9, 9, 9]))
    replica.sync(log)
    assert replica.stats()["inflight_tokens"] == 24 and replica.stats()["inflight_turns"] == 2
    log.append(CompletedSequence.create("s1", "g", 0, [0], answer))  # s1's turn finished
    log.append_chunk(_chunk("e0:r1", "s1", "g", 20, answer[20:]))  # late: after its record
    replica.sync(log)
    st = replica.stats()
    assert st["inflight_turns"] == 1 and st["inflight_late_chunks"] == 1
    assert replica.speculate("s7", [1, 2, 3] + answer[:4], 8).source == "global"  # the record now
    log.advance_policy_version(1)
    replica.sync(log)
    assert replica.stats()["inflight_turns"] == 0


def test_in_flight_chunks_are_ignored_when_sharing_is_off_and_keep_replicas_converged():
    rng = np.random.default_rng(5)
    log = CompletedSequenceLog()
    for i in range(30):
        traj = f"t{i % 5}"
        if rng.random() < 0.3:
            log.append(CompletedSequence.create(traj, f"g{i % 2}", 0, [1], rng.integers(0, 4, 12).tolist()))
        else:
            log.append_chunk(_chunk(f"e{i % 2}:{traj}:{i // 5}", traj, f"g{i % 2}", 0, rng.integers(0, 4, 6).tolist()))
    off = GlobalSuffixIndex(inflight_sharing=False)
    off.sync(log)
    assert off.stats()["inflight_turns"] == 0 and off.stats()["inflight_chunks"] == 0
    a, b = GlobalSuffixIndex(max_tree_depth=8), GlobalSuffixIndex(max_tree_depth=8)
    a.sync(log)
    for start in range(0, log.last_seq, 7):  # another batching, applied slice by slice
        b.enqueue(log.read(start, 7))
        b.work(1e-6)
    b.work(None)
    for index in (a, b):
        index.start_request("probe", [0], group_id="g0")
    ctxs = [rng.integers(0, 4, 6).tolist() for _ in range(20)]
    assert [a.speculate("probe", c, 4).token_ids for c in ctxs] == [b.speculate("probe", c, 4).token_ids for c in ctxs]
    assert a.stats()["inflight_tokens"] == b.stats()["inflight_tokens"]


def test_chunk_entries_cross_the_wire_unchanged():
    from war_openrlhf.engine.wire import entries_from_wire, entries_to_wire

    log = CompletedSequenceLog()
    log.append_chunk(_chunk("e3:req-1", "traj", "grp", 17, [5, 6, 7]))
    (entry,) = entries_from_wire(entries_to_wire(log.read(0)))
    assert entry.chunk.key == "e3:req-1" and entry.chunk.offset == 17 and entry.chunk.token_ids.tolist() == [5, 6, 7]
    assert entry.record is None and entry.policy_version is None
    with pytest.raises(ValueError, match="offset"):
        _chunk("k", "t", "g", -1, [1])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.lists(st.integers(1, 5), min_size=1, max_size=30))
def test_the_engine_path_of_extend_leaves_the_state_of_the_checked_path(seed, steps):
    """vLLM hands each request's sampled ids to the drafter as a list every step; the engine path
    converts them without the per-token checks and must leave the same trees (same drafts)."""
    rng = np.random.default_rng(seed)
    checked, engine = GlobalSuffixIndex(), GlobalSuffixIndex()
    prompt = rng.integers(0, 50, size=20).tolist()
    for index in (checked, engine):
        index.start_request("r", prompt, group_id="g", trajectory_id="t")
        index.start_request("sib", prompt, group_id="g", trajectory_id="t2")
    ctx = list(prompt)
    for n in steps:
        new = rng.integers(0, 50, size=n).tolist()
        ctx += new
        checked.extend_request("r", new)
        engine.extend_request_engine("r", new)
        checked.extend_request("sib", new[::-1])
        engine.extend_request_engine("sib", new[::-1])
        a = checked.speculate_engine("r", np.asarray(ctx, dtype=np.int32), 4)
        b = engine.speculate_engine("r", np.asarray(ctx, dtype=np.int32), 4)
        assert (a.token_ids, a.source, a.match_len) == (b.token_ids, b.source, b.match_len)


def test_the_engine_path_names_a_negative_id_as_the_checked_path_does():
    index = GlobalSuffixIndex()
    index.start_request("r", [1, 2, 3])
    with pytest.raises(ValueError, match=r"token_ids\[1\]: token ids must be >= 0"):
        index.extend_request_engine("r", [4, -1])
    with pytest.raises(ValueError, match="unknown request"):
        index.extend_request_engine("nope", [4])
    with pytest.raises(ValueError, match="unknown request"):
        index.extend_request("nope", [])
