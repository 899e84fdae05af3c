"""The claims report's section 7: the open fixes tested on a real model, post hoc, at zero
training cost (``phasemech audit --fix``).

Axes: ``run`` (one recorded fixes audit: a regime and its contexts), ``design``, ``fix``.

Reads every ``RESULTS/audit_fixes_*.json`` (an audit folder's ``summary.json``, copied there
once the run is done, with its frontier as ``RESULTS/<same stem>_frontier.png``; its ``fixes``
records are :func:`phasemech.experiments.audit.fixes.fix_table` rows). Numbers come from those
files only; the verdict is the rule written next to it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from phasemech.experiments.audit.config import AuditConfig
from phasemech.experiments.audit.fixes import pct
from phasemech.experiments.fixes.profiles import GOAL_REDUCTION, NONINFERIORITY

TITLE = "## 7. The fixes on a real model, post hoc, at no training cost"
#: ``AuditConfig`` fields and the ``phasemech audit`` flags that set them
_FLAGS = {"model": "--model", "regime": "--regime", "stride": "--stride", "window": "--window",
          "block_len": "--block-len", "obs_window": "--obs-window", "offsets": "--offsets",
          "task": "--task", "distractors": "--distractors", "contents": "--contents",
          "attention_groups": "--attention-groups", "seed": "--seed",
          "sink_tokens": "--sink-tokens"}  # fmt: skip
#: the fixes that move the grid (the paper's open question: do they remove the weak spot?)
OFFSET_FIXES = ("per_head", "per_layer", "per_layer_head", "random")


def fix_audits(results: Path) -> list[tuple[str, dict]]:
    """The recorded fixes audits, ``(file stem, summary)``, decode regime first."""
    runs = [(p.stem, json.loads(p.read_text())) for p in sorted(results.glob("audit_fixes_*.json"))]
    return sorted(runs, key=lambda r: (r[1]["config"]["regime"] != "decode", r[0]))


def audit_command(cfg: dict, design: str, fix: str) -> str:
    """The ``phasemech audit`` command that reproduces one row: its design(s), fix and every
    field of the audit that is not at its default (``rule_X``: ``--design route,X``)."""
    default = AuditConfig().to_dict()  # the probe's fields and the audit's, flat
    designs = f"{design},{fix[5:]}" if fix.startswith("rule_") else design
    parts = ["phasemech audit", f"--design {designs}"]
    parts += [f"{flag} {cfg[k]}" for k, flag in _FLAGS.items() if cfg.get(k) != default.get(k)]
    if design != "mean" and fix[5:] != "mean":
        parts.append(f"--top-k {cfg['top_k']}")
    parts.append(f"--context {','.join(map(str, cfg['contexts']))}")
    if list(cfg["depths"]) != list(default["depths"]):
        parts.append(f"--depths {','.join(map(str, cfg['depths']))}")
    if cfg["layers"] is not None:
        parts.append(f"--layers {','.join(map(str, _ranges(cfg['layers'])))}")
    if not fix.startswith("rule_"):
        parts.append(f"--fix {fix}")
    return " ".join([*parts, "-o DIR"])


def _ranges(layers: list[int]) -> list[str]:
    """``[2, 3, 4, 7]`` -> ``["2-4", "7"]``."""
    out, start = [], None
    for i, x in enumerate(layers):
        start = x if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x > start else f"{x}")
            start = None
    return out


def _run_lines(stem: str, run: dict) -> tuple[list[str], pd.DataFrame]:
    cfg, fixes = run["config"], pd.DataFrame(run["fixes"])
    sink = f", the first {cfg['sink_tokens']} tokens read raw (sink)" if _sink(run) else ""
    out = [
        f"**{cfg['model']}, {cfg['regime']} regime{sink}**, `analyses/results/{stem}.json` "
        f"({cfg['contents']} contents x {cfg['stride']} phases per setting, top-k "
        f"{cfg['top_k']}, W = {cfg['window']}; {run['worker_s']:.0f} worker-s, summed over "
        "its jobs):",
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
            f"{pct(r.reduction)} [{pct(r.reduction_lo)}, {pct(r.reduction_hi)}] | {r.verdict} "
            f"| `{audit_command(cfg, r.design, r.fix)}` |"
        )
    return out + [""], fixes


def closest(fixes: pd.DataFrame) -> pd.Series | None:
    """Among fixes whose baseline gap is established and whose accuracy holds (CI above the
    margin), the largest gap cut; else the largest cut at any accuracy."""
    live = fixes[~fixes["verdict"].isin(NO_BASELINE)]
    if live.empty:
        return None
    held = live[live["accuracy_diff_lo"] > -NONINFERIORITY]
    pool = held if len(held) else live
    return pool.loc[pool["reduction"].idxmax()]


#: a row's verdict where its baseline has no established gap (it cannot meet the goal)
NO_BASELINE = ("no baseline gap to cut", "baseline gap not established",
               "0 on every phase: no evidence")  # fmt: skip


def multiplicity_line(tables: list[pd.DataFrame]) -> str:
    """How many rows the section tests and that it does not correct for them."""
    rows = sum(len(t) for t in tables)
    live = sum(int((~t["verdict"].isin(NO_BASELINE)).sum()) for t in tables)
    return (
        f"The section tests {rows} rows in {len(tables)} runs; {live} have an established "
        "baseline gap, the only ones that can meet the goal. Their 95% intervals are each "
        f"row's own, not corrected for the {live} rows (the audits record intervals, not "
        f"p-values, so no Holm correction over the rows is applied): at 95% per interval about "
        f"{0.05 * live:.1f} of them could pass one interval by chance, so a row that meets the "
        "goal is a candidate to replicate on fresh contents, not a corrected finding."
    )


def claim_real_fixes(results: Path) -> str:
    """Section 7 of the claims report, from the recorded fixes audits in ``results``."""
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
    if runs:
        out[-2] += " " + multiplicity_line([pd.DataFrame(r["fixes"]) for _, r in runs])
    if not runs:
        cmd = "phasemech audit --design route,quest --top-k 1 --fix all -o DIR"
        missing = f"*Not measured yet*: no `analyses/results/audit_fixes_*.json`; run `{cmd}`."
        return "\n".join([*out, missing, "", "Verdict: **Open**."])
    tables = {False: [], True: []}  # without, with the sink
    for stem, run in runs:
        lines, fixes = _run_lines(stem, run)
        out += lines
        cfg = run["config"]
        tables[_sink(run)].append(fixes.assign(regime=cfg["regime"], top_k=cfg["top_k"]))
    if tables[False]:
        out += [f"Verdict (the rule above, per row): {_verdict(tables[False])}.", ""]
    if tables[True]:
        out += [_sink_verdict(tables[True]), ""]
    figs = [f"`analyses/results/{s}_frontier.png`" for s, _ in runs
            if (results / f"{s}_frontier.png").is_file()]  # fmt: skip
    out.append("Frontier: " + (", ".join(figs) if figs else "(not recorded)"))
    return "\n".join(out)


def _sink(run: dict) -> bool:
    return bool(run["config"].get("sink_tokens"))


def _where(r) -> str:
    """``regime, T = ..., top-k ...`` of a fixes row (runs differ in each)."""
    return f"{r.regime}, T = {r.context}, top-k {r.top_k}"


def _met(tables: list[pd.DataFrame], fixes: tuple[str, ...] | None = None) -> list[str]:
    """``design/fix (regime, T, top-k)`` of each row that meets the goal (among ``fixes``)."""
    return [f"{r.design}/{r.fix} ({_where(r)})"
            for t in tables for r in t.itertuples()
            if r.verdict == "meets the goal" and (fixes is None or r.fix in fixes)]  # fmt: skip


def _describe(best: pd.Series) -> str:
    return (
        f"gap cut {pct(best.reduction)} [{pct(best.reduction_lo)}, {pct(best.reduction_hi)}], "
        f"accuracy change {best.accuracy_diff:+.3f} [{best.accuracy_diff_lo:+.3f}, "
        f"{best.accuracy_diff_hi:+.3f}], budget {best.budget} vs {best.budget_baseline}"
    )


def _remaining(moved: pd.DataFrame) -> list[str]:
    """Each design and run (regime, T, top-k) where no offset fix meets the goal, with its
    closest offset fix, or why none can (its aligned baseline has no established gap)."""
    out = []
    for _, g in moved.groupby(["regime", "context", "top_k", "design"], sort=False):
        if (g["verdict"] == "meets the goal").any():
            continue
        best, r = closest(g), g.iloc[0]
        why = "no baseline gap to cut" if best is None else f"closest {best.fix}, {_describe(best)}"
        out.append(f"{r.design} ({_where(r)}): {why}")
    return out


def _sink_verdict(tables: list[pd.DataFrame]) -> str:
    """Issue 36's question: once the sink is handled, does an offset fix meet the goal?"""
    offsets = _met(tables, OFFSET_FIXES)
    rest = [m for m in _met(tables) if m not in offsets]
    moved = pd.concat(tables, ignore_index=True)
    moved = moved[moved["fix"].isin(OFFSET_FIXES)]
    head = "With the attention sink handled (the runs above that read it raw), offset fixes: "
    if offsets:
        head += f"**Goal met** by {', '.join(offsets)}"
    else:
        head += _verdict([moved]) if len(moved) else "**Not tested**: no offset fix was run"
    others = ", ".join(rest) if rest else "none"
    left = _remaining(moved)
    tail = f" Where no offset fix meets it: {'; '.join(left)}." if left else ""
    return f"{head}. Other fixes that meet it with the sink: {others}.{tail}"


def _verdict(tables: list[pd.DataFrame]) -> str:
    met = _met(tables)
    if met:
        return f"**Goal met** by {', '.join(met)}"
    best = closest(pd.concat(tables, ignore_index=True))
    if best is None:
        return "**Not testable**: no baseline had an established gap to cut"
    where = f"{best.design}/{best.fix} ({_where(best)})"
    return f"**Goal not met** by any fix; closest: {where}: {_describe(best)}"


__all__ = [
    "NO_BASELINE",
    "OFFSET_FIXES",
    "TITLE",
    "audit_command",
    "claim_real_fixes",
    "closest",
    "fix_audits",
    "multiplicity_line",
]
