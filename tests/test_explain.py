"""``phasemech explain``: the lab's engines on real-model prompts (the adapter), the selection
oracle, and every step's job on tiny rotary GQA models (the pipeline end to end on SmolLM2 is
``tests/test_probe.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import make_hooked, tokens

from phasemech import CompressionConfig, PhaseTransformer
from phasemech.interventions.oracle import Force, force_needle, needle_selection
from phasemech.interventions.patching_fast import patch_heads, zero_source
from phasemech.interventions.prompt_patching import ablate_prompt, patch_pair
from phasemech.interventions.prompts import bound, prompt_run, score, self_contrast
from phasemech.model.decode import read_rows

torch.set_num_threads(1)


def _batch(shift: int = 1, seq: int = 48, answer_start: int = 44, needle: int = 10):
    """Two prompts of one content, the second moved right by ``shift`` tokens (a prefix)."""
    x = tokens(1, seq, seed=1)[0]
    rows, seqs = [], []
    for k in (0, shift):
        seqs.append(torch.cat([x[:k], x]))
        rows.append(
            dict(
                prompt_id=len(rows),
                group_id=0,
                prefix=k,
                depth=0.3,
                needle_pos=needle + k,
                phase=(needle + k) % 4,
                question_start=answer_start - 8 + k,
                answer_start=answer_start + k,
            )
        )
    width = max(len(s) for s in seqs)
    toks = torch.zeros(2, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
    answer = torch.stack([x[answer_start : answer_start + 3]] * 2)
    return SimpleNamespace(tokens=toks, answer=answer, frame=pd.DataFrame(rows))


def _models(design="route", **kw):
    tl = make_hooked(rotary=True, gqa=True, n_layers=3, attn_only=False)
    comp = CompressionConfig(design, **(dict(stride=4, window=3, top_k=1) | kw))
    return tl, PhaseTransformer.from_hooked(tl, comp).eval()


def _margin(logits: torch.Tensor, answer: int) -> float:
    logits = logits.detach()
    other = logits.clone()
    other[answer] = -torch.inf
    return float(logits[answer] - other.max())


def test_bound_prefill_zero_ablation_equals_hooked_reads():
    """Zero ablation through patch_heads (delta trick, copies over a bound prefill) equals
    the decode read with the head's output zeroed by a hook."""
    tl, model = _models()
    run = prompt_run(tl, _batch(), 0, "decode")
    with bound(model, run):
        res = patch_heads(model, self_contrast(run, 4), metric="margin", source=zero_source)
    for layer in range(3):
        for h in range(model.cfg.n_heads):

            def zero(z, hook, h=h):
                z = z.clone()
                z[:, :, h] = 0
                return z

            with torch.inference_mode(), model.hooks([(f"blocks.{layer}.attn.hook_z", zero)]):
                resid = read_rows(model, run.cache, run.tokens)
            want = _margin(model.unembed(model.ln_final(resid))[0, run.row], int(run.answer[0]))
            assert res.values[layer, 0, h, 0] == pytest.approx(want, abs=1e-4)
    assert score(model, run)["margin"] == pytest.approx(float(res.corrupted[0]), abs=1e-5)


def _llama():
    """A tiny llama-shaped TransformerLens model: RMSNorm, gated SiLU MLP, rotary, GQA."""
    return make_hooked(rotary=True, gqa=True, n_layers=3, attn_only=False,
                       normalization_type="RMS", gated_mlp=True, act_fn="silu")  # fmt: skip


