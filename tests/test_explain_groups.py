"""``phasemech explain``'s ``groups`` step: groups of heads ablated together (zero, mean,
resample) against independent references on tiny rotary GQA models, its tables and summary,
the cache keys of the steps recorded before it, and the step end to end on SmolLM2 (a run
whose cache holds the earlier steps computes only the new step's jobs)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from test_explain import _batch, _models

from phasemech.interventions.group_ablation import group_ablate
from phasemech.interventions.prompt_patching import ablate_prompt
from phasemech.interventions.prompts import aligned, bound, prompt_run

torch.set_num_threads(1)


def _margin(logits: torch.Tensor, answer: int) -> float:
    other = logits.clone()
    other[answer] = -torch.inf
    return float(logits[answer] - other.max())


@pytest.mark.parametrize("regime", ["decode", "trained"])
def test_a_group_of_one_is_the_single_head_ablation(regime):
    """Zero and mean ablation of a group of one head = ``ablate_prompt``'s (the patching
    engine's delta trick) for every head; the intact margin is the same."""
    tl, model = _models()
    run = prompt_run(tl, _batch(), 0, regime)
    h = model.cfg.n_heads
    means = torch.randn(3, h, model.cfg.d_head, generator=torch.Generator().manual_seed(0))
    want = ablate_prompt(model, run, 4, means)
    got = group_ablate(model, run, [((i, k),) for i in range(3) for k in range(h)], means)
    assert set(got) == {"base", "zero", "mean"}
    assert got["base"] == pytest.approx(want["base"], abs=1e-5)
    for mode in ("zero", "mean"):
        np.testing.assert_allclose(got[mode], np.ravel(want[mode]), atol=1e-4)
        assert np.ptp(got[mode]) > 1e-2  # the heads differ: the check can fail


@pytest.mark.parametrize("regime", ["decode", "trained"])
def test_resample_from_the_prompt_itself_changes_nothing_and_from_another_does(regime):
    tl, model = _models()
    batch = _batch(shift=1)
    batch.tokens[1, 30] = (batch.tokens[1, 30] + 5) % tl.cfg.d_vocab  # another content
    run, other = (prompt_run(tl, batch, i, regime) for i in (0, 1))
    groups = [((0, 1), (2, 3)), tuple((1, k) for k in range(model.cfg.n_heads))]
    same = group_ablate(model, run, groups, source=run)
    np.testing.assert_allclose(same["resample"], same["base"], atol=1e-5)
    moved = group_ablate(model, run, groups, source=other)
    assert max(abs(v - moved["base"]) for v in moved["resample"]) > 1e-3


def _attn_out_hook(model, layer: int, z: torch.Tensor):
    """Replace the layer's attention output by ``b_O + sum_h z_h W_O[h]`` (the sum of its
    heads' contributions), independently of ``hook_z``."""
    attn = model.blocks[layer].attn

    def hook(out, hook):
        return (torch.einsum("bphd,hdm->bpm", z.to(out.dtype), attn.W_O) + attn.b_O).expand_as(out)

    return (f"blocks.{layer}.hook_attn_out", hook)


@pytest.mark.parametrize("regime", ["decode", "trained"])
def test_a_whole_layer_equals_the_sum_of_its_heads_on_a_naive_forward(regime):
    """Every head of a layer ablated together (zero, mean, resample from another prompt) =
    a naive forward from the tokens whose attention output at that layer is the bias plus the
    sum of the replacement heads' outputs through ``W_O``."""
    tl, model = _models()
    batch = _batch(shift=1)
    run, other = (prompt_run(tl, batch, i, regime) for i in (0, 1))
    h, dh = model.cfg.n_heads, model.cfg.d_head
    means = torch.randn(3, h, dh, generator=torch.Generator().manual_seed(1))
    got = group_ablate(model, run, [tuple((i, k) for k in range(h)) for i in range(3)], means,
                       source=other)  # fmt: skip
    zs: dict[str, torch.Tensor] = {}
    for who, r in (("own", run), ("other", other)):
        with torch.inference_mode(), bound(model, r):
            _, cache = model.run_with_cache(r.tokens, names_filter=lambda n: n.endswith("hook_z"))
        zs |= {f"{who} {k}": v for k, v in cache.items()}
    answer = int(run.answer[0])
    for layer in range(3):
        own = zs[f"own blocks.{layer}.attn.hook_z"]
        reps = {
            "zero": torch.zeros_like(own),
            "mean": means[layer][None, None].expand_as(own),
            "resample": aligned(zs[f"other blocks.{layer}.attn.hook_z"], own),
        }
        for mode, z in reps.items():
            with torch.inference_mode(), bound(model, run):
                with model.hooks([_attn_out_hook(model, layer, z)]):
                    logits = model(run.tokens)[0, run.row]
            want = _margin(logits.float(), answer)
            assert got[mode][layer] == pytest.approx(want, abs=1e-4), (mode, layer)
    assert abs(got["zero"][1] - got["base"]) > 1e-2  # ablating a layer moves the margin


