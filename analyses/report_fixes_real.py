"""The claims report's section 7: the open fixes tested on a real model, post hoc, at zero
training cost (``phasemech audit --fix``).

Axes: ``run`` (one recorded fixes audit: a regime and a context), ``design``, ``fix``.

Reads every ``analyses/results/audit_fixes_*.json`` (an audit folder's ``summary.json``, copied
there once the run is done; its ``fixes`` records are :func:`phasemech.experiments.audit_fixes.
fix_table` rows). Numbers come from those files only; the verdict is the rule written next to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from phasemech.experiments.fixes import GOAL_REDUCTION, NONINFERIORITY

TITLE = "## 7. The fixes on a real model: SmolLM2-135M, post hoc, no training"


def fix_audits(results: Path) -> list[tuple[str, dict]]:
    """The recorded fixes audits, ``(file stem, summary)``, decode regime first."""
    runs = [(p.stem, json.loads(p.read_text())) for p in sorted(results.glob("audit_fixes_*.json"))]
    return sorted(runs, key=lambda r: (r[1]["config"]["regime"] != "decode", r[0]))


def audit_command(cfg: dict, design: str, fix: str) -> str:
    """The ``phasemech audit`` command that reproduces one row (its design, fix and grid)."""
    layers = cfg["layers"]
    span = "" if layers is None else f" --layers {min(layers)}-{max(layers)}"
    k = f" --top-k {cfg['top_k']}" if design != "mean" else ""
    return (
        f"phasemech audit --design {design} --regime {cfg['regime']} --stride {cfg['stride']}"
        f" --window {cfg['window']}{k} --context {','.join(map(str, cfg['contexts']))}"
        f" --contents {cfg['contents']}{span} --fix {fix} -o DIR"
    )


def _pct(x) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:.0f}%"


def _run_lines(stem: str, run: dict) -> tuple[list[str], pd.DataFrame]:
    cfg, fixes = run["config"], pd.DataFrame(run["fixes"])
    out = [
        f"**{cfg['regime']} regime**, `analyses/results/{stem}.json` ({cfg['contents']} contents x "
        f"{cfg['stride']} phases per setting, top-k {cfg['top_k']}, W = {cfg['window']}, "
        f"{run['wall_s']:.0f} s wall, {run['worker_s']:.0f} worker-s):",
        "",
        "| T | design | fix | budget (base) | accuracy base -> fix [change CI] "
        "| debiased gap base -> fix | gap cut [95% CI] | verdict | command |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in fixes.itertuples():
        out.append(
            f"| {r.context} | {r.design} | {r.fix} | {r.budget} ({r.budget_baseline}) | "
            f"{r.accuracy_baseline:.3f} -> {r.accuracy_other:.3f} [{r.accuracy_diff_lo:+.3f}, "
            f"{r.accuracy_diff_hi:+.3f}] | {r.gap_baseline:.3f} -> {r.gap_other:.3f} | "
            f"{_pct(r.reduction)} [{_pct(r.reduction_lo)}, {_pct(r.reduction_hi)}] | {r.verdict} "
            f"| `{audit_command(cfg, r.design, r.fix)}` |"
        )
    return out + [""], fixes


def closest(fixes: pd.DataFrame) -> pd.Series | None:
    """Among fixes whose baseline has a gap to cut and whose accuracy holds (CI above the
    margin), the largest gap cut; else the largest cut at any accuracy."""
    live = fixes[fixes["gap_baseline"] > 0]
    if live.empty:
        return None
    held = live[live["accuracy_diff_lo"] > -NONINFERIORITY]
    pool = held if len(held) else live
    return pool.loc[pool["reduction"].idxmax()]


def claim_real_fixes(results: Path) -> str:
    out = [
        TITLE,
        "",
        "*Question*: can an inference engineer keep a design and remove its weak phase by moving "
        "the grid (staggered or random offsets), overlapping blocks, changing the candidate set "
        "or the rule, or buying budget? Goal: the debiased gap cut by "
        f">= {GOAL_REDUCTION:.0%} with its CI above 0, mean accuracy not lower by more than "
        f"{NONINFERIORITY:.0%} (CI), at a budget no larger than the baseline's.",
        "",
    ]
    runs = fix_audits(results)
    if not runs:
        cmd = "phasemech audit --design route,quest --top-k 1 --fix all -o DIR"
        return "\n".join(
            [
                *out,
                f"*Not measured yet*: no `analyses/results/audit_fixes_*.json`; run `{cmd}`.",
                "",
                "Verdict: **Open**.",
            ]  # fmt: skip
        )
    met, tables = [], []
    for stem, run in runs:
        lines, fixes = _run_lines(stem, run)
        out += lines
        tables.append(fixes.assign(regime=run["config"]["regime"]))
        met += [f"{r.design}/{r.fix} ({r.regime}, T = {r.context})"
                for r in tables[-1].itertuples() if r.verdict == "meets the goal"]  # fmt: skip
    every = pd.concat(tables, ignore_index=True)
    best = closest(every)
    if met:
        verdict = f"**Goal met** by {', '.join(met)}"
    elif best is None:
        verdict = "**Not testable**: no baseline had a positive gap to cut"
    else:
        verdict = (
            f"**Goal not met** by any fix; closest: {best.design}/{best.fix} ({best.regime}, "
            f"T = {best.context}): gap cut {_pct(best.reduction)} [{_pct(best.reduction_lo)}, "
            f"{_pct(best.reduction_hi)}], accuracy change {best.accuracy_diff:+.3f} "
            f"[{best.accuracy_diff_lo:+.3f}, {best.accuracy_diff_hi:+.3f}], budget "
            f"{best.budget} vs {best.budget_baseline}"
        )
    figs = [f"`analyses/results/{stem}_frontier.png`" for stem, _ in runs]
    out += [f"Verdict (the rule above, per row): {verdict}.", "", "Frontier: " + ", ".join(figs)]
    return "\n".join(out)


__all__ = ["audit_command", "claim_real_fixes", "closest", "fix_audits"]
