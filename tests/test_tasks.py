"""Retrieval tasks: layout invariants, phase design (uniform / balanced), determinism, I/O."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch
from datasets import Dataset, load_from_disk
from scipy import stats

from phasemech.data.tasks import (
    MQARTask,
    NeedleTask,
    generate,
    generate_rows,
    load_dataset,
    save_dataset,
    targets_frame,
    task_from_dict,
    task_of,
    task_to_dict,
    to_tensors,
    training_batch,
)

ALPHA = 1e-3  # guard threshold: a correct generator fails it once in a thousand seeds


def _rows(ds: Dataset) -> list[dict]:
    return ds.with_format(None).to_list()


def _check_common(task, row: dict) -> None:
    """Invariants every task shares: vocabulary split, prefix, target geometry."""
    ids = np.asarray(row["input_ids"])
    v, half = task.vocab_size, task.vocab_size // 2
    prefix = row["prefix"]
    assert len(ids) == task.seq_len
    assert 0 <= prefix < task.stride
    assert ((ids >= 1) & (ids < v)).all()  # token 0 is never used
    n = len(row["query_pos"])
    assert all(len(row[c]) == n for c in ("source_pos", "answer", "depth", "distance", "phase"))
    keys = set()
    for q, s, a, dep, dist, ph in zip(
        row["query_pos"],
        row["source_pos"],
        row["answer"],
        row["depth"],
        row["distance"],
        row["phase"],
        strict=True,
    ):
        key = ids[q]
        assert 1 <= key < half, "a query starts with a key"
        assert ids[s - 1] == key, "the needle follows its key"
        assert ids[s] == a and half <= a < v, "the answer is a value at source_pos"
        assert ids[q + 1] == a, "the query is the key followed by its value"
        assert prefix < s < q < task.seq_len - 1
        assert dist == q - s
        assert dep == pytest.approx((s - prefix) / (q - prefix), abs=1e-12)
        assert 0 < dep < 1
        assert ph == (s - task.grid_offset) % task.stride
        # fillers and values come from [V/2, V): the key occurs only at its pair and its query
        assert np.flatnonzero(ids == key).tolist() == [s - 1, q]
        keys.add(int(key))
    assert len(keys) == n, "every target asks a different key"
    # everything that is not a key lies in the value range; keys sit inside the content
    key_pos = np.flatnonzero(ids < half)
    assert (key_pos >= prefix).all() and (key_pos < prefix + task.content_len).all()


def check_mqar(task: MQARTask, row: dict) -> None:
    _check_common(task, row)
    ids = np.asarray(row["input_ids"])
    half = task.vocab_size // 2
    key_pos = np.flatnonzero(ids < half)
    key_tokens = ids[key_pos]
    # n_pairs pair keys (all distinct) then `queries` query keys
    assert len(key_pos) == task.n_pairs + task.queries
    pairs = key_tokens[: task.n_pairs]
    assert len(set(pairs.tolist())) == task.n_pairs
    assert len(row["query_pos"]) == task.queries
    # all queries come after the last pair; query positions ascend, 2-slots don't overlap
    assert min(row["query_pos"]) > key_pos[task.n_pairs - 1] + 1
    assert np.all(np.diff(row["query_pos"]) >= 2)
    if task.jitter == 0:  # Zoology layout inside the content: key, value, key, value, ...
        rel = key_pos[: task.n_pairs] - row["prefix"]
        assert rel.tolist() == list(range(0, 2 * task.n_pairs, 2))
    else:
        gaps = np.diff(np.r_[-2, key_pos[: task.n_pairs] - row["prefix"]]) - 2
        assert ((gaps >= 0) & (gaps <= task.jitter)).all()


def check_needle(task: NeedleTask, row: dict) -> None:
    _check_common(task, row)
    ids = np.asarray(row["input_ids"])
    half = task.vocab_size // 2
    prefix, ctx, m = row["prefix"], task.context_len, task.n_needles
    # queries: right after the context, one 2-slot per needle
    assert sorted(row["query_pos"]) == [prefix + ctx + 2 * j for j in range(m)]
    ctx_keys = np.flatnonzero(ids[prefix : prefix + ctx] < half)
    assert len(ctx_keys) == m + task.n_distractors
    assert len(set(ids[prefix + ctx_keys].tolist())) == m + task.n_distractors
    assert (np.diff(ctx_keys) >= 2).all()  # pairs do not overlap
    assert all(s < prefix + ctx for s in row["source_pos"])


# ------------------------------------------------------------------------- MQAR layout


@pytest.mark.parametrize(
    "task",
    [
        MQARTask(),
        MQARTask(vocab_size=16, seq_len=40, n_pairs=7, stride=4),  # every key in use
        MQARTask(seq_len=48, n_pairs=6, n_queries=3, stride=4, grid_offset=3),
        MQARTask(seq_len=40, n_pairs=4, stride=1),  # no prefix at all
    ],
    ids=["default", "all_keys", "few_queries_offset", "stride1"],
)
def test_mqar_invariants(task):
    ds = generate(task, 300, seed=5)
    for row in _rows(ds):
        check_mqar(task, row)
    assert sorted(set(ds["prefix"])) == list(range(task.stride))


def test_mqar_uses_every_key_when_pairs_fill_the_key_range():
    task = MQARTask(vocab_size=16, seq_len=40, n_pairs=7, stride=4)
    for row in _rows(generate(task, 20, seed=0)):
        ids = np.asarray(row["input_ids"])
        assert sorted(ids[ids < 8].tolist()) == sorted(2 * list(range(1, 8)))


def test_mqar_queries_ask_random_keys_in_random_order():
    task = MQARTask(seq_len=64, n_pairs=8, n_queries=4)
    asked = []
    for row in _rows(generate(task, 200, seed=1)):
        pair_index = [(s - row["prefix"] - 1) // 2 for s in row["source_pos"]]
        asked.append(tuple(pair_index))
    assert len(set(asked)) > 150
    assert {i for a in asked for i in a} == set(range(8))
    assert any(list(a) != sorted(a) for a in asked)


# ------------------------------------------------------------------- phase design (guard)


def _one_target_per_sequence(df: pd.DataFrame) -> pd.DataFrame:
    # Targets of one sequence share its prefix, so their phases are not independent draws;
    # the first target of every sequence is (prefix uniform, independent of the content).
    return df[df["target"] == 0]


def _guard(phase: np.ndarray, depth: np.ndarray, stride: int) -> tuple[float, float]:
    """(chi-square GOF p for uniform phase, chi-square contingency p for phase x depth bin)."""
    counts = np.bincount(phase, minlength=stride)
    uniform_p = stats.chisquare(counts).pvalue
    bins = pd.qcut(depth, 5, labels=False, duplicates="drop")
    table = pd.crosstab(bins, phase)  # observed phases only (no all-zero columns)
    independence_p = stats.chi2_contingency(table.to_numpy()).pvalue
    return float(uniform_p), float(independence_p)


@pytest.fixture(scope="module")
def random_prefix_set() -> Dataset:
    return generate(MQARTask(stride=8), 4000, seed=2024)


@pytest.mark.parametrize("stride", [8, 4, 2])
def test_random_prefix_phase_uniform_and_independent_of_depth(random_prefix_set, stride):
    df = _one_target_per_sequence(targets_frame(random_prefix_set, stride=stride))
    assert len(df) == 4000
    uniform_p, independence_p = _guard(df["phase"].to_numpy(), df["depth"].to_numpy(), stride)
    assert uniform_p > ALPHA, uniform_p
    assert independence_p > ALPHA, independence_p


def test_random_prefix_all_targets_cover_every_phase_evenly(random_prefix_set):
    # all 32000 targets: proportions close to 1/8 (loose bound, clustered draws)
    share = targets_frame(random_prefix_set)["phase"].value_counts(normalize=True)
    assert sorted(share.index) == list(range(8))
    assert (share - 1 / 8).abs().max() < 0.02


@pytest.mark.parametrize("stride", [8, 4])
def test_guard_fails_on_the_fixed_zoology_layout(random_prefix_set, stride):
    # Control: the same contents without their prefix (Zoology's layout, values at odd
    # positions). The guard must reject it, or it could not catch a broken generator.
    df = _one_target_per_sequence(targets_frame(random_prefix_set))
    fixed = (df["source_pos"] - df["prefix"]).to_numpy()
    assert (fixed % 2 == 1).all()
    uniform_p, independence_p = _guard(fixed % stride, df["depth"].to_numpy(), stride)
    assert uniform_p < 1e-12
    # phase of a fixed layout also tracks the pair index, hence depth
    assert independence_p < 1e-12


# ------------------------------------------------------------------------- balanced sets


def _assert_balanced(df: pd.DataFrame, stride: int) -> None:
    bins = pd.cut(df["depth"], 5, labels=False)
    table = pd.crosstab(bins, df["phase"])
    assert list(table.columns) == list(range(stride))
    for _, counts in table.iterrows():
        assert counts.nunique() == 1, table


@pytest.mark.parametrize(
    "task",
    [
        MQARTask(stride=8),
        MQARTask(stride=8, jitter=2, n_pairs=6),
        MQARTask(stride=8, grid_offset=5, n_queries=3),
    ],
    ids=["plain", "jitter", "offset"],
)
def test_balanced_mqar_equal_counts_per_phase_and_depth(task):
    ds = generate(task, 8 * 40, seed=3, balanced=True)
    _assert_balanced(targets_frame(ds), 8)
    _assert_balanced(targets_frame(ds, stride=4), 4)
    _assert_balanced(targets_frame(ds, stride=4, grid_offset=1), 4)
    # exact: every (content, target) appears once at every phase
    df = targets_frame(ds)
    per = df.groupby(["group_id", "target"])["phase"].agg(lambda p: sorted(p))
    assert all(p == list(range(8)) for p in per)


@pytest.mark.parametrize("kind", ["mqar", "needle"])
def test_balanced_groups_are_shifted_copies(kind):
    if kind == "mqar":
        task = MQARTask(stride=8)
    else:
        task = NeedleTask(n_needles=2, n_distractors=4, stride=8)
    ds = generate(task, 8 * 12, seed=9, balanced=True)
    rows = _rows(ds)
    assert [r["seq_id"] for r in rows] == list(range(len(rows)))
    groups: dict[int, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    assert sorted(groups) == list(range(12))
    for members in groups.values():
        assert sorted(r["prefix"] for r in members) == list(range(8))
        ref = members[0]
        ref_content = ref["input_ids"][ref["prefix"] : ref["prefix"] + task.content_len]
        for r in members:
            p = r["prefix"]
            assert r["input_ids"][p : p + task.content_len] == ref_content
            assert [s - p for s in r["source_pos"]] == [
                s - ref["prefix"] for s in ref["source_pos"]
            ]
            assert [q - p for q in r["query_pos"]] == [q - ref["prefix"] for q in ref["query_pos"]]
            assert r["answer"] == ref["answer"]
            assert r["depth"] == ref["depth"]
            assert r["distance"] == ref["distance"]
        # fillers around the content are drawn afresh: copies are not identical sequences
        assert len({tuple(r["input_ids"]) for r in members}) == 8


@pytest.mark.parametrize("n", [1, 7, 12, 100])
def test_balanced_n_not_multiple_of_stride_raises(n):
    with pytest.raises(ValueError, match="stride"):
        generate(MQARTask(stride=8), n, seed=0, balanced=True)
    with pytest.raises(ValueError, match="stride"):
        generate(NeedleTask(stride=8), n, seed=0, balanced=True)


@pytest.mark.parametrize("n", [0, -8, 2.5])
def test_generate_rejects_bad_n(n):
    with pytest.raises(ValueError, match="n="):
        generate(MQARTask(), n, seed=0)


# --------------------------------------------------------------------------------- jitter


def test_jitter_breaks_value_parity_and_keeps_invariants():
    plain, jit = MQARTask(seq_len=64, n_pairs=8), MQARTask(seq_len=64, n_pairs=8, jitter=2)
    mixed = []
    for task in (plain, jit):
        rows = _rows(generate(task, 300, seed=4))
        for row in rows:
            check_mqar(task, row)
        mixed.append(np.mean([len({s % 2 for s in r["source_pos"]}) > 1 for r in rows]))
    assert mixed[0] == 0.0  # Zoology layout: every value of a sequence shares a parity
    assert mixed[1] > 0.8  # P(all gaps even) = (2/3)^7 ~ 0.06


def test_jitter_at_capacity_still_fits():
    # content_len == 2n + n*jitter + 2q exactly: the worst-case gaps must still fit
    task = MQARTask(vocab_size=64, seq_len=29, n_pairs=4, jitter=3, stride=2)
    assert task.content_len == 2 * 4 + 4 * 3 + 2 * 4
    for row in _rows(generate(task, 400, seed=11)):
        check_mqar(task, row)


# --------------------------------------------------------------------------------- needles


def _requested_depth(task: NeedleTask, row: dict) -> float:
    return task.depths[row["group_id"] % len(task.depths)]


@pytest.mark.parametrize("balanced", [False, True])
def test_needle_zero_at_controlled_depth(balanced):
    task = NeedleTask(seq_len=64, n_needles=1, n_distractors=6, stride=8)
    ds = generate(task, 8 * 15, seed=6, balanced=balanced)
    seen = set()
    for row in _rows(ds):
        check_needle(task, row)
        depth = _requested_depth(task, row)
        (source,) = row["source_pos"]
        key_pos = source - 1
        assert key_pos == round(depth * (task.context_len - 2)) + row["prefix"]
        seen.add(depth)
    assert seen == set(task.depths)


def test_needle_balanced_all_phases_at_every_depth():
    task = NeedleTask(seq_len=64, n_needles=1, n_distractors=6, stride=8)
    ds = generate(task, 8 * 20, seed=7, balanced=True)
    df = targets_frame(ds)
    df["requested"] = [task.depths[g % len(task.depths)] for g in df["group_id"]]
    table = pd.crosstab(df["requested"], df["phase"])
    assert table.shape == (len(task.depths), 8)
    assert (table.to_numpy() == 4).all()  # 20 contents / 5 depths, each at all 8 phases
    _assert_balanced(df, 8)
    _assert_balanced(targets_frame(ds, stride=4), 4)


def test_multi_needle_layout():
    task = NeedleTask(seq_len=64, n_needles=3, n_distractors=5, stride=8)
    ds = generate(task, 8 * 10, seed=8, balanced=True)
    orders = set()
    for row in _rows(ds):
        check_needle(task, row)
        assert len(row["query_pos"]) == 3
        ctx_end = row["prefix"] + task.context_len
        assert all(q >= ctx_end for q in row["query_pos"])
        # needle 0 (controlled depth) is one of the three targets
        first = round(_requested_depth(task, row) * (task.context_len - 2)) + row["prefix"]
        assert first + 1 in row["source_pos"]
        orders.add(row["source_pos"].index(first + 1))
    assert orders == {0, 1, 2}  # needles are queried in random order


def test_needle_depth_extremes_fit_inside_context():
    task = NeedleTask(seq_len=32, n_needles=1, n_distractors=2, depths=(0.0, 1.0), stride=4)
    for row in _rows(generate(task, 40, seed=1)):
        check_needle(task, row)
        (s,) = row["source_pos"]
        want = 0 if _requested_depth(task, row) == 0.0 else task.context_len - 2
        assert s - 1 - row["prefix"] == want


def test_needle_tight_contexts_are_rejected_or_always_generate():
    # seq_len=6: needle 0 at depth 0.5 leaves no room for a distractor pair on either side
    with pytest.raises(ValueError, match="seq_len"):
        NeedleTask(seq_len=6, stride=1, n_needles=1, n_distractors=1, depths=(0.5,))
    # filled to capacity (25 pairs in a 51-token context): placement never fragments it
    task = NeedleTask(seq_len=64, stride=8, n_needles=3, n_distractors=22)
    for row in _rows(generate(task, 80, seed=0, balanced=True)):
        check_needle(task, row)
    with pytest.raises(ValueError, match="seq_len"):
        NeedleTask(seq_len=64, stride=8, n_needles=3, n_distractors=23)


def test_needle_pairs_are_placed_uniformly():
    # 1 distractor in an 8-token context, needle 0 at depth 0 (slot 0): the distractor's key
    # takes each of the 5 free slots 2..6 equally often
    task = NeedleTask(seq_len=10, stride=1, n_needles=1, n_distractors=1, depths=(0.0,))
    keys = []
    for row in _rows(generate(task, 2000, seed=3)):
        ids = np.asarray(row["input_ids"])
        keys.append(int(np.flatnonzero(ids[2:8] < task.vocab_size // 2)[0]) + 2)
    counts = np.bincount(keys, minlength=7)[2:7]
    assert stats.chisquare(counts).pvalue > 1e-3, counts


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize(
    "task", [MQARTask(jitter=1, n_pairs=6), NeedleTask(n_needles=2)], ids=["mqar", "needle"]
)
@pytest.mark.parametrize("balanced", [False, True])
def test_same_seed_same_dataset(task, balanced):
    a = generate(task, 48, seed=13, balanced=balanced)
    b = generate(task, 48, seed=13, balanced=balanced)
    c = generate(task, 48, seed=14, balanced=balanced)
    assert _rows(a) == _rows(b)
    assert a.info.description == b.info.description
    assert a["input_ids"] != c["input_ids"]


def test_training_batch_is_a_pure_function():
    task = MQARTask(seq_len=32, n_pairs=4, stride=4)
    first = training_batch(task, 16, seed=3, step=10)
    torch.manual_seed(123)  # global RNG state must not matter
    np.random.seed(0)
    again = training_batch(task, 16, seed=3, step=10)
    for x, y in zip(first, again, strict=True):
        assert torch.equal(x, y)
    tokens, qp, ans = first
    assert tokens.shape == (16, 32) and qp.shape == ans.shape == (16, 4)
    assert tokens.dtype == qp.dtype == ans.dtype == torch.int64
    assert torch.equal(tokens.gather(1, qp + 1), ans)
    assert not torch.equal(training_batch(task, 16, seed=3, step=11)[0], tokens)
    assert not torch.equal(training_batch(task, 16, seed=4, step=10)[0], tokens)
    # a batch is generated as a random-prefix set: every prefix appears eventually
    prefixes = set()
    for step in range(8):
        tk, qp, ans = training_batch(task, 16, seed=3, step=step)
        first_key = (tk < 32).int().argmax(1)
        prefixes |= set(first_key.tolist())
    assert prefixes == set(range(4))


def test_to_tensors_matches_rows():
    ds = generate(MQARTask(n_queries=3), 10, seed=0)
    tokens, qp, ans = to_tensors(ds)
    assert tokens.tolist() == ds["input_ids"]
    assert qp.tolist() == ds["query_pos"] and ans.tolist() == ds["answer"]
    t2, q2, a2 = to_tensors(_rows(ds))
    assert torch.equal(t2, tokens) and torch.equal(q2, qp) and torch.equal(a2, ans)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "task",
    [MQARTask(seq_len=48, n_pairs=5, n_queries=2, stride=4, grid_offset=1, jitter=1), NeedleTask()],
    ids=["mqar", "needle"],
)
def test_save_to_disk_and_parquet_round_trip(tmp_path, task):
    ds = generate(task, 16, seed=21, balanced=True)
    ds.save_to_disk(str(tmp_path / "folder"))
    loaded = load_from_disk(str(tmp_path / "folder"))
    assert _rows(loaded) == _rows(ds)
    assert task_of(loaded) == task
    ds.to_parquet(str(tmp_path / "ds.parquet"))
    from_parquet = Dataset.from_parquet(str(tmp_path / "ds.parquet"))
    assert _rows(from_parquet) == _rows(ds)
    pd.testing.assert_frame_equal(targets_frame(from_parquet), targets_frame(ds))
    # save_dataset / load_dataset keep the task in the parquet file (HF parquet alone does not)
    for name in ("saved", "saved.parquet"):
        back = load_dataset(save_dataset(ds, tmp_path / name))
        assert _rows(back) == _rows(ds)
        assert task_of(back) == task
    with pytest.raises(ValueError, match="neither"):
        load_dataset(tmp_path / "missing.csv")


def test_task_of_and_dict_round_trip():
    for task in (
        MQARTask(vocab_size=32, seq_len=40, n_pairs=5, n_queries=3, stride=4, jitter=1),
        NeedleTask(n_needles=2, n_distractors=3, depths=(0.1, 0.9), grid_offset=2),
    ):
        d = task_to_dict(task)
        assert d["task"] == task.name
        assert task_from_dict(d) == task
        assert task_from_dict(json.loads(json.dumps(d))) == task  # JSON: depths become a list
        assert task_of(generate(task, 8, seed=0)) == task
    meta = json.loads(generate(MQARTask(), 8, seed=5, balanced=True).info.description)
    assert meta["seed"] == 5 and meta["balanced"] is True and meta["n"] == 8


def test_task_of_without_task_metadata_is_none():
    ds = Dataset.from_dict({"input_ids": [[1, 2]]})
    assert task_of(ds) is None
    ds.info.description = "not json"
    assert task_of(ds) is None
    ds.info.description = json.dumps({"something": 1})
    assert task_of(ds) is None


def test_task_from_dict_rejects_unknown_names():
    d = task_to_dict(MQARTask())
    with pytest.raises(ValueError, match="bogus"):
        task_from_dict({**d, "bogus": 1})
    with pytest.raises(ValueError, match="'ruler'"):
        task_from_dict({**d, "task": "ruler"})
    with pytest.raises(ValueError, match="None"):
        task_from_dict({k: v for k, v in d.items() if k != "task"})
    # a needle field on an MQAR task is unknown too
    with pytest.raises(ValueError, match="depths"):
        task_from_dict({**d, "depths": [0.5]})


def test_tasks_are_frozen_and_depths_normalised():
    t = NeedleTask(depths=[0, 1])
    assert t.depths == (0.0, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.seq_len = 3


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    ("cls", "kw", "field"),
    [
        (MQARTask, dict(vocab_size=63), "vocab_size"),
        (MQARTask, dict(vocab_size=6), "vocab_size"),
        (MQARTask, dict(vocab_size=64.0), "vocab_size"),
        (NeedleTask, dict(vocab_size=7), "vocab_size"),
        (MQARTask, dict(seq_len=10), "seq_len"),  # content of 3 tokens for 8 pairs
        (MQARTask, dict(seq_len=8), "seq_len"),  # not > stride
        (MQARTask, dict(seq_len=34, n_pairs=8, stride=4), "seq_len"),  # 31 < 32 tokens
        (MQARTask, dict(seq_len=64, jitter=4), "seq_len"),  # 16 + 32 + 16 > 57
        (NeedleTask, dict(seq_len=20, n_distractors=8), "seq_len"),
        (MQARTask, dict(vocab_size=16, n_pairs=8), "n_pairs"),
        (MQARTask, dict(n_pairs=0), "n_pairs"),
        (MQARTask, dict(n_pairs=4, n_queries=5), "n_queries"),
        (MQARTask, dict(n_queries=0), "n_queries"),
        (MQARTask, dict(jitter=-1), "jitter"),
        (MQARTask, dict(stride=0), "stride"),
        (MQARTask, dict(grid_offset=0.5), "grid_offset"),
        (NeedleTask, dict(depths=(0.5, 1.5)), "depths"),
        (NeedleTask, dict(depths=(-0.1,)), "depths"),
        (NeedleTask, dict(depths=()), "depths"),
        (NeedleTask, dict(n_needles=0), "n_needles"),
        (NeedleTask, dict(n_distractors=-1), "n_distractors"),
        (NeedleTask, dict(vocab_size=16, n_needles=2, n_distractors=6), "n_needles"),
    ],
)
def test_bad_inputs_name_the_field(cls, kw, field):
    with pytest.raises(ValueError, match=field):
        cls(**kw)


def test_seq_len_message_explains_capacity():
    with pytest.raises(ValueError, match=r"seq_len=10 .*cannot hold 8 pairs"):
        MQARTask(seq_len=10)


def test_boundaries_are_accepted():
    MQARTask(vocab_size=8, seq_len=16, n_pairs=3, stride=2)  # n_pairs == V/2 - 1
    assert MQARTask(seq_len=39, n_pairs=8, stride=8).content_len == 32  # exactly 2n + 2q
    NeedleTask(depths=(0.0, 1.0))


def test_training_batch_spread_narrows_the_prefix_and_keeps_the_content_layout():
    task = MQARTask(seq_len=32, n_pairs=4, stride=8)
    full = training_batch(task, 64, seed=3, step=0)
    # spread=None is the task's own stride: the same draws as a spread of the full stride
    for x, y in zip(full, training_batch(task, 64, seed=3, step=0, spread=8), strict=True):
        assert torch.equal(x, y)
    assert set((full[0] < 32).int().argmax(1).tolist()) == set(range(8))
    for spread in (1, 3):
        tokens, qp, ans = training_batch(task, 64, seed=3, step=0, spread=spread)
        assert torch.equal(tokens.gather(1, qp + 1), ans)
        first_key = (tokens < 32).int().argmax(1)  # keys are tokens below V/2: the prefix
        assert set(first_key.tolist()) == set(range(spread))
        # the content's layout is the task's: the query block ends within the same span
        assert (qp - first_key[:, None]).max() <= task.content_len - 1


@pytest.mark.parametrize("spread", [0, 9, 2.5])
def test_training_batch_spread_out_of_range_is_refused(spread):
    allowed = r"need None or an int in 1\.\.stride=8"
    with pytest.raises(ValueError, match=r"^spread=.* is invalid: " + allowed):
        training_batch(MQARTask(seq_len=32, n_pairs=4, stride=8), 4, seed=0, step=0, spread=spread)


def test_balanced_set_refuses_a_spread():
    with pytest.raises(ValueError, match="spread=2 is invalid: a phase-balanced set uses every"):
        generate_rows(MQARTask(seq_len=32, n_pairs=4, stride=4), 8, 0, balanced=True, spread=2)
