"""The audit's report: tidy tables, ``summary.md``, ``summary.json`` and ``audit.html``.

Axes: ``context``, ``setting`` (``null`` first), ``phase``, ``depth``, ``layer``, ``head``.

With fix variants (``AuditConfig.variants``) also ``fixes`` (context, design, fix: accuracy and
gap against the aligned baseline, budgets, verdict; :mod:`phasemech.experiments.audit.fixes`),
``drawn_grid`` and ``frontier_T<context>.html``/``.png``.

Tables (parquet, one row per): ``targets`` (context, setting, prompt: correct, first_correct,
logprob, phase, depth, ...), ``per_phase`` (context, setting, phase: accuracy with cluster-
bootstrap CIs), ``depth_phase`` (context, setting, depth, phase), ``head_phase`` (context,
setting, layer, head, phase: mean answer-onto-needle attention) and ``summary`` (context,
setting: accuracy, debiased gap with CI, permutation / logistic / Cochran / McNemar tests, and
what an average or a random-offset test would report). A setting that retrieves nothing at
any phase is no evidence of a phase effect either way; ``summary.md`` says so beside it.
``audit.html`` (one per context; ``audit.html`` is the first) is the interactive page of
:mod:`phasemech.viz.audit`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.experiments.audit.fixes import drawn_grid_accuracy, fix_table, fixes_markdown
from phasemech.measure.pretrained import Setting, report


def _settings(a) -> list[Setting]:
    return [Setting(name, comp) for name, comp in a.settings()]


def average_claim(row: pd.Series, null: pd.Series) -> str:
    """What a phase-blind test would report for this setting."""
    by = np.asarray(row["acc_by_phase"], dtype=float)
    return (
        f"an average (or random-offset) test reports {row['accuracy']:.3f} "
        f"({row['accuracy'] - null['accuracy']:+.3f} vs the null) and hides a per-phase "
        f"range of {np.nanmin(by):.3f}-{np.nanmax(by):.3f}"
    )


def tables(
    a, targets: pd.DataFrame, heads: pd.DataFrame, n_heads: int = 0
) -> dict[str, pd.DataFrame]:
    """Every table of the report, per context (``n_heads``: the model's query heads)."""
    summaries, phases, depths, head_rows = [], [], [], []
    meta = a.setting_meta(n_heads)
    for context, t in targets.groupby("context", sort=True):
        summary, per_phase = report(
            t, _settings(a), a.probe.stride, a.n_boot, a.n_perm, a.probe.seed
        )
        null = summary.iloc[0]
        summary["average_claim"] = [average_claim(r, null) for _, r in summary.iterrows()]
        for key in ("design", "variant"):
            summary[key] = [meta[n][key] for n in summary["setting"]]
        summary["budget"] = [meta[n]["budget"][context] for n in summary["setting"]]
        seconds = t.groupby("setting")["seconds"].median()
        summary["seconds"] = [float(seconds[n]) for n in summary["setting"]]
        summaries.append(summary.assign(context=context))
        phases.append(per_phase.assign(context=context))
        d = t.groupby(["setting", "depth", "phase"], sort=False)["correct"]
        depths.append(d.agg(accuracy="mean", n="size").reset_index().assign(context=context))
    if len(heads):
        keys = ["context", "setting", "layer", "head", "phase"]
        head_rows.append(heads.groupby(keys, sort=False)["mass"].mean().reset_index())
    out = {
        "targets": targets,
        "summary": pd.concat(summaries, ignore_index=True),
        "per_phase": pd.concat(phases, ignore_index=True),
        "depth_phase": pd.concat(depths, ignore_index=True),
        "head_phase": pd.concat(head_rows, ignore_index=True) if head_rows else heads,
    }
    if len(a.variants) > 1:
        out["fixes"] = fix_table(a, targets, meta, out["head_phase"] if len(heads) else None)
        out["drawn_grid"] = drawn_grid_accuracy(a, targets, meta)
    return out


def _f(x, spec: str = ".3f") -> str:
    return "" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def summary_markdown(a, summary: pd.DataFrame, wall_s: float, worker_s: float) -> str:
    """``summary.md``: per context and setting, per-phase accuracy with CIs, the gap and the
    paired tests, and the phase-blind claim."""
    p = a.probe
    n_prompts = p.contents * p.stride
    lines = [
        f"# Phase audit of {p.model} ({p.regime} regime, task {p.task})",
        "",
        f"{p.contents} contents x {p.stride} phases = {n_prompts} paired prompts per context and "
        f"setting, depths {list(p.depths)}; correct = every answer token is the argmax "
        "(teacher-forced). CIs: cluster bootstrap over contents; gap: max - min per-phase "
        "accuracy, debiased against its permutation null; p (Cochran): Cochran's Q over the "
        f"paired phases. Wall time {wall_s:.0f} s; worker time {worker_s:.0f} s.",
        "",
        "| T | setting | acc | acc by phase [95% CI] | debiased gap [95% CI] | p (perm) "
        "| p (Cochran) | McNemar min p_Holm (pair) | what a phase-blind test reports |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary.itertuples():
        by = " ".join(
            f"{x:.2f} [{lo:.2f}, {hi:.2f}]"
            for x, lo, hi in zip(r.acc_by_phase, r.ci_lo, r.ci_hi, strict=True)
        )
        floor = " (0 on every phase: no evidence either way)" if max(r.acc_by_phase) == 0 else ""
        lines.append(
            f"| {r.context} | {r.setting}: {r.description}{floor} | {r.accuracy:.3f} | {by} | "
            f"{_f(r.debiased_gap)} [{_f(r.gap_lo)}, {_f(r.gap_hi)}] | {_f(r.p_perm, '.2g')} | "
            f"{_f(r.p_cochran, '.2g')} | {_f(r.mcnemar_min_p_holm, '.2g')} ({r.mcnemar_pair}) "
            f"| {r.average_claim} |"
        )
    return "\n".join(lines) + "\n"


def _page_summary(a, summary: pd.DataFrame, context: int) -> dict[str, Any]:
    rows, p = summary[summary.context == context], a.probe
    keys = ("setting", "description", "accuracy", "acc_by_phase", "debiased_gap", "gap_lo",
            "gap_hi", "p_perm", "p_cochran", "average_claim")  # fmt: skip
    return json_safe(
        dict(
            title=f"Phase audit: {p.model}, {p.regime} regime, T = {context}",
            model=p.model, task=p.task, regime=p.regime, context=int(context),
            stride=p.stride, contents=p.contents,
            settings=[{k: r[k] for k in keys} for _, r in rows.iterrows()],
        )
    )  # fmt: skip


def _write_frontiers(a, summary: pd.DataFrame, out: Path) -> None:
    """``frontier_T<context>.html`` (and ``.png`` where kaleido can draw): budget vs accuracy
    vs gap of every design and variant."""
    from phasemech.viz.audit_fixes import frontier_figure

    p = a.probe
    for context, rows in summary.groupby("context"):
        title = f"Fixes frontier: {p.model}, {p.regime} regime, T = {context}"
        fig = frontier_figure(rows, title)
        html = out / f"frontier_T{context}.html"
        atomic_write(html, lambda tmp, fig=fig: fig.write_html(tmp, include_plotlyjs=True))
        try:
            png = out / f"frontier_T{context}.png"
            atomic_write(png, lambda tmp, fig=fig: fig.write_image(tmp, format="png", scale=2))
        except Exception as err:  # noqa: BLE001 - no browser for kaleido: the HTML still stands
            print(f"frontier PNG not drawn ({type(err).__name__}: {err}); see {html.name}")


def write_report(
    a,
    targets: pd.DataFrame,
    heads: pd.DataFrame,
    out: Path,
    wall_s: float,
    worker_s: float,
    n_heads: int = 0,
) -> dict[str, Any]:
    """Write every table, ``summary.md``, ``summary.json`` and the pages into ``out``."""
    from phasemech.viz.audit import write_audit_html

    out.mkdir(parents=True, exist_ok=True)
    t = tables(a, targets, heads, n_heads)
    for name, df in t.items():
        atomic_write(out / f"{name}.parquet", lambda tmp, df=df: df.to_parquet(tmp))
    md = summary_markdown(a, t["summary"], wall_s, worker_s)
    if "fixes" in t:
        md += "\n" + fixes_markdown(t["fixes"], t["drawn_grid"], a.skipped())
        _write_frontiers(a, t["summary"], out)
    write_text_atomic(out / "summary.md", md)
    for i, context in enumerate(sorted(targets.context.unique())):
        sel = {k: t[k][t[k].context == context].drop(columns="context")
               for k in ("per_phase", "depth_phase", "head_phase")}  # fmt: skip
        page = _page_summary(a, t["summary"], context)
        names = ["audit.html"] if i == 0 else []
        for name in names + [f"audit_T{context}.html"]:
            write_audit_html(out / name, sel["per_phase"], sel["depth_phase"],
                             sel["head_phase"], page)  # fmt: skip
    payload = json_safe(
        dict(config=a.to_dict(), wall_s=wall_s, worker_s=worker_s,
             prompts=int(len(targets)), rows=t["summary"].to_dict(orient="records"),
             fixes=t["fixes"].to_dict(orient="records") if "fixes" in t else [],
             skipped=a.skipped())
    )  # fmt: skip
    write_json_atomic(out / "summary.json", payload)
    return payload


__all__ = ["average_claim", "summary_markdown", "tables", "write_report"]
