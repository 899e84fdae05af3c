"""Head clustering by phase profile, and linear phase probes on the residual stream."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import N_CTX, make_model, tokens
from threadpoolctl import threadpool_limits

from phasemech.interventions.clustering import HeadClusters, cluster_heads
from phasemech.interventions.probes import ProbeResult, grouped_cross_validate, phase_probe

STRIDE = 4


@pytest.fixture(scope="module", autouse=True)
def one_blas_thread():
    # sklearn's BLAS calls would otherwise take every core of a shared 2-core machine
    with threadpool_limits(1):
        yield


# --------------------------------------------------------------------------- cluster_heads


def planted_effects(flat: str = "zero", seed: int = 0, noise: float = 0.03) -> pd.DataFrame:
    """12 heads (3 layers x 4) in 3 interleaved groups: effect at phase 0, at phase 2, flat.

    Magnitudes vary between heads (0.5..1.5) so only the profile shape identifies a group.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for layer in range(3):
        for head in range(4):
            group = (4 * layer + head) % 3
            scale = rng.uniform(0.5, 1.5)
            profile = np.zeros(STRIDE)
            if group == 0:
                profile[0] = -scale
            elif group == 1:
                profile[2] = -scale
            elif flat == "uniform":  # hurts every phase alike: a flat shape, not a small one
                profile[:] = -0.6 * scale
            profile = profile + rng.normal(0, noise, STRIDE)
            for phase in range(STRIDE):
                rows.append((layer, head, phase, profile[phase], group))
    return pd.DataFrame(rows, columns=["layer", "head", "phase", "effect", "group"])


@pytest.mark.parametrize("flat", ["zero", "uniform"])
def test_cluster_heads_recovers_planted_groups(flat):
    df = planted_effects(flat)
    truth = df.groupby(["layer", "head"])["group"].first().to_numpy()
    res = cluster_heads(df.drop(columns="group"))
    assert isinstance(res, HeadClusters)
    assert res.k == 3
    assert res.silhouette["score"].idxmax() == res.silhouette.index[res.silhouette.k == 3][0]
    labels = res.labels.sort_values(["layer", "head"])
    clusters = labels["cluster"].to_numpy()
    for g in range(3):
        assert len(set(clusters[truth == g])) == 1, f"group {g} split: {clusters}"
    assert len(set(clusters)) == 3
    name_of = {g: res.names[int(clusters[truth == g][0])] for g in range(3)}
    assert name_of == {0: "phase 0", 1: "phase 2", 2: "flat"}
    assert (labels["name"].to_numpy() == [name_of[g] for g in truth]).all()
    assert (labels.loc[truth == 0, "peak_phase"] == 0).all()
    assert (labels.loc[truth == 1, "peak_phase"] == 2).all()
    assert list(res.centroids.columns) == list(range(STRIDE))
    assert res.centroids.shape == (3, STRIDE)
    assert {f"phase_{p}" for p in range(STRIDE)} <= set(res.labels.columns)


def test_cluster_heads_names_runs_of_phases():
    # one group serving phases 2-3, one serving phase 0: names must give the run "2-3"
    rows = []
    for head in range(6):
        prof = [-1.0, 0, 0, 0] if head % 2 else [0, 0, -1.0, -0.9]
        prof = np.array(prof) + 0.01 * head
        rows += [(0, head, p, prof[p]) for p in range(STRIDE)]
    res = cluster_heads(pd.DataFrame(rows, columns=["layer", "unit", "phase", "effect"]))
    assert res.k == 2
    assert sorted(res.names.values()) == ["phase 0", "phase 2-3"]
    assert "unit" in res.labels.columns  # the input's name for the head axis is kept