@pytest.mark.parametrize("wrapped", [False, True])
def test_head_patching_without_compression_equals_transformer_lens(wrapped):
    """With compression off (the plain llama-shaped model, or phasemech's with design
    ``none``; trained regime, prompts of equal length) the adapter's head patching equals
    TransformerLens' get_act_patch_attn_head_out_all_pos on the plain model."""
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    tl = _llama()
    model = PhaseTransformer.from_hooked(tl, CompressionConfig("none")).eval() if wrapped else tl
    batch = _batch(shift=0)
    batch.tokens[1, 20] = (batch.tokens[1, 20] + 7) % tl.cfg.d_vocab  # corrupt a mid token
    clean, corrupt = (prompt_run(tl, batch, i, "trained") for i in (0, 1))
    got = patch_pair(model, clean, corrupt, 4, atp=False)
    answer, foil = int(corrupt.answer[0]), got["foil"]

    def metric(logits):
        row = logits[0, corrupt.row]
        return row[answer] - row[foil]

    with torch.inference_mode():
        _, cache = tl.run_with_cache(clean.tokens)
        want = get_act_patch_attn_head_out_all_pos(tl, corrupt.tokens, cache, metric)
    assert want.abs().max() > 1e-3  # the corruption moves the metric: the check can fail
    np.testing.assert_allclose(np.array(got["heads"]), want.numpy(), atol=1e-4)
    with torch.inference_mode():
        assert got["clean"] == pytest.approx(float(metric(tl(clean.tokens))), abs=1e-4)
    # the whole residual entering layer 0 is the clean run: patching it restores the clean metric
    assert got["resid"][0] == pytest.approx(got["clean"], abs=1e-4)


def test_cross_prompt_head_patching_in_decode_equals_hooked_reads():
    """Decode regime, compressed: each head's patch from the other prompt (its prefill its
    own, rows aligned from the end) equals a plain decode read of the corrupted prompt with
    that head's ``z`` overwritten by a hook with the clean read's ``z``."""
    tl, model = _models()
    batch = _batch(shift=1)
    batch.tokens[0, 30] = (batch.tokens[0, 30] + 5) % tl.cfg.d_vocab  # contents differ a bit
    clean, corrupt = (prompt_run(tl, batch, i, "decode") for i in (0, 1))
    got = patch_pair(model, clean, corrupt, 4, atp=False)
    answer, foil = int(corrupt.answer[0]), got["foil"]
    zs: dict[str, torch.Tensor] = {}
    names = [f"blocks.{i}.attn.hook_z" for i in range(3)]

    def keep(z, hook):
        zs[hook.name] = z.clone()

    with torch.inference_mode(), model.hooks([(n, keep) for n in names]):
        read_rows(model, clean.cache, clean.tokens)
    assert clean.tokens.shape == corrupt.tokens.shape  # the same question and answer rows
    spread = []
    for layer, name in enumerate(names):
        for h in range(model.cfg.n_heads):

            def put(z, hook, h=h, name=name):
                z = z.clone()
                z[:, :, h] = zs[name][:, :, h]
                return z

            with torch.inference_mode(), model.hooks([(name, put)]):
                resid = read_rows(model, corrupt.cache, corrupt.tokens)
                row = model.unembed(model.ln_final(resid))[0, corrupt.row]
            want = float(row[answer] - row[foil])
            assert got["heads"][layer][h] == pytest.approx(want, abs=1e-4)
            spread.append(want)
    assert max(spread) - min(spread) > 1e-3  # the patches differ: the check can fail


def test_aligned_keeps_the_sink_row_of_whole_prompts():
    """Rows align from the end; prompts of different lengths keep row 0 (the sink) their own."""
    from phasemech.interventions.prompts import aligned

    clean = torch.arange(5.0)[None, :, None] + 100
    corrupt = torch.arange(3.0)[None, :, None]
    assert aligned(clean, corrupt).flatten().tolist() == [0.0, 103.0, 104.0]
    assert aligned(corrupt + 100, clean - 100).flatten().tolist() == [0, 1, 100, 101, 102]
    assert aligned(clean, clean - 100).flatten().tolist() == (clean.flatten()).tolist()


@pytest.mark.parametrize("regime", ["decode", "trained"])
def test_forcing_a_kept_block_changes_nothing(regime):
    """Forcing the needle's block where the design already keeps it (one answer token: one
    answer row) adds or displaces nothing and leaves the answer as it was."""
    tl, model = _models(top_k=6)
    batch = _batch()
    batch.answer = batch.answer[:, :1]
    run = prompt_run(tl, batch, 0, regime)
    sel = needle_selection(model, run)
    kept = sel[sel.selected]
    assert 0 < len(kept) < len(sel) and (kept["rank"] <= 6).all()
    units = tuple(zip(kept.layer.tolist(), kept["head"].tolist(), strict=True))
    forces = [Force("add", "answer", (), "none")] + [
        Force(f, "answer", units, "kept") for f in ("add", "replace")
    ]
    got = force_needle(model, run, forces)
    assert (got.forced == 0).all() and (got.displaced == 0).all()
    np.testing.assert_allclose(got.margin, got.margin[0], atol=1e-6)
    others = tuple(
        (i, h) for i, h in zip(sel.layer, sel["head"], strict=True) if (i, h) not in units
    )
    assert int(force_needle(model, run, [Force("add", "answer", others)]).forced[0]) > 0