def test_a_group_across_layers_equals_its_hooks_on_a_naive_forward():
    """A group spanning layers (started at its first layer's cached residual) = the same
    heads zeroed by hooks on a naive forward from the tokens."""
    tl, model = _models()
    run = prompt_run(tl, _batch(), 0, "decode")
    group = ((1, 0), (2, 3), (1, 2))
    got = group_ablate(model, run, [group])

    def zero(heads):
        def hook(z, hook):
            z = z.clone()
            z[:, :, heads] = 0
            return z

        return hook

    hooks = [(f"blocks.{i}.attn.hook_z", zero([k for j, k in group if j == i])) for i in (1, 2)]
    with torch.inference_mode(), bound(model, run), model.hooks(hooks):
        want = _margin(model(run.tokens)[0, run.row].float(), int(run.answer[0]))
    assert got["zero"][0] == pytest.approx(want, abs=1e-4)
    assert abs(want - got["base"]) > 1e-3


def test_bad_groups_are_refused_in_one_line():
    tl, model = _models()
    run = prompt_run(tl, _batch(), 0, "decode")
    for bad in [(), ((3, 0),), ((0, 1), (0, 1))]:
        with pytest.raises(ValueError, match="group_ablate: group") as err:
            group_ablate(model, run, [bad])
        assert "\n" not in str(err.value)
    from phasemech.experiments.explain.config import ExplainConfig

    with pytest.raises(ValueError, match="group_sizes"):
        ExplainConfig(group_sizes=(1, 1))


def test_sources_are_another_content_at_another_phase_from_the_seed():
    from phasemech.experiments.explain.groups import resample_sources

    prompts = pd.DataFrame(dict(prompt_id=range(20), group_id=np.repeat(range(5), 4),
                                phase=np.tile(range(4), 5)))  # fmt: skip
    src = resample_sources(prompts, 0)
    by = prompts.set_index("prompt_id")
    assert sorted(src) == list(range(20))
    for i, j in src.items():
        assert by.group_id[i] != by.group_id[j] and by.phase[i] != by.phase[j]
    assert src == resample_sources(prompts, 0) and src != resample_sources(prompts, 1)
    assert resample_sources(prompts[prompts.group_id == 0], 0) is None


def test_needle_readers_and_the_groups():
    from phasemech.experiments.explain.groups import head_groups, needle_readers

    att = pd.DataFrame(dict(setting=["null"] * 4 + ["design"] * 4, layer=[0, 0, 1, 1] * 2,
                            head=[0, 1, 0, 1] * 2, phase=0,
                            mass=[0.1, 0.5, 0.3, 0.0, 0.9, 0.9, 0.9, 0.9]))  # fmt: skip
    r = needle_readers(att)
    assert list(zip(r.layer, r["head"], strict=True)) == [(0, 1), (1, 0), (0, 0), (1, 1)]
    units = head_groups(r, (1, 3, 10), 2, 2)
    assert units == [("top 1", ((0, 1),)), ("top 3", ((0, 1), (1, 0), (0, 0))),
                     ("layer 0", ((0, 0), (0, 1))), ("layer 1", ((1, 0), (1, 1)))]  # fmt: skip


def _items(n_groups: int = 12) -> list[dict]:
    """Per-prompt results where ``top 3`` (resample) only hurts phase 2."""
    rng = np.random.default_rng(0)
    units = [["top 1", [[1, 2]]], ["top 3", [[1, 2], [0, 0], [1, 0]]], ["layer 0", [[0, 0]]]]
    items = []
    for g in range(n_groups):
        for phase in range(4):
            vals = {m: rng.normal(1.0, 0.1, 3).tolist() for m in ("zero", "resample")}
            vals["resample"][1] = -1.0 if phase == 2 else 1.0
            meta = dict(prompt_id=4 * g + phase, group_id=g, prefix=phase, depth=0.5,
                        needle_pos=100 + phase, phase=phase)  # fmt: skip
            items.append({"prompt": meta, "units": units, "groups": {"base": 1.0, **vals}})
    return items