def test_cluster_heads_deterministic_by_seed():
    # unstructured profiles: many local optima, so only the seed makes the result repeatable
    rng = np.random.default_rng(1)
    rows = [
        (layer, head, p, rng.normal()) for layer in range(5) for head in range(6) for p in range(6)
    ]
    df = pd.DataFrame(rows, columns=["layer", "head", "phase", "effect"])
    a = cluster_heads(df, k_range=(5, 5), seed=3, center=False)
    b = cluster_heads(df, k_range=(5, 5), seed=3, center=False)
    pd.testing.assert_frame_equal(a.labels, b.labels)
    pd.testing.assert_frame_equal(a.centroids, b.centroids)
    assert a.names == b.names
    assert "weak structure" in a.note


def test_cluster_heads_single_cluster_cases():
    df = planted_effects()
    two = df[(df.layer == 0) & (df["head"] < 2)].drop(columns="group")
    res = cluster_heads(two)
    assert res.k == 1 and "too few" in res.note
    assert (res.labels["cluster"] == 0).all()
    same = df.drop(columns="group").assign(effect=lambda d: -1.0 * (d.phase == 1))
    res = cluster_heads(same)
    assert res.k == 1 and "identical" in res.note
    assert res.names == {0: "phase 1"}
    zeros = df.drop(columns="group").assign(effect=0.0)
    res = cluster_heads(zeros)
    assert res.k == 1 and res.names == {0: "flat"} and res.labels["peak_phase"].isna().all()


def test_cluster_heads_zero_rows_stay_zero():
    # noise-free planted heads: the "flat" group is exactly zero, the others unit-norm shapes;
    # with no norm floor the zero rows must stay at the origin (no 0/0)
    df = planted_effects(noise=0.0)
    zero = (df.groupby(["layer", "head"])["group"].first() == 2).to_numpy()
    res = cluster_heads(df.drop(columns="group"), min_norm=0.0)
    prof = res.labels[[f"phase_{p}" for p in range(STRIDE)]].to_numpy()
    assert np.isfinite(prof).all()
    assert (prof[zero] == 0).all()
    assert np.linalg.norm(prof[~zero], axis=1) == pytest.approx(1.0)
    assert res.k == 3 and sorted(res.names.values()) == ["flat", "phase 0", "phase 2"]


def test_cluster_heads_rejects_bad_input():
    df = planted_effects().drop(columns="group")
    with pytest.raises(ValueError, match=r"\['phase'\] are missing"):
        cluster_heads(df.drop(columns="phase"))
    with pytest.raises(ValueError, match="value='score'"):
        cluster_heads(df, value="score")
    two = pd.concat([df.assign(component="attn"), df.assign(component="mlp")])
    two["component"] = two["component"].astype("category")  # as ablation frames store it
    with pytest.raises(ValueError, match=r"several values: 'component' \(2: 'attn', 'mlp'\)"):
        cluster_heads(two)
    assert cluster_heads(two[two.component == "attn"]).k == 3  # filtered: fine
    with pytest.raises(ValueError, match=r"repeat a \(layer, head, phase\).*differ in \['shift'\]"):
        cluster_heads(pd.concat([df.assign(shift=0), df.assign(shift=1)]))
    for bad in [(1, 3), (4, 2), (2,), (2.0, 3), "23"]:
        with pytest.raises(ValueError, match=r"k_range=.* is invalid"):
            cluster_heads(df, k_range=bad)
    with pytest.raises(ValueError, match=r"phases \[3\]"):
        cluster_heads(df[~((df.layer == 1) & (df["head"] == 2) & (df.phase == 3))])
    with pytest.raises(ValueError, match="non-finite"):
        cluster_heads(df.assign(effect=df.effect.where(df.phase != 1)))


# --------------------------------------------------------------------------- phase_probe

N_SEQ = 60
PROBE = dict(max_rows=2000, cv=5, seed=0)


@pytest.fixture(scope="module")
def toks():
    return tokens(batch=N_SEQ, seq=N_CTX, seed=1)


@pytest.fixture(scope="module")
def dense_model():
    return make_model("none")


def _row(res: ProbeResult, site: str, label: str) -> pd.Series:
    hit = res.frame[(res.frame.site == site) & (res.frame.label == label)]
    assert len(hit) == 1, f"no row for {site}/{label}"
    return hit.iloc[0]