def test_forcing_every_candidate_is_dense_attention():
    """Decode regime: every candidate of route kept at every row = the dense model's read."""
    tl, model = _models()
    run = prompt_run(tl, _batch(), 0, "decode")
    units = tuple((i, h) for i in range(3) for h in range(model.cfg.n_heads))
    got = force_needle(model, run, [Force("every", "after", units, "all")])
    with torch.inference_mode(), bound(tl, run):
        dense = tl(run.tokens)[0, run.row]
    assert got.margin[0] == pytest.approx(_margin(dense, int(run.answer[0])), abs=1e-4)
    assert score(model, run)["margin"] != pytest.approx(got.margin[0], abs=1e-3)  # it bites


def test_replace_keeps_the_budget_and_reaches_the_needle():
    """``replace`` puts the needle's block in place of one pick: the kept count is unchanged
    and the needle's block is then read at the answer row."""
    tl, model = _models()
    run = prompt_run(tl, _batch(), 0, "decode")
    base = needle_selection(model, run)
    assert not base.selected.all()  # top-1 misses the needle somewhere
    kept: dict = {}

    def grab(mask, hook):
        kept[hook.name] = mask[0, :, run.row].clone()

    units = tuple((i, h) for i in range(3) for h in range(model.cfg.n_heads))
    names = [(f"blocks.{i}.attn.hook_route_selected", grab) for i in range(3)]
    with model.hooks(fwd_hooks=names):  # runs after force's hook: sees the forced sets
        got = force_needle(model, run, [Force("replace", "answer", units, "all")])
    assert int(got.displaced[0]) == int(got.forced[0]) > 0
    for i in range(3):
        assert (
            kept[f"blocks.{i}.attn.hook_route_selected"].sum(-1)
            == torch.tensor(base[base.layer == i].kept.tolist())
        ).all()


def test_ablation_and_patching_rows_are_complete():
    tl, model = _models()
    batch = _batch()
    a, b = (prompt_run(tl, batch, i, "decode") for i in (0, 1))
    abl = ablate_prompt(model, a, 4, torch.zeros(3, model.cfg.n_heads, model.cfg.d_head))
    # mean ablation with zero means is zero ablation
    np.testing.assert_allclose(abl["zero"], abl["mean"], atol=1e-6)
    got = patch_pair(model, a, b, 4)
    assert np.array(got["heads"]).shape == np.array(got["atp"]).shape == (3, model.cfg.n_heads)
    assert len(got["selection"]) == 3 and np.isfinite(got["selection_all"])
    assert len(got["resid"]) == 3 and got["resid"][0] == pytest.approx(got["corrupted"], abs=1e-5)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(design="mean", analyses=("selection",)), "selects no blocks"),
        (dict(contrast_phases=(1, 1)), "contrast_phases"),
        (dict(contrast_phases=(0, 4)), "contrast_phases"),
        (dict(analyses=("probes",)), "analyses"),
        (dict(top_heads=0), "top_heads"),
        (dict(n_perm="many"), "n_perm"),
        (dict(auto_perm="yes"), "auto_perm"),
        (dict(design="nsa"), "designs"),
    ],
)
def test_config_refuses_bad_input(kw, match):
    from phasemech.experiments.explain.config import ExplainConfig

    with pytest.raises(ValueError, match=match) as err:
        ExplainConfig.of(**kw)
    assert "\n" not in str(err.value)


