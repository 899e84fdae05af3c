"""The selection's decomposition (``phasemech.interventions.decompose``): every design's terms
sum to its own block score, slots and phases are booked right, bad input is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch
from test_explain import _batch, _models

from phasemech.interventions.decompose import DESIGNS, captured_inputs, decompose, slot_terms
from phasemech.interventions.prompts import prompt_run
from phasemech.model.decode import needed_queries

torch.set_num_threads(1)


def _run(design: str, regime: str = "decode", i: int = 1, **kw):
    kw = (dict(obs_window=4) if design == "evict" else {}) | kw
    tl, model = _models(design, **kw)
    return model, prompt_run(tl, _batch(), i, regime, keep_queries=needed_queries(model))


@pytest.mark.parametrize("regime", ["decode", "trained"])
@pytest.mark.parametrize("design", DESIGNS)
def test_terms_sum_to_the_engines_own_gate(design, regime):
    """The float64 sum of the slot terms is the gate the engine ranked (float32, hooked), and
    each rule's terms have its shape: route's are ``q . k / l``, kpool's one best token, quest's
    at least any token's ``q . k`` (a bound), evict's non-negative attention."""
    model, run = _run(design, regime)
    df = decompose(model, run)
    blocks = df.drop_duplicates(["layer", "head", "role"])
    ranked = blocks[np.isfinite(blocks.gate)]
    assert len(ranked) > 0
    np.testing.assert_allclose(ranked.score, ranked.gate, rtol=1e-5, atol=1e-5)
    sums = df.groupby(["layer", "head", "role"]).term.sum()
    np.testing.assert_allclose(sums, df.groupby(["layer", "head", "role"]).score.first(),
                               atol=1e-12)  # fmt: skip
    real = df[df.valid]
    if design == "route":
        n = real.groupby(["layer", "head", "role"]).slot.transform("size")
        np.testing.assert_allclose(real.term, real.qk / n, atol=1e-12)
    if design == "kpool":
        by = real.groupby(["layer", "head", "role"])
        assert (by.term.apply(lambda t: int((t != 0).sum())) <= 1).all()
        np.testing.assert_allclose(by.term.sum(), by.qk.max(), atol=1e-12)
    if design == "quest":
        by = real.groupby(["layer", "head", "role"])
        assert (by.term.sum() >= by.qk.max() - 1e-12).all()
    if design == "evict":
        assert (df.term >= 0).all() and (df.term[~df.valid] == 0).all()


def test_quest_terms_go_to_the_token_holding_each_channels_extreme():
    """One block by hand (the layer's own grid): channel 0's max is token 5's, channel 1's
    min token 4's, so with ``q = (1, -1, 0..)`` token 4 gets 3 and token 5 gets 2."""
    model, run = _run("quest", "trained")
    store: dict = {}
    with torch.inference_mode(), captured_inputs(model, [0], store):
        model(run.tokens, stop_at_layer=1)
    geo, k0 = store[0]["geo"], store[0]["k"]
    k = torch.zeros(k0.shape, dtype=torch.float64)
    k[0, 4, :, :2] = torch.tensor([1.0, -3.0])
    k[0, 5, :, :2] = torch.tensor([2.0, 5.0])
    q = torch.zeros(store[0]["q"].shape, dtype=torch.float64)
    q[0, 20, :, :2] = torch.tensor([1.0, -1.0])
    terms = slot_terms(model.blocks[0].attn, q, 20, k, geo)
    j, s = (int(x) for x in (geo.slot_pos[0, 0] == 4).nonzero()[0])
    assert terms[:, j, s].tolist() == [3.0] * q.shape[2]
    assert terms[:, j, s + 1].tolist() == [2.0] * q.shape[2]
    assert terms[:, j].sum(-1).tolist() == [5.0] * q.shape[2]


def test_slots_and_phases_are_booked():
    """A slot's token is ``(block - 1) d + o + slot``; the needle's token sits in the needle
    block at ``needle_slot``; a prefix of one token moves the needle one slot on."""
    model, run0 = _run("route", i=0)
    _, run1 = _run("route", i=1)
    a, b = decompose(model, run0), decompose(model, run1)
    for df, run in ((a, run0), (b, run1)):
        mine = df[df.role == "needle"]
        assert (mine[mine.is_needle].slot == mine[mine.is_needle].needle_slot).all()
        assert set(mine[mine.is_needle].pos) == {run.needle}
        assert mine.groupby(["layer", "head"]).is_needle.sum().eq(1).all()
        starts = df.pos - df.slot
        assert (starts.groupby([df.layer, df["head"], df.role]).nunique() == 1).all()
        assert ((starts % 4) == (starts.iloc[0] % 4)).all()  # one grid
        sink = df[df.role == "sink"]
        assert (sink.pos == 0).groupby([sink.layer, sink["head"]]).any().all()
    ns = a.groupby(["layer", "head"]).needle_slot.first()
    ns1 = b.groupby(["layer", "head"]).needle_slot.first()
    assert ((ns + 1) % 4 == ns1).all()


def test_competitor_is_the_last_pick_or_the_runner_up():
    model, run = _run("route", top_k=2)
    df = decompose(model, run).drop_duplicates(["layer", "head", "role"])
    wide = df.pivot_table(index=["layer", "head"], columns="role", values="gate")
    head = df.drop_duplicates(["layer", "head"]).set_index(["layer", "head"])
    missed = ~head.selected & np.isfinite(wide.needle)
    assert missed.any()
    np.testing.assert_allclose(head.margin[missed], (wide.needle - wide.competitor)[missed],
                               atol=1e-6)  # fmt: skip
    kept = head.selected & np.isfinite(wide.needle)
    assert (wide.competitor[kept] <= wide.needle[kept] + 1e-6).all()


def test_bad_input_is_refused():
    tl, model = _models("mean", top_k=None)
    run = prompt_run(tl, _batch(), 0, "decode")
    with pytest.raises(ValueError, match="selects no blocks") as err:
        decompose(model, run)
    assert "\n" not in str(err.value)
    tl, model = _models("dsa")
    with pytest.raises(ValueError, match="design 'dsa' is invalid for the decomposition"):
        decompose(model, prompt_run(tl, _batch(), 0, "trained"))
    model, run = _run("route")
    late = dataclasses.replace(run, needle=run.offset + run.row + 1)
    with pytest.raises(ValueError, match="needle=.* is invalid"):
        decompose(model, late)


def test_the_explain_step_its_table_summary_and_page(tmp_path, monkeypatch):
    """The ``decompose`` job in process on a tiny model (two prompts of one content), its
    table, its summary section and its figure; the step leaves the other steps' keys alone."""
    import phasemech.experiments.explain.jobs as ex
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.sections import decomposition_findings, decomposition_lines
    from phasemech.experiments.explain.tables import attention_tables, decomposition_tables
    from phasemech.viz.explain import explain_figures

    tl, model = _models("route")
    batch = _batch()
    monkeypatch.setattr(ex, "explain_models", lambda cfg: (tl, model, batch))
    cfg = ExplainConfig.of(contents=1)
    assert "decompose" in cfg.analyses
    res = ex.ExplainJob(cfg, "decompose", (0, 1)).run(tmp_path)["prompts"]
    att = ex.ExplainJob(cfg, "attend", (0, 1)).run(tmp_path)["prompts"]
    t = attention_tables(att)
    t |= decomposition_tables(res, t["attention"])
    df = t["decomposition"]
    h = model.cfg.n_heads
    assert len(df.drop_duplicates(["prompt_id", "layer", "head"])) == 2 * 3 * h
    assert set(df.phase) == {2, 3} and set(df.role) <= {"needle", "competitor", "sink"}
    lines = "\n".join(decomposition_lines(t))
    assert "needle-reading heads | 2 |" in lines and "every head | 3 |" in lines
    found = decomposition_findings(t)["decomposition"]
    assert set(found) == {"needle_reading_heads", "every_head"}
    assert [r["phase"] for r in found["every_head"]] == [2, 3]
    prompts = pd.DataFrame(dict(phase=[2, 3], design_correct=[1, 0], null_correct=[1, 1]))
    assert "decomposition" in explain_figures(t | {"prompts": prompts})
    assert decomposition_tables([]) == {"decomposition": None, "decomposition_phases": None}
    plain = ExplainConfig.of(contents=1, analyses=("selection", "oracle", "ablation", "patching"))
    for step in ("observe", "attend"):
        assert ex.explain_jobs(cfg, step, [0])[0].key == ex.explain_jobs(plain, step, [0])[0].key
    assert (
        ex.explain_jobs(cfg, "decompose", [0])[0].key != ex.explain_jobs(cfg, "attend", [0])[0].key
    )
    with pytest.raises(ValueError, match=r"analyses \['decompose'\] are invalid for design"):
        ExplainConfig.of(design="mean", top_k=None, analyses=("decompose",))


# the step on SmolLM2 end to end (cached rerun, tables, summary, page):
# tests/test_explain_groups.py::test_group_step_end_to_end_adds_only_its_jobs
