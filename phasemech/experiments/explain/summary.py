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
from phasemech.experiments.explain.sections import (
    decomposition_findings,
    decomposition_lines,
    group_findings,
    group_lines,
    group_skip_lines,
    oracle_layer_lines,
    reader_lines,
)
from phasemech.experiments.explain.text import layer_span, num, phases_text, records


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
                 displaced_sink=num(g.displaced_sink.mean()),
                 lost=int(np.nansum(g.broken)))
            for k, g in o[~o.scope.str.startswith("layer ")].groupby(["scope", "form", "rows"],
                                                                      sort=False)
        ]  # fmt: skip
    p = t.get("patching")
    if p is not None:
        heads = top_heads(p, top)
        out["top_patching"] = records(heads, ["layer", "head", "effect", "ci_low", "ci_high"])
        sel = p[p.site == "selection"].sort_values("effect", ascending=False)
        out["selection_patching"] = records(sel, ["layer", "effect", "ci_low", "ci_high", "kept"])
    s = t.get("ablation_specialization")
    if s is not None:
        acc = s[(s.metric == "accuracy") & (s["mode"] == "zero")]
        # less 1e-9: a range of exactly 10 points computes as 0.0999... (0.7 - 0.6) when the
        # per-phase means are fractions of 50 contents
        dep = acc[(acc.p_holm < 0.05) & (acc.phase_range >= 0.10 - 1e-9)]
        cols = ["layer", "unit", "overall", "phase_range", "served_phase", "si", "p_holm"]
        out["phase_dependent_heads"] = records(dep.sort_values("p_holm"), cols)
        out["n_heads_tested"] = len(acc)
        if "p_holm_floor" in acc.columns:  # the smallest Holm p the test could give
            out["p_holm_floor"] = num(acc.p_holm_floor.min())
        from phasemech.interventions.specialization import floor_note

        out["phase_test"] = floor_note(s)  # explain.html's summary strip shows it
        z = s[(s.metric == "logit_diff") & (s["mode"] == "zero")].nsmallest(top, "overall")
        out["top_ablation"] = records(z, cols)
    return out | group_findings(t)


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
    "findings",
    "head_lines",
    "layer_lines",
    "skip_lines",
    "top_heads",
    "write_report",
]