def test_cli_takes_the_audits_grid_and_task_flags(tmp_path, monkeypatch):
    """``explain`` takes the audit's probe flags (one set of options): offsets, block length,
    depths, distractors and the sink reach its probe; an aligned grid without a sink keeps the
    cache key of runs recorded before ``offsets`` and ``sink_tokens`` existed."""
    from typer.testing import CliRunner

    import phasemech.experiments.explain.run as explain_run
    from phasemech.cli import app
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.jobs import ExplainJob

    seen = {}

    def fake(cfg, out, **kw):
        seen["cfg"] = cfg
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.md").write_text("ok")
        return {"wall_s": 0.0}

    monkeypatch.setattr(explain_run, "run_explain", fake)
    args = ["explain", "--design", "route", "-o", str(tmp_path / "x"), "--offsets", "per_head",
            "--block-len", "4", "--depths", "0.2,0.8", "--task", "multikey", "--distractors",
            "2", "--analyses", "selection", "--sink-tokens", "4"]  # fmt: skip
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    p = seen["cfg"].probe
    assert (p.offsets, p.block_len, p.depths, p.task, p.distractors, p.sink_tokens) == (
        "per_head", 4, (0.2, 0.8), "multikey", 2, 4)  # fmt: skip
    assert seen["cfg"].setting == "route_d4_w16_k1_s4_per_head"
    assert "offsets" in ExplainJob(seen["cfg"], "observe", (0,)).config["cfg"]
    aligned = ExplainJob(ExplainConfig(), "observe", (0,))
    assert "offsets" not in aligned.config["cfg"] and "sink_tokens" not in aligned.config["cfg"]
    assert aligned.key == "8dfc3256bce45568"  # as before the fields
    bad = CliRunner().invoke(app, [*args[:5], "--offsets", "diagonal"], env={"COLUMNS": "500"})
    lines = [ln for ln in bad.output.splitlines() if ln.strip()]
    assert bad.exit_code == 1 and len(lines) == 1 and "offsets='diagonal'" in lines[0]
    two = CliRunner().invoke(app, [*args[:5], "--context", "512,1024"], env={"COLUMNS": "500"})
    assert two.exit_code == 1 and "one design at one context" in two.output


def test_no_gap_and_no_clean_prompt_are_refused():
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.jobs import contrast_phases
    from phasemech.experiments.explain.run import contrast_pairs

    cfg = ExplainConfig()
    with pytest.raises(ValueError, match="no gap") as err:
        contrast_phases(cfg, np.array([0.5, 0.5, 0.5, 0.5]))
    assert "\n" not in str(err.value)
    assert contrast_phases(cfg, np.array([0.7, 0.3, 0.6, 0.75])) == (3, 1)
    prompts = pd.DataFrame(
        dict(
            prompt_id=range(4),
            group_id=0,
            phase=range(4),
            design_correct=[False, False, True, True],
            design_first_correct=[True, True, True, False],
        )
    )
    prompts.loc[2, "design_correct"] = False
    with pytest.raises(ValueError, match="no content is answered right at phase 3") as err:
        contrast_pairs(cfg, prompts)
    assert "\n" not in str(err.value)


def test_explain_jobs_on_a_tiny_model(tmp_path, monkeypatch):
    """Every step's job, in process on a tiny model: observe feeds the mean ablation's means,
    intervene ablates every head on each prompt and patches the pair, heads forces the top
    heads; the ablation tables follow."""
    import phasemech.experiments.explain.jobs as ex
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.tables import ablation_tables, patching_table

    tl, model = _models()
    batch = _batch()
    monkeypatch.setattr(ex, "explain_models", lambda cfg: (tl, model, batch))
    cfg = ExplainConfig.of(contents=1, per_layer_oracle=True, n_boot=20, n_perm=20)
    obs = ex.ExplainJob(cfg, "observe", (0, 1)).run(tmp_path)["prompts"]
    assert len(obs[0]["oracle"]) == 1 + 4 + 2 * 3  # none, all x 4 forms, per layer x 2
    means = (sum(np.array(p["z_sums"]) for p in obs) / sum(p["z_rows"] for p in obs)).tolist()
    res = ex.ExplainJob(cfg, "intervene", (0, 1), pairs=((0, 1),), means=means).run(tmp_path)
    h = model.cfg.n_heads
    assert np.array(res["prompts"][0]["ablation"]["mean"]).shape == (3, h)
    effects, spec = ablation_tables(res["prompts"], cfg, 3, h, 20, 0, 20)
    assert set(effects["mode"]) == {"zero", "mean"} and len(spec) == 2 * 2 * 3 * h
    table = patching_table(res["pairs"], 20, 0)
    assert set(table.site) == {"head", "resid", "selection", "atp"}
    att = ex.ExplainJob(cfg, "attend", (0,)).run(tmp_path)["prompts"][0]["attention"]
    assert len(att) == 2 * 3 * h
    top = ex.ExplainJob(cfg, "heads", (0,), units=((1, 0),)).run(tmp_path)["prompts"][0]
    assert {o["scope"] for o in top["oracle"]} == {"top heads"} and len(top["oracle"]) == 4