def test_group_tables_are_the_labs_effects_and_specialization():
    from phasemech.experiments.explain.groups import group_tables
    from phasemech.experiments.explain.sections import group_findings, group_lines

    t = group_tables(_items(), 4, 50, 0, "auto")
    e, s = t["group_ablation"], t["group_ablation_specialization"]
    assert set(e.group) == {"top 1", "top 3", "layer 0"} and set(e["mode"]) == {"zero", "resample"}
    acc = e[(e.metric == "accuracy") & (e.group == "top 3") & (e["mode"] == "resample")]
    assert acc.set_index("phase").effect.to_dict() == {0: 0.0, 1: 0.0, 2: -1.0, 3: 0.0}
    assert acc.heads.iloc[0] == "L1H2,L0H0,L1H0" and (acc.n_heads == 3).all()
    # "auto": draws enough that Holm over the 6 units x modes can reach 0.001
    assert (s.p_holm_floor <= 0.001 + 1e-12).all() and s.n_perm.max() >= 6 / 0.001 - 1
    top = s[s.metric == "logit_diff"].sort_values("rank").iloc[0]
    assert (top.group, top["mode"], top.served_phase) == ("top 3", "resample", 2)
    assert top.p_holm < 0.05
    f = group_findings(t)
    row = next(r for r in f["group_ablation"] if (r["group"], r["mode"]) == ("top 3", "resample"))
    assert row["accuracy"] == [1.0, 1.0, 0.0, 1.0] and row["accuracy_base"] == [1.0] * 4
    g = s[s.metric == "logit_diff"]
    want = dict(max_perm=int(g.n_perm.max()), n_tests=6, min_p=g.p_floor.min(),
                min_p_holm=g.p_holm_floor.min())  # fmt: skip
    assert f["group_test"] == want
    assert f["group_test"]["min_p_holm"] < 0.01
    text = "\n".join(group_lines(t))
    assert "## Group and resample ablation" in text
    assert "| top 3 | L1H2,L0H0,L1H0 | resample |" in text


def test_earlier_steps_keep_their_keys_with_the_group_step():
    """The default now runs ``groups``: every earlier step's jobs keep the keys they had
    without it (the recorded runs' caches); ``group_sizes`` at its default is not in the key,
    another is."""
    import dataclasses

    from phasemech.experiments.explain.config import ANALYSES, LATER_ANALYSES, ExplainConfig
    from phasemech.experiments.explain.jobs import explain_jobs

    old = tuple(a for a in ANALYSES if a not in LATER_ANALYSES)
    new, before = ExplainConfig(), ExplainConfig(analyses=old)
    assert "groups" in new.analyses and "groups" not in before.analyses
    for step in ("observe", "attend", "intervene", "heads"):
        assert [j.key for j in explain_jobs(new, step, [0, 1], [(0, 1)])] == [
            j.key for j in explain_jobs(before, step, [0, 1], [(0, 1)])
        ]
    grouped = explain_jobs(new, "groups", [0])[0].key
    assert grouped not in {j.key for j in explain_jobs(new, "observe", [0])}
    other = dataclasses.replace(new, group_sizes=(2, 4))
    assert explain_jobs(other, "observe", [0])[0].key != explain_jobs(new, "observe", [0])[0].key


# ------------------------------------------------------------------ SmolLM2, end to end


@pytest.fixture(scope="module")
def one_ray():
    from phasemech.experiments.ray_connect import ray_connected

    with ray_connected(None, 1):
        yield


def _jobs(folder) -> dict:
    return {p.name: (p.stat().st_mtime_ns, json.loads(p.read_text())["config"]["step"])
            for p in (folder / "jobs").glob("*.json")}  # fmt: skip


