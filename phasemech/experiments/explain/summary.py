"""The explanation's summary: ``summary.md`` and ``summary.json`` from its tables.

Axes: ``layer``, ``head``, ``phase``; tables as :mod:`phasemech.experiments.explain.tables`
writes them.

The summary states what the models support: the setting (model, design, grid, regime, context,
prompt count), per-phase accuracy of the design beside the null, selection recall by layer band
and phase, the oracle by phase (does forcing the needle's block restore the weak phase: then
the weak spot is the selection; if not, the read-out), and the top heads by exact patching and
by ablation with the phases they serve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic


def layer_span(layers) -> str:
    """``"2-29"`` for a run of layers, else the list; ``"all"`` when none is named."""
    if not layers:
        return "all"
    xs = sorted(layers)
    if xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}-{xs[-1]}"
    return ",".join(map(str, xs))


def phases_text(xs) -> str:
    """``0.70 / 0.32 / ...``; a missing value as ``-``."""
    return " / ".join("-" if x is None else f"{x:.2f}" for x in xs)


def _bands(n_layers: int, parts: int = 3) -> list[tuple[int, int]]:
    edges = np.linspace(0, n_layers, parts + 1).round().astype(int)
    return [(int(a), int(b) - 1) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _selection_lines(t: dict, n_layers: int) -> list[str]:
    rec = t.get("selection_recall")
    if rec is None:
        return []
    lines = [
        "",
        "## Selection: is the needle's block kept at the answer row?",
        "",
        "| layers | recall by phase | median rank by phase |",
        "|---|---|---|",
    ]
    for span, g in _band_groups(rec, n_layers):
        lines.append(
            f"| {span} | {phases_text(g.recall.mean())} | {phases_text(g['rank'].median())} |"
        )
    return lines


def _band_groups(rec: pd.DataFrame, n_layers: int):
    """``("lo-hi", rows of those layers grouped by phase)`` per non-empty layer band."""
    for lo, hi in _bands(n_layers):
        band = rec[(rec.layer >= lo) & (rec.layer <= hi)]
        if not band.empty:  # named by the selecting layers it holds (2-9, not 0-9)
            yield f"{band.layer.min()}-{band.layer.max()}", band.groupby("phase")


def _oracle_lines(t: dict) -> list[str]:
    o = t.get("oracle")
    if o is None:
        return []
    lines = [
        "",
        "## Oracle: the needle's block forced into what queries read",
        "",
        "Displaced: the design's picks (head x row x layer) that the forced block took the "
        "place of, per prompt, and the share of them that was the sink's block (token 0). "
        "Lost: prompts the design answered right that forcing made wrong (its cost).",
        "",
        "| scope | form | rows | accuracy by phase | unforced | displaced (sink share) | lost |",
        "|---|---|---|---|---|---|---|",
    ]
    keep = o[o.scope.isin(["none", "all", "top heads"])]
    for (scope, form, rows), g in keep.groupby(["scope", "form", "rows"], sort=False):
        g = g.sort_values("phase")
        sink = g.displaced_sink.mean()
        lines.append(
            f"| {scope} | {form} | {rows} | {phases_text(g.accuracy)} | "
            f"{phases_text(g.unforced)} | "
            f"{g.displaced.mean():.1f} ({'-' if np.isnan(sink) else f'{sink:.2f}'}) | "
            f"{int(np.nansum(g.broken))} |"
        )
    return lines


def atp_check(patch: pd.DataFrame | None, top: int = 20) -> dict[str, Any] | None:
    """Attribution patching checked against exact patching on its ``top`` heads (largest
    |estimate|): their correlation, the largest gap, and how many are also among the exact
    top ``top``."""
    if patch is None or not {"atp", "head"} <= set(patch.site):
        return None
    if patch[patch.site == "head"].effect.isna().all():  # no gap: nothing to check against
        return None
    atp = patch[patch.site == "atp"].set_index(["layer", "head"]).effect
    exact = patch[patch.site == "head"].set_index(["layer", "head"]).effect
    picked = atp.abs().nlargest(top).index
    a, e = atp.loc[picked].to_numpy(), exact.loc[picked].to_numpy()
    best = set(exact.abs().nlargest(top).index)
    r = float(np.corrcoef(a, e)[0, 1]) if len(a) > 2 and a.std() > 0 and e.std() > 0 else None
    return dict(n=len(picked), pearson_r=r, max_abs_gap=float(np.abs(a - e).max()),
                overlap=sum(k in best for k in picked))  # fmt: skip


def top_heads(patch: pd.DataFrame, top: int, layers=None) -> pd.DataFrame:
    """Heads by exact patching effect, largest first (of ``layers`` if given). A NaN effect
    (no clean-corrupted gap to normalise by) ranks nothing: pandas' ``nlargest`` keeps NaN."""
    heads = patch[(patch.site == "head") & patch.effect.notna()]
    if layers is not None:
        heads = heads[heads.layer.isin(layers)]
    return heads.nlargest(top, "effect")


