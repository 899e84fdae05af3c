"""The explanation's summary: ``summary.md`` and ``summary.json`` from its tables.

Axes: ``layer``, ``head``, ``phase``; tables as :mod:`phasemech.experiments.explain_tables`
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

from phasemech.core.io import atomic_write, write_json_atomic


def _fmt(xs) -> str:
    return " / ".join(f"{x:.2f}" for x in xs)


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
    for lo, hi in _bands(n_layers):
        band = rec[(rec.layer >= lo) & (rec.layer <= hi)]
        if band.empty:
            continue
        g = band.groupby("phase")
        lines.append(f"| {lo}-{hi} | {_fmt(g.recall.mean())} | {_fmt(g['rank'].median())} |")
    return lines


def _oracle_lines(t: dict) -> list[str]:
    o = t.get("oracle")
    if o is None:
        return []
    lines = [
        "",
        "## Oracle: the needle's block forced into what queries read",
        "",
        "| scope | form | rows | accuracy by phase | unforced | displaced (sink share) |",
        "|---|---|---|---|---|---|",
    ]
    keep = o[o.scope.isin(["none", "all", "top heads"])]
    for (scope, form, rows), g in keep.groupby(["scope", "form", "rows"], sort=False):
        g = g.sort_values("phase")
        sink = g.displaced_sink.mean()
        lines.append(
            f"| {scope} | {form} | {rows} | {_fmt(g.accuracy)} | {_fmt(g.unforced)} | "
            f"{g.displaced.mean():.1f} ({'-' if np.isnan(sink) else f'{sink:.2f}'}) |"
        )
    return lines


def _head_lines(t: dict, top: int = 10) -> list[str]:
    lines = []
    p = t.get("patching")
    if p is not None:
        heads = p[p.site == "head"].nlargest(top, "effect")
        lines += [
            "",
            "## Top heads by exact patching (clean phase into weak phase; 1 = restored)",
            "",
            "| layer.head | effect [95% CI] | AtP estimate |",
            "|---|---|---|",
        ]
        atp = p[p.site == "atp"].set_index(["layer", "head"]).effect
        for r in heads.itertuples():
            est = atp.get((r.layer, r.head), np.nan)
            ci = f"[{r.ci_low:.3f}, {r.ci_high:.3f}]"
            lines.append(f"| {r.layer}.{r.head} | {r.effect:.3f} {ci} | {est:.3f} |")
    s = t.get("ablation_specialization")
    if s is not None:
        z = s[(s.metric == "logit_diff") & (s["mode"] == "zero")].nsmallest(top, "overall")
        lines += [
            "",
            "## Top heads by zero ablation (margin at the first answer token)",
            "",
            "| layer.head | mean effect | served phase | SI | p (perm) | p (Holm) |",
            "|---|---|---|---|---|---|",
        ]
        for r in z.itertuples():
            p = f"{r.p_perm:.3g} | {r.p_holm:.3g}"
            lines.append(
                f"| {r.layer}.{r.unit} | {r.overall:.3f} | {r.served_phase} | {r.si:.2f} | {p} |"
            )
    return lines


def write_report(
    cfg, tables: dict[str, pd.DataFrame | None], meta: dict[str, Any], out: Path
) -> dict[str, Any]:
    """``summary.md`` and ``summary.json`` under ``out``; returns the summary."""
    prompts = tables["prompts"]
    by = prompts.groupby("phase")
    acc, null = by.design_correct.mean().tolist(), by.null_correct.mean().tolist()
    summary = dict(
        config=cfg.__dict__ | {"setting": cfg.setting},
        accuracy_by_phase=acc,
        null_by_phase=null,
        n_prompts=len(prompts),
        **meta,
    )
    head = (
        f"# Explaining {cfg.setting} on {meta['model']} ({cfg.regime} regime, T = {cfg.context}, "
        f"{cfg.contents} contents x {cfg.stride} phases = {len(prompts)} prompts)"
    )
    lines = [head, "", f"Accuracy by phase: design {_fmt(acc)}; null {_fmt(null)}."]
    if meta.get("contrast_phases") and meta["contrast_phases"][0] is not None:
        s, w = meta["contrast_phases"]
        lines.append(
            f"Patching: clean = phase {s}, corrupted = phase {w}, {meta['n_pairs']} pairs."
        )
    if not any(acc):
        lines.append("The design answers no prompt: no component can be credited with it.")
    lines += (
        _selection_lines(tables, meta["n_layers"]) + _oracle_lines(tables) + _head_lines(tables)
    )
    lines += ["", f"Wall time {meta['wall_s']:.0f} s; worker time {meta['worker_s']:.0f} s."]
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "summary.md", lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    write_json_atomic(out / "summary.json", summary)
    return summary


__all__ = ["write_report"]