def _at_chance(row: pd.Series) -> bool:
    return row.p_value > 1e-3 and row.accuracy < row.chance + 0.1


def test_dense_model_phase_at_chance_position_decodable(dense_model, toks):
    res = phase_probe(dense_model, toks, stride=STRIDE, **PROBE)
    assert list(res.frame.site.unique()) == ["resid_pre.0", "resid_pre.1", "resid_post.1"]
    assert res.frame.layer.tolist() == [0, 0, 1, 1, 2, 2]
    assert not res.frame.after_compressed.any()
    # random grid shifts decouple phase from position: nothing in a dense model carries it
    for site in res.frame.site.unique():
        assert _at_chance(_row(res, site, "phase")), res.frame
    # ... while standard positional embeddings make pos mod d plainly decodable
    ctrl = _row(res, "resid_pre.0", "pos_mod_d")
    assert ctrl.accuracy > 0.5 and ctrl.p_value < 1e-20
    assert (res.frame.chance >= 1 / STRIDE).all() and (res.frame.chance < 0.3).all()
    assert (res.frame.n == PROBE["max_rows"]).all()


def test_fixed_grid_confounds_phase_with_position(dense_model, toks):
    # without the shift, phase is a relabelled pos mod d: decoded exactly as well
    # positions 10..39: residues 2 and 3 occur 8 times, 0 and 1 seven: guessing the commonest
    # residue scores 8/30, so that (not 1/4) is chance
    pos = list(range(10, 40))
    res = phase_probe(
        dense_model, toks, stride=STRIDE, random_grid=False, layers=[0], positions=pos, **PROBE
    )
    assert res.frame.site.tolist() == ["resid_pre.0"] * 2 + ["resid_post.1"] * 2
    assert (res.frame.n == N_SEQ * len(pos)).all()  # under max_rows: every row kept
    assert res.frame.chance.to_numpy() == pytest.approx(8 / 30)
    phase, ctrl = _row(res, "resid_pre.0", "phase"), _row(res, "resid_pre.0", "pos_mod_d")
    assert phase.accuracy == pytest.approx(ctrl.accuracy)
    assert phase.accuracy > 0.5 and phase.p_value < 1e-20


