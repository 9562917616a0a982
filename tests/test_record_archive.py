"""The pool's record archive (what the index replicas hold, for checkpoints) and its file."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from war_openrlhf.rollout.record_archive import ArchiveFileError, RecordArchive
from war_openrlhf.speculation import CompletedSequence, SuffixIndexConfig


def _rec(i, version, n_lead, n_resp):
    rng = np.random.default_rng(i)
    return CompletedSequence.create(f"t{i}", f"g{i % 3}", version, rng.integers(0, 1000, n_lead),
                                    rng.integers(0, 1000, n_resp))


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.one_of(st.tuples(st.just("add"), st.integers(1, 8), st.integers(1, 40)),
                              st.tuples(st.just("advance"), st.integers(0, 3), st.just(0))), max_size=60),
       budget=st.integers(40, 200), frac=st.sampled_from([0.5, 0.75, 1.0]),
       lag=st.one_of(st.none(), st.integers(0, 3)))
def test_archive_keeps_what_a_brute_force_replica_keeps(ops, budget, frac, lag):
    """Against a list kept by the rule written out: oldest first past the token budget down to
    the fraction; records more than ``lag`` versions behind the newest dropped."""
    cfg = SuffixIndexConfig(token_budget=budget, evict_to_fraction=frac, max_policy_lag=lag)
    arch = RecordArchive(cfg)
    ref, version = [], 0
    for i, (op, a, b) in enumerate(ops):
        if op == "add":
            r = _rec(i, version, a, b)
            arch.add(r)
            ref.append(r)
            version = max(version, r.policy_version)
            if sum(x.num_tokens for x in ref) > budget:
                while ref and sum(x.num_tokens for x in ref) > budget * frac:
                    ref.pop(0)
        else:
            version += a
            arch.advance_policy_version(version)
            if lag is not None:
                ref = [x for x in ref if x.policy_version >= version - lag]
    assert [r.trajectory_id for r in arch.records()] == [r.trajectory_id for r in ref]
    assert arch.tokens == sum(x.num_tokens for x in ref)


def test_archive_file_round_trip_and_refusals(tmp_path):
    arch = RecordArchive(SuffixIndexConfig())
    recs = [_rec(i, i // 3, 16, 5 + i) for i in range(10)] + [_rec(99, 4, 1, 1)]
    arch.extend(recs)
    path = arch.save(tmp_path / "a.npz")
    got, version = RecordArchive.load_records(path)
    assert version == 4
    assert [(r.trajectory_id, r.group_id, r.policy_version) for r in got] == \
        [(r.trajectory_id, r.group_id, r.policy_version) for r in recs]
    for a, b in zip(got, recs):
        assert np.array_equal(a.prompt_token_ids, b.prompt_token_ids)
        assert np.array_equal(a.response_token_ids, b.response_token_ids)
    # an empty archive saves and loads too
    empty = RecordArchive(SuffixIndexConfig()).save(tmp_path / "empty.npz")
    assert RecordArchive.load_records(empty) == ([], 0)
    # refusals name the file
    with pytest.raises(ArchiveFileError, match="missing.npz: no such file"):
        RecordArchive.load_records(tmp_path / "missing.npz")
    raw = path.read_bytes()
    (tmp_path / "cut.npz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ArchiveFileError, match="cut.npz: unreadable"):
        RecordArchive.load_records(tmp_path / "cut.npz")
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["tokens"] = arrays["tokens"].copy()
    arrays["tokens"][3] += 1
    np.savez(tmp_path / "changed.npz", **arrays)
    with pytest.raises(ArchiveFileError, match="changed.npz: checksum mismatch"):
        RecordArchive.load_records(tmp_path / "changed.npz")
    (tmp_path / "junk.npz").write_text("not a zip")
    with pytest.raises(ArchiveFileError, match="junk.npz"):
        RecordArchive.load_records(tmp_path / "junk.npz")


def test_clearing_keeps_the_version_and_the_archive_fills_again():
    arch = RecordArchive(SuffixIndexConfig())
    arch.extend([_rec(i, 2, 4, 6) for i in range(3)])
    arch.clear()
    assert len(arch) == 0 and arch.tokens == 0 and arch.records() == [] and arch.policy_version == 2
    arch.add(_rec(7, 2, 4, 6))
    assert len(arch) == 1 and arch.tokens == arch.records()[0].num_tokens