def layer_lines(t: dict, top: int = 5) -> list[str]:
    """The layers whose residual stream or selection, patched from the clean phase, restore
    the most."""
    p = t.get("patching")
    if p is None:
        return []
    lines = ["", "## Layers by patching (1 = restored)", "", "| site | top layers (effect) |",
             "|---|---|"]  # fmt: skip
    header = len(lines)
    for site in ("resid", "selection"):
        # NaN effects (no clean-corrupted gap; the header says so) rank nothing
        g = p[(p.site == site) & (p.layer >= 0) & p.effect.notna()].nlargest(top, "effect")
        if g.empty:
            continue
        best = ", ".join(f"{r.layer} ({r.effect:.2f})" for r in g.itertuples())
        every = p[(p.site == site) & (p.layer < 0)]
        if len(every):
            r = every.iloc[0]
            best += f"; every selecting layer: {r.effect:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}]"
        lines.append(f"| {site} | {best} |")
    return lines if len(lines) > header else lines + ["| - | no normalised effect to rank |"]


def head_lines(t: dict, top: int = 10) -> list[str]:
    """The report's heads: the largest exact patching effects (with their phases) and the
    ablation's phase-specialised heads."""
    lines = []
    p = t.get("patching")
    if p is not None:
        heads = top_heads(p, top)
        lines += [
            "",
            "## Top heads by exact patching (clean phase into weak phase; 1 = restored)",
            "",
            "| layer.head | effect [95% CI] | AtP estimate |",
            "|---|---|---|",
        ]
        atp = p[p.site == "atp"].set_index(["layer", "head"]).effect
        if heads.empty:
            lines.append("| - | no normalised effect to rank | - |")
        for r in heads.itertuples():
            est = atp.get((r.layer, r.head), np.nan)
            ci = f"[{r.ci_low:.3f}, {r.ci_high:.3f}]"
            lines.append(f"| {r.layer}.{r.head} | {r.effect:.3f} {ci} | {est:.3f} |")
        chk = atp_check(p)
        if chk is not None:
            r = "-" if chk["pearson_r"] is None else f"{chk['pearson_r']:.2f}"
            lines += [
                "",
                f"AtP check on its top {chk['n']} heads: r = {r} with exact patching, largest "
                f"gap {chk['max_abs_gap']:.3f}, {chk['overlap']} of them in the exact top "
                f"{chk['n']}.",
            ]
    s = t.get("ablation_specialization")
    if s is not None:
        from phasemech.interventions.specialization import floor_note

        z = s[(s.metric == "logit_diff") & (s["mode"] == "zero")].nsmallest(top, "overall")
        lines += [
            "",
            "## Top heads by zero ablation (margin at the first answer token)",
            "",
            f"Phase dependence: {floor_note(s)}",
            "",
            "| layer.head | mean effect | served phase | SI | p (perm) | p (Holm) | p (F, Holm) |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in z.itertuples():
            f_holm = getattr(r, "p_anova_holm", float("nan"))
            p = f"{r.p_perm:.3g} | {r.p_holm:.3g} | {f_holm:.3g}"
            lines.append(
                f"| {r.layer}.{r.unit} | {r.overall:.3f} | {r.served_phase} | {r.si:.2f} | {p} |"
            )
    return lines


def _records(df: pd.DataFrame, cols: list[str]) -> list[dict[str, Any]]:
    return [{k: _num(v) for k, v in r.items()} for r in df[cols].to_dict("records")]


def _num(v: Any) -> Any:
    if isinstance(v, np.generic):
        v = v.item()
    return None if isinstance(v, float) and np.isnan(v) else v


def findings(t: dict, n_layers: int, top: int = 10) -> dict[str, Any]:
    """What the claims report reads: selection recall by layer band and phase, the oracle by
    phase (every form and scope but the one-layer ones), the top heads by exact patching and
    by zero ablation, the phase-dependent heads (accuracy effect: Holm p < 0.05 and a per-phase
    range >= 10 points, the lab's rule) and the layers by selection patching."""
    out: dict[str, Any] = {}
    rec = t.get("selection_recall")
    if rec is not None:
        out["selection_bands"] = [
            dict(layers=span, recall_by_phase=g.recall.mean().tolist())
            for span, g in _band_groups(rec, n_layers)
        ]
    o = t.get("oracle")
    if o is not None:
        out["oracle"] = [
            dict(scope=k[0], form=k[1], rows=k[2], **{c: g.sort_values("phase")[c].tolist()
                 for c in ("accuracy", "ci_low", "ci_high", "unforced", "null")},
                 displaced_sink=_num(g.displaced_sink.mean()),
                 lost=int(np.nansum(g.broken)))
            for k, g in o[~o.scope.str.startswith("layer ")].groupby(["scope", "form", "rows"],
                                                                      sort=False)
        ]  # fmt: skip
    p = t.get("patching")
    if p is not None:
        heads = top_heads(p, top)
        out["top_patching"] = _records(heads, ["layer", "head", "effect", "ci_low", "ci_high"])
        sel = p[p.site == "selection"].sort_values("effect", ascending=False)
        out["selection_patching"] = _records(sel, ["layer", "effect", "ci_low", "ci_high", "kept"])
    s = t.get("ablation_specialization")
    if s is not None:
        acc = s[(s.metric == "accuracy") & (s["mode"] == "zero")]
        # less 1e-9: a range of exactly 10 points computes as 0.0999... (0.7 - 0.6) when the
        # per-phase means are fractions of 50 contents
        dep = acc[(acc.p_holm < 0.05) & (acc.phase_range >= 0.10 - 1e-9)]
        cols = ["layer", "unit", "overall", "phase_range", "served_phase", "si", "p_holm"]
        out["phase_dependent_heads"] = _records(dep.sort_values("p_holm"), cols)
        out["n_heads_tested"] = len(acc)
        if "p_holm_floor" in acc.columns:  # the smallest Holm p the test could give
            out["p_holm_floor"] = _num(acc.p_holm_floor.min())
        from phasemech.interventions.specialization import floor_note

        out["phase_test"] = floor_note(s)  # explain.html's summary strip shows it
        z = s[(s.metric == "logit_diff") & (s["mode"] == "zero")].nsmallest(top, "overall")
        out["top_ablation"] = _records(z, cols)
    return out | group_findings(t)


# ------------------------------------------------- groups, needle readers, per-layer oracle
def _ci_text(g: pd.DataFrame) -> str:
    """``-0.92 [-1.10, -0.71] / ...`` per phase."""

    def one(e, lo, hi) -> str:
        return "-" if e is None or np.isnan(e) else f"{e:+.2f} [{lo:+.2f}, {hi:+.2f}]"

    return " / ".join(one(*x) for x in zip(g.effect, g.ci_low, g.ci_high, strict=True))


def _group_rows(t: dict) -> list[dict[str, Any]]:
    """Per (group, mode): margin effect by phase with CI, accuracy by phase (ablated and
    intact), the margin's phase-dependence p and Holm p."""
    e, s = t.get("group_ablation"), t.get("group_ablation_specialization")
    if e is None or s is None:
        return []
    p = s[s.metric == "logit_diff"].set_index(["group", "mode"])
    rows = []
    for (group, mode), g in e.groupby(["group", "mode"], sort=False, observed=True):
        m, a = (g[g.metric == k].sort_values("phase") for k in ("logit_diff", "accuracy"))
        r = p.loc[(group, mode)]
        rows.append(dict(group=group, heads=g.heads.iloc[0], mode=mode,
                         **{k: [_num(v) for v in m[k]] for k in ("effect", "ci_low", "ci_high")},
                         accuracy=[_num(v) for v in a.ablated],
                         accuracy_base=[_num(v) for v in a.baseline], overall=_num(r.overall),
                         p_perm=_num(r.p_perm), p_holm=_num(r.p_holm)))  # fmt: skip
    return rows


def group_lines(t: dict, top_layers: int = 5) -> list[str]:
    """``summary.md``'s "Group and resample ablation": every ``top k`` group and the
    ``top_layers`` layers whose heads together move the margin most (resample, else zero)."""
    rows = _group_rows(t)
    if not rows:
        return []
    s = t["group_ablation_specialization"]
    from phasemech.interventions.specialization import floor_note

    layers = [r for r in rows if r["group"].startswith("layer ")]
    rank_mode = "resample" if any(r["mode"] == "resample" for r in layers) else "zero"
    by = sorted((r for r in layers if r["mode"] == rank_mode), key=lambda r: r["overall"])
    keep = {r["group"] for r in by[:top_layers]}
    shown = [r for r in rows if r["group"].startswith("top ") or r["group"] in keep]
    lines = [
        "",
        "## Group and resample ablation",
        "",
        "Groups of heads ablated together: the top k heads by the null's attention from the "
        f"answer row onto the needle, and each layer's heads (the {len(keep)} layers whose "
        f"{rank_mode} ablation lowers the margin most shown; every layer in "
        "`group_ablation.parquet`). Δ margin: the answer's margin at the first answer token, "
        "ablated - intact, by phase [95% CI, contents resampled]; accuracy: the first token "
        "greedy, ablated (intact). p: permutation test that the margin effect does not depend "
        f"on the phase, within contents; {floor_note(s[s.metric == 'logit_diff'])}",
        "",
        "| group | heads | mode | Δ margin by phase [95% CI] | accuracy by phase (intact) | "
        "p (perm) | p (Holm) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in shown:
        g = pd.DataFrame({k: np.array(r[k], dtype=float) for k in ("effect", "ci_low", "ci_high")})
        heads = r["heads"] if r["group"].startswith("top ") else "all"
        lines.append(
            f"| {r['group']} | {heads} | {r['mode']} | {_ci_text(g)} | "
            f"{phases_text(r['accuracy'])} ({phases_text(r['accuracy_base'])}) | "
            f"{r['p_perm']:.3g} | {r['p_holm']:.3g} |"
        )
    return lines


def reader_lines(t: dict) -> list[str]:
    """Selection recall at the heads that read the needle most under the null, beside every
    selecting head."""
    rec = t.get("reader_recall")
    if rec is None or rec.empty:
        return []
    lines = [
        "",
        "## Selection at the heads that read the needle",
        "",
        "Recall of the needle's block at the answer row, at the top k heads by the null's "
        "attention onto the needle among the selecting heads, beside every selecting head.",
        "",
        "| heads | recall by phase | which |",
        "|---|---|---|",
    ]
    for name, g in rec.groupby("readers", sort=False):
        lines.append(f"| {name} | {phases_text(g.sort_values('phase').recall)} | "
                     f"{g.heads.iloc[0] or '-'} |")  # fmt: skip
    return lines


def _per_layer_oracle(o: pd.DataFrame | None) -> pd.DataFrame | None:
    if o is None:
        return None
    per = o[o.scope.str.startswith("layer ")]
    return None if per.empty else per.assign(layer=per.scope.str.split().str[1].astype(int))


def oracle_layer_lines(t: dict, top: int = 5) -> list[str]:
    """The layers where forcing the needle's block alone restores most, per form."""
    per = _per_layer_oracle(t.get("oracle"))
    if per is None:
        return []
    lines = ["", "## Oracle in one layer alone (every row after the needle)", "",
             "| form | best layers (mean accuracy) | accuracy by phase of the best |",
             "|---|---|---|"]  # fmt: skip
    for form, g in per.groupby("form", sort=False):
        mean = g.groupby("layer").accuracy.mean().sort_values(ascending=False).head(top)
        best = g[g.layer == mean.index[0]].sort_values("phase")
        text = ", ".join(f"{i} ({v:.2f})" for i, v in mean.items())
        lines.append(f"| {form} | {text} | {phases_text(best.accuracy)} |")
    return lines


def group_skip_lines(cfg, tables: dict) -> list[str]:
    """The group ablation's modes this run could not run, and why."""
    if "groups" not in cfg.analyses or tables.get("group_ablation") is None:
        return []
    modes = set(tables["group_ablation"]["mode"])
    out = []
    if "mean" not in modes:
        out.append("Group ablation: no mean mode (the heads' means are computed in observe "
                   "with `ablation` among the analyses).")  # fmt: skip
    if "resample" not in modes:
        out.append("Group ablation: no resample mode (it takes another content's prompt at "
                   "another phase: two contents and two phases at least).")  # fmt: skip
    return out


def group_findings(t: dict) -> dict[str, Any]:
    """``summary.json``'s group ablations, needle readers, selection at them and the oracle in
    each layer alone (what the tables keep, for the claims report)."""
    out: dict[str, Any] = {}
    rows = _group_rows(t)
    if rows:
        s = t["group_ablation_specialization"]
        s = s[s.metric == "logit_diff"]
        out["group_ablation"] = rows
        out["group_test"] = dict(max_perm=int(s.n_perm.max()), n_tests=len(s),
                                 min_p=float(s.p_floor.min()),
                                 min_p_holm=float(s.p_holm_floor.min()))  # fmt: skip
    r = t.get("needle_readers")
    if r is not None and len(r):
        out["needle_readers"] = _records(r.head(10), ["layer", "head", "mass", "rank"])
    rec = t.get("reader_recall")
    if rec is not None and len(rec):
        out["reader_recall"] = [
            dict(readers=k, heads=g.heads.iloc[0], recall_by_phase=g.sort_values("phase")
                 .recall.tolist()) for k, g in rec.groupby("readers", sort=False)
        ]  # fmt: skip
    per = _per_layer_oracle(t.get("oracle"))
    if per is not None:
        out["oracle_per_layer"] = [
            dict(layer=int(k[0]), form=k[1], rows=k[2], **{c: g.sort_values("phase")[c].tolist()
                 for c in ("accuracy", "ci_low", "ci_high", "unforced")},
                 lost=int(np.nansum(g.broken)) if "broken" in g else None)
            for k, g in per.groupby(["layer", "form", "rows"], sort=True)
        ]  # fmt: skip
    return out


def _decomposition_parts(t: dict) -> list[tuple[str, pd.DataFrame]]:
    """``(which heads, per-phase table)`` from ``decomposition_phases``."""
    phases = t.get("decomposition_phases")
    if phases is None:
        return []
    return [(name, g.drop(columns="heads").set_index("phase"))
            for name, g in phases.groupby("heads", sort=False)]  # fmt: skip


def decomposition_lines(t: dict) -> list[str]:
    """The selection at the answer row, token by token: per phase, the needle block's score
    (its needle token's term + the rest of the block), the competitor's, the margin, and how
    often the block that beats the needle is the sink's."""
    parts = _decomposition_parts(t)
    if not parts:
        return []
    lines = ["", "## Why the phase is weak: the selection decomposed", "",
             "Per phase (mean over prompt x layer x head where the needle's block is ranked): "
             "the needle block's score = its needle token's term + the rest of the block; the "
             "competitor is the last kept pick (or, where that is the needle, the best block "
             "left out); sink wins: the share of misses whose competitor is the sink's block.",
             "", "| heads | phase | needle slot | recall | needle term | rest | needle score | "
             "competitor | margin | sink wins | sink kept |", "|---|---|---|---|---|---|---|---|"
             "---|---|---|"]  # fmt: skip
    for name, m in parts:
        for ph, r in m.iterrows():
            lines.append(
                f"| {name} | {ph} | {r.needle_slot:.0f} | {r.recall:.2f} | {r.needle_term:.3f} "
                f"| {r.rest_term:.3f} | {r.needle_score:.3f} | {r.competitor_score:.3f} | "
                f"{r.margin:.3f} | {r.sink_wins:.2f} | {r.sink_kept:.2f} |"
            )
    return lines


def decomposition_findings(t: dict) -> dict[str, Any]:
    """``summary.json``'s ``decomposition``: the per-phase tables of
    :func:`decomposition_lines`, by which heads (none without the step)."""
    return (
        {
            "decomposition": {
                name.replace(" ", "_").replace("-", "_"): _records(
                    m.reset_index(), list(m.reset_index().columns)
                )
                for name, m in _decomposition_parts(t)
            }  # fmt: skip
        }
        if t.get("decomposition") is not None
        else {}
    )


def skip_lines(cfg, tables: dict[str, pd.DataFrame | None]) -> list[str]:
    """What this run left out, and why (never a silent gap in the tables)."""
    out = []
    if "oracle" in cfg.analyses and "patching" not in cfg.analyses:
        out.append(
            "The oracle in the top heads was not run: it ranks heads by exact patching "
            "(add `patching` to the analyses)."
        )
    pairs = tables.get("patching_pairs")
    gap = None if pairs is None else (pairs.clean - pairs.corrupted).mean()
    if gap is not None and gap <= 0:
        out.append(
            "Patching: the clean phase's logit difference is not above the corrupted one's on "
            f"these pairs (mean clean - corrupted {gap:.3f}): there is no gap to normalise by, "
            "so the normalised effects are NaN (the raw changes are in `patching.parquet`)."
        )
    return out


def write_report(
    cfg, tables: dict[str, pd.DataFrame | None], meta: dict[str, Any], out: Path
) -> dict[str, Any]:
    """``summary.md`` and ``summary.json`` under ``out``; returns the summary."""
    prompts = tables["prompts"]
    by = prompts.groupby("phase")
    acc, null = by.design_correct.mean().tolist(), by.null_correct.mean().tolist()
    summary = dict(
        config=cfg.flat() | {"setting": cfg.setting},
        accuracy_by_phase=acc,
        null_by_phase=null,
        n_prompts=len(prompts),
        atp_check=atp_check(tables.get("patching")),
        findings=findings(tables, meta["n_layers"]) | decomposition_findings(tables),
        **meta,
    )
    p = cfg.probe
    head = (
        f"# Explaining {cfg.setting} on {meta['model']} ({p.regime} regime, T = {cfg.context}, "
        f"compressed layers {layer_span(p.layers)}, {p.contents} contents x {p.stride} "
        f"phases = {len(prompts)} prompts)"
    )
    lines = [head, "", f"Accuracy by phase: design {phases_text(acc)}; null {phases_text(null)}."]
    if meta.get("contrast_phases") and meta["contrast_phases"][0] is not None:
        s, w = meta["contrast_phases"]
        lines.append(
            f"Patching: clean = phase {s}, corrupted = phase {w}, {meta['n_pairs']} pairs."
        )
    if not any(acc):
        lines.append("The design answers no prompt: no component can be credited with it.")
    lines += skip_lines(cfg, tables) + group_skip_lines(cfg, tables)
    lines += (
        _selection_lines(tables, meta["n_layers"])
        + _oracle_lines(tables)
        + layer_lines(tables)
        + head_lines(tables)
        + oracle_layer_lines(tables)
        + reader_lines(tables)
        + group_lines(tables)
        + decomposition_lines(tables)
    )
    lines += ["", f"Wall time {meta['wall_s']:.0f} s; worker time {meta['worker_s']:.0f} s."]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "summary.md", lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    write_json_atomic(out / "summary.json", json_safe(summary))
    return summary


__all__ = [
    "atp_check",
    "decomposition_findings",
    "decomposition_lines",
    "findings",
    "group_findings",
    "group_lines",
    "group_skip_lines",
    "head_lines",
    "layer_lines",
    "layer_span",
    "oracle_layer_lines",
    "phases_text",
    "reader_lines",
    "skip_lines",
    "top_heads",
    "write_report",
]