@pytest.fixture(scope="module")
def hooked_result(toks):
    """A model whose only compressed layer (0) writes its token's phase into the stream.

    The phase is taken from the layer's own ``hook_grid_offset`` (what the grid really was in
    that forward), not from the probe's labels: the probe passes only if the shifts it draws
    reach the model and its labels use the same shifts. Left in train mode with random
    offsets: a probe that forgot ``eval()`` would see offsets it did not draw.
    """
    model = make_model("mean", stride=STRIDE, layers=(0,), offsets="random", eval_offset=1)
    model.train()
    vecs = torch.randn(STRIDE, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    state: dict[str, torch.Tensor] = {}

    def grab(offsets, hook):
        state["offset"] = offsets[:, 0].clone()  # [batch]; aligned grid: same for every head

    def write_phase(resid, hook):
        pos = torch.arange(resid.shape[1], device=resid.device)
        phase = torch.remainder(pos[None, :] - state["offset"][:, None], STRIDE)
        return resid + 2.0 * vecs[phase]

    hooks = [("blocks.0.attn.hook_grid_offset", grab), ("blocks.0.hook_resid_post", write_phase)]
    with model.hooks(fwd_hooks=hooks):
        res = phase_probe(model, toks, batch_size=16, **PROBE)  # 4 forwards, the last partial
    return model, res


def test_probe_reads_phase_written_by_compressed_layer(hooked_result):
    model, res = hooked_result
    assert model.training  # restored
    assert res.stride == STRIDE and res.grid_offset == 1 and res.random_grid
    assert res.frame.after_compressed.tolist() == [False, False, True, True, True, True]
    assert _at_chance(_row(res, "resid_pre.0", "phase"))
    for site in ("resid_pre.1", "resid_post.1"):
        row = _row(res, site, "phase")
        assert row.accuracy > 0.95 and row.p_value < 1e-50, res.frame


def test_probe_result_save_and_table(hooked_result, tmp_path):
    _, res = hooked_result
    path = res.save(tmp_path / "sub" / "probe.parquet")
    back = pd.read_parquet(path)
    pd.testing.assert_frame_equal(back, res.frame)
    assert back.attrs == {"stride": STRIDE, "grid_offset": 1, "random_grid": True}
    table = res.table()
    assert list(table.index) == ["resid_pre.0", "resid_pre.1", "resid_post.1"]
    assert table.loc["resid_post.1", "phase"] == _row(res, "resid_post.1", "phase").accuracy


def test_cross_validation_keeps_sequences_whole():
    # every row of a sequence shares its features and a random label: memorising the sequence
    # would score ~1 if its rows sat in train and test; grouped folds leave only chance
    rng = np.random.default_rng(0)
    n_seq, rows_per_seq = 60, 8
    groups = rng.permutation(np.repeat(np.arange(n_seq), rows_per_seq))  # rows interleaved
    x = rng.normal(size=(n_seq, 32))[groups]
    y = rng.integers(0, STRIDE, n_seq)[groups]
    acc, std, hits = grouped_cross_validate(x, y, groups, 5)
    assert acc < 0.45 and std > 0
    assert hits == pytest.approx(acc * len(y), abs=0.02 * len(y))


def test_probe_rejects_bad_input(dense_model, toks):
    cases = [
        (dict(), r"stride=None is invalid for a dense model.*pass stride="),
        (dict(stride=0), r"stride=0 is invalid"),
        (dict(stride=1), r"stride=1 is invalid"),
        (dict(stride=STRIDE, cv=1), r"cv=1 is invalid"),
        (dict(stride=STRIDE, layers=[0, 5]), r"layers \[5\] do not exist"),
        (dict(stride=STRIDE, layers=[-1]), r"layers \[-1\] do not exist"),
        (dict(stride=STRIDE, positions=[3, 48]), r"positions \[48\] do not exist"),
        (dict(stride=STRIDE, positions=[1, 5, 9]), r"cover one residue"),
        (dict(stride=STRIDE, grid_offset=4), r"grid_offset=4 is invalid"),
        (dict(stride=STRIDE, max_rows=3), r"max_rows=3 keeps rows of 3 sequences"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            phase_probe(dense_model, toks, **kwargs)
    with pytest.raises(ValueError, match=r"4 sequences: cv=5"):
        phase_probe(dense_model, toks[:4], stride=STRIDE)
    with pytest.raises(ValueError, match=r"need \[batch, pos\]"):
        phase_probe(dense_model, toks[0], stride=STRIDE)


def test_cluster_heads_centering_separates_uniform_from_phase_specific_heads():
    # 4 heads hurt every phase equally (large), 3 serve phase 1, 3 serve phase 3 (smaller)
    rng = np.random.default_rng(0)
    rows = []
    for head in range(10):
        for p in range(4):
            if head < 4:
                e = -0.8
            elif head < 7:
                e = -0.3 if p == 1 else 0.0
            else:
                e = -0.3 if p == 3 else 0.0
            rows.append((0, head, p, e + rng.normal(0, 0.005)))
    df = pd.DataFrame(rows, columns=["layer", "head", "phase", "effect"])
    centered = cluster_heads(df, seed=0)
    names = centered.labels.set_index("head")["name"]
    assert set(names[:4]) == {"flat"}
    assert set(names[4:7]) == {"phase 1"} and set(names[7:]) == {"phase 3"}
    # centred profiles: a uniform head's row is ~0 (its mean removed)
    uniform = centered.labels.set_index("head").loc[0, [f"phase_{p}" for p in range(4)]]
    assert np.abs(uniform.to_numpy(float)).max() < 0.05
