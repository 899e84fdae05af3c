"""The explanation's mechanism sections of ``summary.md`` and ``summary.json``: groups of
heads ablated together, the heads that read the needle (and the selection at them), the oracle
in one layer alone, and the selection decomposed at the answer row.

Axes: ``layer``, ``head``, ``phase``; tables as :mod:`phasemech.experiments.explain.tables`,
:mod:`~phasemech.experiments.explain.groups` and the decompose step write them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from phasemech.experiments.explain.text import num, phases_text, records


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
                         **{k: [num(v) for v in m[k]] for k in ("effect", "ci_low", "ci_high")},
                         accuracy=[num(v) for v in a.ablated],
                         accuracy_base=[num(v) for v in a.baseline], overall=num(r.overall),
                         p_perm=num(r.p_perm), p_holm=num(r.p_holm)))  # fmt: skip
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
        out["needle_readers"] = records(r.head(10), ["layer", "head", "mass", "rank"])
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
                name.replace(" ", "_").replace("-", "_"): records(
                    m.reset_index(), list(m.reset_index().columns)
                )
                for name, m in _decomposition_parts(t)
            }  # fmt: skip
        }
        if t.get("decomposition") is not None
        else {}
    )


__all__ = [
    "decomposition_findings",
    "decomposition_lines",
    "group_findings",
    "group_lines",
    "group_skip_lines",
    "oracle_layer_lines",
    "reader_lines",
]