def test_group_step_end_to_end_adds_only_its_jobs(tmp_path, one_ray):
    """A run without ``groups`` and ``decompose``, then the same run with them: the rerun reads
    every earlier job from the cache and computes only their jobs; the tables, summary fields
    and the page follow (one SmolLM2 run serves both later analyses)."""
    from browser import page_data

    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.run import run_explain

    # two phases (stride 2) x two contents: 4 prompts, 32 groups each
    kw = dict(design="route", top_k=1, stride=2, layers=(4, 5), context=128, contents=2,
              n_boot=20, n_perm=20, group_sizes=(1, 3))  # fmt: skip
    out = tmp_path / "explain"
    run_explain(ExplainConfig.of(**kw, analyses=("selection",)), out, progress=False)
    first = _jobs(out)
    assert {s for _, s in first.values()} == {"observe", "attend"}
    later = ("selection", "groups", "decompose")
    summary = run_explain(ExplainConfig.of(**kw, analyses=later), out, progress=False)
    second = _jobs(out)
    assert {k: second[k] for k in first} == first  # read from the cache, not rewritten
    assert {s for k, (_, s) in second.items() if k not in first} == {"groups", "decompose"}
    ga = pd.read_parquet(out / "group_ablation.parquet")
    assert set(ga["mode"]) == {"zero", "resample"}  # no means without the ablation analysis
    assert set(ga.group) == {"top 1", "top 3", *(f"layer {i}" for i in range(30))}
    assert len(pd.read_parquet(out / "group_ablation_specialization.parquet")) == 2 * 2 * 32
    f = summary["findings"]
    assert {"group_ablation", "group_test", "needle_readers", "reader_recall"} <= set(f)
    assert [r["readers"] for r in f["reader_recall"]] == ["top 1", "top 3", "every head"]
    assert len(f["group_ablation"]) == 2 * 32 and len(f["group_ablation"][0]["effect"]) == 2
    text = (out / "summary.md").read_text()
    assert "## Group and resample ablation" in text and "no mean mode" in text
    assert "## Selection at the heads that read the needle" in text
    page = page_data((out / "explain.html").read_text())
    assert {"groups", "reader_recall", "decomposition"} <= set(page["figures"])
    # the decomposition: every (prompt, layer, head) of the selection, its verdict the same
    df = pd.read_parquet(out / "decomposition.parquet")
    sel = pd.read_parquet(out / "selection.parquet").set_index(["prompt_id", "layer", "head"])
    assert set(df.layer) == {4, 5} and set(df.phase) == {0, 1}
    unit = df.drop_duplicates(["prompt_id", "layer", "head"]).set_index(sel.index.names)
    assert (unit.selected == sel.selected.reindex(unit.index)).all()
    assert "selection decomposed" in text and f["decomposition"]["needle_reading_heads"]


def test_the_per_layer_oracle_is_kept_in_the_findings():
    from test_explain_html import _tables

    from phasemech.experiments.explain.sections import oracle_layer_lines
    from phasemech.experiments.explain.summary import findings

    t = _tables()
    t["oracle"] = t["oracle"].assign(broken=1, null=1.0, displaced_sink=0.0)
    per = findings(t, n_layers=3)["oracle_per_layer"]
    assert [(r["layer"], r["form"]) for r in per] == [(1, "replace"), (2, "replace")]
    want = t["oracle"][t["oracle"].scope == "layer 2"].sort_values("phase").accuracy.tolist()
    assert per[1]["accuracy"] == want and per[1]["lost"] == 4
    assert "| replace | " in "\n".join(oracle_layer_lines(t))


def test_the_page_draws_the_groups_and_the_reader_recall(tmp_path):
    from browser import browser
    from test_explain_html import _summary, _tables

    from phasemech.experiments.explain.groups import group_tables
    from phasemech.viz.explain import explain_figures, write_explain_html

    t = _tables() | group_tables(_items(), 4, 20, 0, 20)
    t["reader_recall"] = pd.DataFrame(dict(readers=np.repeat(["top 1", "every head"], 4),
                                           phase=np.tile(range(4), 2), recall=0.5,
                                           heads=np.repeat(["L1H0", ""], 4)))  # fmt: skip
    figs = explain_figures(t)
    assert [tr.name for tr in figs["reader_recall"].data] == ["top 1", "every head"]
    panels = figs["groups"].data
    assert len(panels) == 2 and np.array(panels[1].z).shape == (3, 4)  # zero, resample
    want = t["group_ablation"].query("mode == 'resample' and metric == 'logit_diff' and "
                                     "group == 'top 3'").sort_values("phase").effect  # fmt: skip
    np.testing.assert_allclose(np.array(panels[1].z)[1], want)
    path = write_explain_html(tmp_path / "explain.html", t, _summary())
    with browser(path, "#groups-plot .main-svg", 1400) as (page, errors):
        for plot in ("groups", "reader_recall"):
            assert page.locator(f"#{plot}-plot .main-svg").count() > 0
    assert errors == []