def test_ablation_tables_are_the_labs_effects_and_specialization():
    """Per-prompt margins become the lab's effects (accuracy = margin > 0) and its
    specialisation test; a head that only hurts phase 2 is found serving phase 2."""
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.tables import ablation_tables

    rng = np.random.default_rng(0)
    items = []
    for g in range(12):
        for phase in range(4):
            zero = rng.normal(1.0, 0.1, (2, 3))
            zero[1, 2] = -1.0 if phase == 2 else 1.0  # layer 1, head 2 serves phase 2
            meta = dict(prompt_id=4 * g + phase, group_id=g, prefix=phase, depth=0.5,
                        needle_pos=100 + phase, phase=phase)  # fmt: skip
            items.append({"prompt": meta, "ablation": {"base": 1.0, "zero": zero.tolist()}})
    effects, spec = ablation_tables(items, ExplainConfig(), 2, 3, 50, 0, 200)
    assert len(effects) == 1 * 6 * 2 * 4 and set(effects["mode"]) == {"zero"}
    acc = effects[(effects.metric == "accuracy") & (effects.layer == 1) & (effects.unit == 2)]
    assert acc.set_index("phase").effect.to_dict() == {0: 0.0, 1: 0.0, 2: -1.0, 3: 0.0}
    top = spec[spec.metric == "accuracy"].sort_values("rank").iloc[0]
    assert (top.layer, top.unit, top.served_phase) == (1, 2, 2) and top.p_perm < 0.05


def test_copying_a_prompts_own_selection_changes_nothing():
    """The selection site with clean = corrupted (same prompt) is the unpatched run in every
    copy; the per-layer sites are filled for the selecting layers only."""
    from phasemech.interventions.oracle import copy_selection

    tl, model = _models()
    run = prompt_run(tl, _batch(), 1, "decode")
    labels, logits, kept = copy_selection(model, run, run)
    assert labels == ["layer 0", "layer 1", "layer 2", "all"]
    with torch.inference_mode(), bound(model, run):
        want = model(run.tokens)[0, run.row]
    for lg in logits:
        torch.testing.assert_close(lg, want.float(), atol=1e-5, rtol=1e-5)
    assert (kept > 1).all()  # the forced own block and the top-1 pick, at least


def test_a_copied_pick_covers_every_token_the_clean_query_read():
    """Grids do not line up across phases: clean block 2 (tokens 4-7, offset 0) moved right by
    one token is corrupted blocks 2 and 3; the sink's block keeps token 0's block."""
    from phasemech.interventions.oracle import map_kept_set, position_map

    clean = SimpleNamespace(meta={"prefix": 0})
    corrupt = SimpleNamespace(meta={"prefix": 1})
    kept = torch.zeros(2, 3, 6, dtype=torch.bool)  # [head, row, block]
    kept[0, 2, 2] = True  # head 0, last row: tokens 4..7 -> 5..8
    kept[1, 1, 1] = True  # head 1: block 1 holds tokens 0..3 -> 0, 2, 3, 4
    zero = torch.zeros(1, dtype=torch.long)
    out, has = map_kept_set(kept, zero, zero, position_map(clean, corrupt), 4, (4, 7))
    assert has.tolist() == [False, True, True, True]  # rows aligned from the end
    assert out[0, 3].nonzero().flatten().tolist() == [2, 3]
    assert out[1, 2].nonzero().flatten().tolist() == [1, 2]
    assert out.sum() == 4
