"""The audit's fix variants: what each variant does to a design's grid, its KV budget, the
random offset's per-prompt draw (== an explicit offset, exactly), the paired comparison with
the aligned baseline and the frontier figure."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from phasemech.core.config import CompressionConfig
from phasemech.experiments.audit.config import AuditConfig
from phasemech.experiments.audit.fixes import (
    FIXES,
    apply_variant,
    drawn_grid_accuracy,
    fix_table,
    fixes_markdown,
)
from phasemech.experiments.probe.config import kv_budget, random_shift
from phasemech.viz.audit_fixes import frontier_figure

ROUTE = CompressionConfig("route", stride=4, window=16, top_k=2)


def test_variants_change_only_the_grid():
    assert apply_variant(ROUTE, "aligned") == ROUTE
    assert apply_variant(ROUTE, "per_head").offsets == "per_head"
    over = apply_variant(ROUTE, "overlap")
    assert (over.stride, over.block_len, over.top_k) == (4, 8, 2)
    half = apply_variant(ROUTE, "half_stride")
    assert (half.stride, half.block_len, half.top_k) == (2, 2, 4)  # no overlap at d/2
    assert apply_variant(ROUTE, "topk_x4").top_k == 8
    assert apply_variant(ROUTE, "before_window").block_scope == "before_window"
    with pytest.raises(ValueError, match="keeps no top-k"):
        apply_variant(CompressionConfig("mean", stride=4, window=16), "topk_x2")
    with pytest.raises(ValueError, match="block_len=8 is invalid"):
        apply_variant(CompressionConfig("kpool", stride=4, window=16, top_k=1), "overlap")


def test_budget_is_tokens_read_per_query():
    assert kv_budget(ROUTE, 1024) == 2 * 4 + 16
    assert kv_budget(apply_variant(ROUTE, "half_stride"), 1024) == 4 * 2 + 16  # equal budget
    assert kv_budget(apply_variant(ROUTE, "before_window"), 1024) == 2 * 4 + 16 + 3
    assert kv_budget(None, 1024) == 1024
    # mean: every block the last query uses, plus its raw band
    assert kv_budget(CompressionConfig("mean", stride=4, window=16), 64) == 12 + 16


def test_audit_variants_settings_and_bad_input():
    a = AuditConfig.of(designs=("route", "kpool", "mean"), contexts=(256,),
                    variants=("aligned", "overlap", "topk_x2"))  # fmt: skip
    names = [n for n, _ in a.settings()]
    assert names == ["null", "route_d4_w16_k8", "route_d4_w16_k8_overlap",
                     "route_d4_w16_k16_topk_x2", "kpool_d4_w16_k8", "kpool_d4_w16_k16_topk_x2",
                     "mean_d4_w16", "mean_d4_w16_overlap"]  # fmt: skip
    assert any(s.startswith("kpool/overlap:") for s in a.skipped())
    meta = a.setting_meta()
    assert meta["route_d4_w16_k8_overlap"]["budget"] == {256: 8 * 8 + 16}
    for bad, match in [
        (("per_head",), "'aligned' \\(the baseline\\) first"),
        (("aligned", "shuffle"), "variants=\\('aligned', 'shuffle'\\) is invalid"),
        (("aligned", "per_head", "per_head"), "each once"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            AuditConfig.of(variants=bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="apply to none of designs \\['mean'\\]"):
        AuditConfig.of(designs=("mean",), variants=("aligned", "topk_x2"))


def test_random_shift_is_seeded_and_uniform():
    draws = [random_shift(0, 1024, i, 4) for i in range(400)]
    assert draws == [random_shift(0, 1024, i, 4) for i in range(400)]
    assert np.bincount(draws, minlength=4).min() > 70  # every offset drawn, about evenly
    assert draws != [random_shift(1, 1024, i, 4) for i in range(400)]


@pytest.mark.parametrize("regime", ["trained", "decode"])
def test_random_offsets_score_as_the_drawn_explicit_offset(smollm, regime):
    """A setting with ``random`` offsets, given shift s, scores exactly as offsets = s."""
    from phasemech.data.retrieval import RetrievalTask, build_retrieval_prompts
    from phasemech.experiments.probe.worker import score_prompt
    from phasemech.model.transformer import PhaseTransformer

    batch = build_retrieval_prompts(smollm.tokenizer, RetrievalTask(context=128), 1, seed=0)
    layers = tuple(range(2, 30))
    comp = CompressionConfig("route", stride=4, window=8, top_k=1, layers=layers)

    def model(offsets):
        c = apply_variant(comp, "random") if offsets == "random" else comp
        c = c if offsets == "random" else CompressionConfig(**{**c.to_dict(), "offsets": offsets})
        return PhaseTransformer.from_hooked(smollm, c).eval()

    rnd = model("random")
    for shift in (1, 3):
        models = [("random", rnd), ("explicit", model(shift)), ("aligned", model(0))]
        rows, _ = score_prompt(smollm, models, batch, 1, regime, False, shift)
        assert rows[0]["grid_shift"] == shift and rows[1]["grid_shift"] == 0
        assert rows[0]["logprob"] == pytest.approx(rows[1]["logprob"], abs=1e-4)
        assert rows[0]["logprob"] != pytest.approx(rows[2]["logprob"], abs=1e-4)
        assert all(r["seconds"] > 0 for r in rows)


def _targets(acc_base: list[float], acc_fix: list[float], contents: int = 60) -> pd.DataFrame:
    """Synthetic paired targets: each content at every phase, correct with the given rates."""
    rng = np.random.default_rng(0)
    rows = []
    for setting, accs in (("route_d4_w16_k8", acc_base), ("route_d4_w16_k8_per_head", acc_fix)):
        for g in range(contents):
            for p, acc in enumerate(accs):
                rows.append(dict(context=256, setting=setting, group_id=g, needle_pos=100 + p,
                                 correct=bool(rng.random() < acc), seconds=0.1,
                                 grid_shift=0))  # fmt: skip
    return pd.DataFrame(rows)


def test_fix_table_pairs_each_fix_with_its_baseline():
    a = AuditConfig.of(designs=("route",), contexts=(256,), variants=("aligned", "per_head"),
                    n_boot=200)  # fmt: skip
    meta = a.setting_meta()
    cut = fix_table(a, _targets([1.0, 0.2, 1.0, 1.0], [0.6, 0.6, 0.6, 0.6]), meta)
    r = cut.iloc[0]
    assert (r.design, r.fix, r.budget, r.budget_baseline) == ("route", "per_head", 48, 48)
    assert r.gap_baseline > 0.6 and r.reduction > 0.7 and r.reduction_lo > 0
    assert r.accuracy_diff_hi < 0  # the flat fix costs accuracy: not the goal
    assert r.verdict == "cuts the gap, costs accuracy"
    good = fix_table(a, _targets([1.0, 0.2, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]), meta).iloc[0]
    assert good.accuracy_diff_lo > 0 and good.verdict == "meets the goal"
    same = fix_table(a, _targets([1.0, 0.2, 1.0, 1.0], [1.0, 0.2, 1.0, 1.0]), meta).iloc[0]
    assert same.verdict == "does not cut the gap enough" and abs(same.accuracy_diff) < 0.1
    floor = fix_table(a, _targets([0, 0, 0, 0], [0, 0, 0, 0]), meta).iloc[0]
    assert floor.verdict == "0 on every phase: no evidence"
    md = fixes_markdown(cut, drawn_grid_accuracy(a, _targets([1] * 4, [1] * 4), meta), ["x/y: z"])
    assert "| 256 | route | per_head:" in md and "Skipped" in md


def test_drawn_grid_phase_undoes_the_shift():
    a = AuditConfig.of(designs=("route",), contexts=(256,), variants=("aligned", "random"))
    t = pd.DataFrame(dict(context=256, setting="route_d4_w16_k8_random", group_id=0,
                          needle_pos=[8, 9, 10, 11], grid_shift=[1, 1, 2, 3],
                          correct=[True, False, False, False]))  # fmt: skip
    d = drawn_grid_accuracy(a, t, a.setting_meta())
    assert d.set_index("drawn_phase")["accuracy"].to_dict() == {3: 1.0, 0: 0.0}


def test_frontier_figure():
    rows = [dict(design=d, variant=v, budget=b, accuracy=acc, debiased_gap=g,
                 gap_lo=g - 0.1, gap_hi=g + 0.1)
            for d in ("route", "quest")
            for v, b, acc, g in (("aligned", 20, 0.2, 0.3), ("topk_x2", 24, 0.4, 0.2),
                                 ("per_head", 20, 0.3, 0.05))]  # fmt: skip
    fig = frontier_figure(pd.DataFrame(rows + [dict(rows[0], design="null")]), "t")
    names = {t.name for t in fig.data if t.name}
    assert names == {f"{d} / {v}" for d in ("route", "quest")
                     for v in ("aligned", "topk_x2", "per_head")}  # fmt: skip
    assert fig.layout.xaxis2.type == "log"
    with pytest.raises(ValueError, match="lacks columns \\['budget'\\]"):
        frontier_figure(pd.DataFrame(rows).drop(columns="budget"))


def test_cli_fix_option():
    from phasemech.cli import audit as cli_audit

    assert cli_audit._variants("all") == ("aligned", *FIXES)
    assert cli_audit._variants("per_head, random") == ("aligned", "per_head", "random")
    assert cli_audit._variants(None) == ("aligned",)
    assert all(f in cli_audit.FIX_HELP for f in FIXES)  # the help names each


@pytest.fixture(scope="module")
def smollm():
    from phasemech.model.pretrained import load_pretrained

    torch.manual_seed(0)
    return load_pretrained("smollm2-135m", n_ctx=256)


def test_claims_section_reads_recorded_fix_audits(tmp_path):
    from phasemech.experiments.claims.real_fixes import audit_command, claim_real_fixes

    assert "*Not measured yet*" in claim_real_fixes(tmp_path)
    a = AuditConfig.of(designs=("route",), contexts=(256,), top_k=1, layers=(2, 3, 4, 7),
                    variants=("aligned", "per_head", "random"), n_boot=100)  # fmt: skip
    names = {"route_d4_w16_k8": "route_d4_w16_k1", "route_d4_w16_k8_per_head":
             "route_d4_w16_k1_per_head"}  # fmt: skip
    flat = _targets([1.0, 0.2, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0])
    t = pd.concat([
        _targets([1.0, 0.2, 1.0, 1.0], [0.6, 0.6, 0.6, 0.6]).replace(names),
        flat[flat.setting != "route_d4_w16_k8"].replace(
            {"route_d4_w16_k8_per_head": "route_d4_w16_k1_random"}),
    ])  # fmt: skip
    fixes = fix_table(a, t, a.setting_meta())
    assert set(fixes.phase_grid) == {"reference", "drawn"}
    run = dict(config=a.to_dict(), wall_s=10.0, worker_s=20.0,
               fixes=fixes.to_dict(orient="records"))  # fmt: skip
    (tmp_path / "audit_fixes_decode_T256.json").write_text(json.dumps(run, default=float))
    text = claim_real_fixes(tmp_path)
    assert "| 256 | route | per_head |" in text and "| 256 | route | random |" in text
    assert "**Goal met** by route/random (decode, T = 256, top-k 1)" in text
    assert "Frontier: (not recorded)" in text
    cmd = audit_command(a.to_dict(), "route", "random")
    assert cmd == ("phasemech audit --design route --top-k 1 --context 256 --layers 2-4,7 "
                   "--fix random -o DIR")  # fmt: skip
    assert f"`{cmd}`" in text
    rule = audit_command(dict(a.to_dict(), task="kv", window=8), "route", "rule_quest")
    assert rule == ("phasemech audit --design route,quest --window 8 --task kv --top-k 1 "
                    "--context 256 --layers 2-4,7 -o DIR")  # fmt: skip
    # the same audit with the sink read raw: its own verdict line on the offset fixes
    sink = dict(run, config=dict(run["config"], sink_tokens=4))
    (tmp_path / "audit_fixes_decode_T256_sink4.json").write_text(json.dumps(sink, default=float))
    text = claim_real_fixes(tmp_path)
    assert "decode regime, the first 4 tokens read raw (sink)**" in text
    assert ("With the attention sink handled (the runs above that read it raw), offset fixes: "
            "**Goal met** by route/random (decode, T = 256, top-k 1). Other fixes that meet it "
            "with the sink: none.") in text  # fmt: skip
    assert "Where no offset fix meets it" not in text
    assert "--sink-tokens 4 --top-k 1" in text
    assert text.count("Verdict (the rule above, per row): **Goal met** by route/random") == 1
    # a second sink run (top-2) where the offset fix falls short: named with its closest fix
    short = [dict(f, verdict="cuts the gap, costs accuracy", accuracy_diff_lo=-0.2)
             for f in sink["fixes"]]  # fmt: skip
    k2 = dict(sink, config=dict(sink["config"], top_k=2), fixes=short)
    (tmp_path / "audit_fixes_decode_T256_sink4_k2.json").write_text(json.dumps(k2, default=float))
    text = claim_real_fixes(tmp_path)
    assert "**Goal met** by route/random (decode, T = 256, top-k 1). Other" in text
    assert "meets it: route (decode, T = 256, top-k 2): closest per_head, gap cut" in text


def test_random_fix_gap_is_on_the_drawn_grid():
    """A model weak at drawn phase 1: on the reference grid a random offset hides it (flat),
    on the drawn grid it is still there, so the fix does not pass by construction."""
    a = AuditConfig.of(designs=("route",), contexts=(256,), variants=("aligned", "random"),
                    n_boot=200)  # fmt: skip
    rng = np.random.default_rng(1)
    rows = []
    for g in range(80):
        for p in range(4):
            shift = int(rng.integers(4))
            for setting, phase, sh in (
                ("route_d4_w16_k8", p, 0),
                ("route_d4_w16_k8_random", (p - shift) % 4, shift),
            ):
                rows.append(dict(context=256, setting=setting, group_id=g, needle_pos=100 + p,
                                 grid_shift=sh, correct=phase != 1, seconds=0.1))  # fmt: skip
    r = fix_table(a, pd.DataFrame(rows), a.setting_meta()).iloc[0]
    assert r.phase_grid == "drawn" and r.gap_other > 0.9 and r.gap_reference < 0.2
    assert r.verdict == "does not cut the gap enough"


def test_same_grid_variants_are_refused_and_budgets_capped():
    with pytest.raises(ValueError, match="with W = 0 before_window reads exactly") as err:
        AuditConfig.of(designs=("route",), window=0, variants=("aligned", "before_window"))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="offsets='per_head' is invalid with fixes"):
        AuditConfig.of(offsets="per_head", variants=("aligned", "per_layer"))
    big = CompressionConfig("route", stride=4, window=16, top_k=1000)
    assert kv_budget(big, 256) == 256  # never more than the context
    import typer

    from phasemech.cli import audit as cli_audit

    for bad in ("", "aligned", " , "):
        with pytest.raises(typer.BadParameter, match="names no fix"):
            cli_audit._variants(bad)


def test_retrieval_mass_follows_the_null_heads():
    from phasemech.experiments.audit.fixes import retrieval_mass

    rows = []
    for setting, strong in (("null", 0.9), ("fix", 0.3)):
        for layer, head, base in ((0, 0, 0.01), (5, 2, strong), (5, 3, 0.02)):
            for phase in range(4):
                mass = base * (0.5 if (setting == "fix" and phase == 1) else 1)
                rows.append(dict(context=256, setting=setting, layer=layer, head=head,
                                 phase=phase, mass=mass))  # fmt: skip
    m = retrieval_mass(pd.DataFrame(rows), top=1)  # the null's top head: layer 5, head 2
    fix = m[m.setting == "fix"].sort_values("phase")["mass"].round(3).tolist()
    assert fix == [0.3, 0.15, 0.3, 0.3]
    assert retrieval_mass(None).empty


def test_rules_are_compared_with_route_at_the_same_grid():
    from phasemech.experiments.audit.fixes import fix_pairs

    a = AuditConfig.of(designs=("mean", "quest", "route", "kpool"), contexts=(256,),
                    variants=("aligned", "per_head"))  # fmt: skip
    pairs = fix_pairs(a, a.setting_meta())
    rules = [p for p in pairs if p[1].startswith("rule_")]
    assert rules == [("route", "rule_quest", "route_d4_w16_k8", "quest_d4_w16_k8"),
                     ("route", "rule_kpool", "route_d4_w16_k8", "kpool_d4_w16_k8")]  # fmt: skip
    assert ("mean", "per_head", "mean_d4_w16", "mean_d4_w16_per_head") in pairs
    single = AuditConfig.of(designs=("route",), variants=("aligned", "per_head"))
    assert not [p for p in fix_pairs(single, single.setting_meta()) if p[1].startswith("rule_")]


def test_sink_probe_script(tmp_path):
    """``analyses/sink_probe.py``: at offset 1 every probed head ranks the block holding only
    token 0 first (the documented reason offsets hurt ``route`` at top-1); at offset 0 none."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "probe.json"
    cmd = [sys.executable, str(root / "analyses/sink_probe.py"), "--offsets", "0", "1",
           "--layers", "15", "--context", "256", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, cwd=root, timeout=600)
    rows = pd.DataFrame(json.loads(out.read_text())["rows"])
    by = rows.groupby("offset")["sink_alone"].sum()
    assert by[1] == 9 and by[0] == 0


def test_partition_budget_is_a_heads_share():
    """partition reads its own blocks (a 1/H share), the block it closes and its raw band;
    without the model's head count there is no budget to give."""
    from phasemech import CompressionConfig
    from phasemech.experiments.probe.config import kv_budget

    comp = CompressionConfig("partition", stride=4, window=16)
    with pytest.raises(ValueError, match="n_heads"):
        kv_budget(comp, 1024)
    one, nine = kv_budget(comp, 1024, 1), kv_budget(comp, 1024, 9)
    # the last query ranks 251 blocks of 4 at T = 1024, W = 16: a 9th of them, its own, the band
    assert nine < one <= 1024 and nine == (-(-251 // 9) + 1) * 4 + 16
