"""The open fixes on a real model: grid variants of an audited design, each against the
design's aligned baseline on the same paired prompts.

Axes: ``context``, ``design``, ``variant`` (``aligned``: the baseline; every other one is a
fix), ``phase`` (on the audit's reference grid: ``needle_pos mod stride``, the phase a user of
the deployed design sees), ``group`` (a content: one cluster of the bootstrap).

A variant changes only where the compression grid falls or how much a query reads, never a
weight (post hoc designs have none), so every fix costs no training:

- offsets: ``per_head`` (KV head ``g`` of ``G`` on ``(g*d)//G``), ``per_layer`` (compressed
  layer ``r`` of ``n`` on ``(r*d)//n``), ``per_layer_head`` (both, summed mod ``d``) and
  ``random`` (one grid shift per prompt, drawn from the audit's seed and the prompt: the same
  draw for every design);
- ``overlap``: blocks of ``2d`` tokens every ``d`` (DeepSeek-V4's CSA: rate 4, windows of 8);
- ``before_window``: the candidate set: the raw span starts at a block boundary and only blocks
  wholly before it are ranked, so no top-k pick goes to a block the window already partly holds
  (:mod:`phasemech.core.grid`);
- budget: ``half_stride`` (``d/2`` with ``2k``: the same tokens read per query) and
  ``topk_x2`` / ``topk_x4`` / ``topk_x8`` (more blocks kept: the budget axis of the frontier).

A variant a design cannot take (``kpool`` refuses overlapping pools; ``mean`` keeps no top-k)
is skipped and listed. :func:`fix_table` compares each fix with its baseline by
:func:`~phasemech.measure.stats.compare_gaps` (paired cluster bootstrap over contents) and
states the KV budget (most tokens or entries one query reads at the context's end) and the
cost per forward. The goal (as for the from-scratch fixes): the debiased gap cut by >= 70% with
the cut's CI above 0, mean accuracy not lower by more than 1 point (CI), at a budget no larger.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pandas as pd

from phasemech.core.config import CompressionConfig
from phasemech.core.designs import traits
from phasemech.experiments.fixes.profiles import GOAL_REDUCTION, NONINFERIORITY


@dataclass(frozen=True)
class Variant:
    """How a fix changes the audit's grid: ``stride`` and ``top_k`` as multipliers,
    ``block_len`` as a multiple of the (new) stride, ``offsets``/``block_scope`` replaced."""

    about: str
    offsets: str | None = None
    block_scope: str | None = None
    block_len: int | None = None
    stride: float = 1
    top_k: float = 1


VARIANTS = {
    "aligned": Variant("the baseline: every layer and KV head on offset 0"),
    "per_head": Variant("offsets staggered per KV head", offsets="per_head"),
    "per_layer": Variant("offsets staggered per layer", offsets="per_layer"),
    "per_layer_head": Variant("offsets staggered per layer and KV head", "per_layer_head"),
    "random": Variant("a random grid offset per prompt", offsets="random"),
    "overlap": Variant("overlapping blocks of 2d every d", block_len=2),
    "before_window": Variant(
        "raw span from a block boundary; rank only blocks wholly before it",
        block_scope="before_window",
    ),
    "half_stride": Variant("d/2 with 2x top-k (equal budget)", stride=0.5, top_k=2),
    "topk_x2": Variant("2x top-k", top_k=2),
    "topk_x4": Variant("4x top-k", top_k=4),
    "topk_x8": Variant("8x top-k", top_k=8),
}
#: the fixes :func:`fix_table` compares with the baseline
FIXES = tuple(v for v in VARIANTS if v != "aligned")


def check_variants(variants: tuple[str, ...]) -> None:
    bad = [v for v in variants if v not in VARIANTS]
    if not variants or bad or len(set(variants)) != len(variants) or variants[0] != "aligned":
        raise ValueError(
            f"AuditConfig: variants={variants!r} is invalid: 'aligned' (the baseline) first, "
            f"then any of {FIXES}, each once"
        )


def apply_variant(comp: CompressionConfig, name: str) -> CompressionConfig:
    """``comp`` under variant ``name``; a ``ValueError`` if the design cannot take it."""
    v = VARIANTS[name]
    if name == "aligned":
        return comp
    if name == "before_window" and comp.window == 0:
        raise ValueError("with W = 0 before_window reads exactly what the baseline reads")
    if v.top_k != 1 and comp.top_k is None:
        raise ValueError(f"{comp.design} keeps no top-k")
    stride = v.stride * comp.stride
    if stride != int(stride) or stride < 1:
        raise ValueError(f"stride {comp.stride} x {v.stride} is not a whole stride")
    changes: dict = dict(stride=int(stride))
    if v.top_k != 1:
        changes["top_k"] = int(comp.top_k * v.top_k)
    if v.block_len is not None:
        changes["block_len"] = v.block_len * int(stride)
    elif comp.block_len == comp.stride:
        changes["block_len"] = None  # no overlap stays no overlap at the new stride
    if v.offsets is not None:
        changes["offsets"] = v.offsets
    if v.block_scope is not None:
        changes["block_scope"] = v.block_scope
    out = dataclasses.replace(comp, **changes)  # re-validated: a refusal raises here
    if out == comp:
        raise ValueError(f"{name} leaves the grid as it is")
    return out


# ----------------------------------------------------------------------------- the comparison
def _verdict(c: dict, equal_budget: bool) -> str:
    """The goal, on the row's 95% intervals: a cut needs a baseline gap the bootstrap
    establishes (positive in >= 95% of replicates). Not corrected for the number of rows: a
    percentile interval of a ratio at a Bonferroni level (0.05 / rows) sits in the few most
    extreme of ``n_boot`` replicates, where a near-zero baseline gap makes the ratio explode."""
    if not np.isfinite(c["gap_baseline"]) or c["gap_baseline"] <= 0:
        return "no baseline gap to cut"
    if c["reduction_dropped"] > 0.05:
        return "baseline gap not established"
    cut = c["reduction"] >= GOAL_REDUCTION and c["reduction_lo"] > 0
    kept = c["accuracy_diff_lo"] > -NONINFERIORITY
    if cut and kept and equal_budget:
        return "meets the goal"
    if cut and kept:
        return "meets it at a larger budget"
    return "cuts the gap, costs accuracy" if cut else "does not cut the gap enough"


def retrieval_mass(head_phase: pd.DataFrame, top: int = 5) -> pd.DataFrame:
    """Per (context, setting, phase): the mean answer-onto-needle attention of the null's
    ``top`` retrieval heads (the heads that attend the needle most in the uncompressed model):
    what a fix changes at the heads that do the retrieving."""
    cols = ["context", "setting", "phase", "mass"]
    if head_phase is None or head_phase.empty:
        return pd.DataFrame(columns=cols)
    out = []
    for context, h in head_phase.groupby("context"):
        null = h[h["setting"] == "null"].groupby(["layer", "head"])["mass"].mean()
        heads = null.nlargest(top).index
        keyed = h.set_index(["layer", "head"])
        at = keyed[keyed.index.isin(heads)].reset_index()
        m = at.groupby(["setting", "phase"])["mass"].mean().reset_index()
        out.append(m.assign(context=context))
    return pd.concat(out, ignore_index=True)[cols]


def fix_pairs(a, meta: dict[str, dict]) -> list[tuple[str, str, str, str]]:
    """``(design, fix, baseline setting, fix setting)``: each design's variants against its
    aligned grid, then each other selection rule against the first one audited (``route`` when
    there), both aligned: the rule as a fix (``rule_quest``: Quest's bounds in place of the
    mean key), at the same grid and budget."""
    fixes = {n: m for n, m in meta.items() if m["variant"] != "aligned"}
    pairs = [(m["design"], m["variant"], a.setting_name(m["design"], "aligned"), name)
             for name, m in fixes.items()]  # fmt: skip
    # the designs that rank blocks by a rule (the registry's; mean and partition rank nothing)
    rules = [d for d in a.probe.designs if traits(d).selector == "rule"]
    if len(rules) > 1:
        first = "route" if "route" in rules else rules[0]
        base = a.setting_name(first, "aligned")
        pairs += [(first, f"rule_{d}", base, a.setting_name(d, "aligned"))
                  for d in rules if d != first]  # fmt: skip
    return pairs


def fix_table(
    a, targets: pd.DataFrame, meta: dict[str, dict], head_phase: pd.DataFrame | None = None
) -> pd.DataFrame:
    """One row per (context, design, fix) of :func:`fix_pairs`: accuracy and debiased gap of
    baseline and fix with paired cluster-bootstrap 95% CIs (per row, not corrected for the
    number of rows), the gap reduction, budgets, seconds per forward,
    verdict, and the retrieval heads' needle attention by phase (:func:`retrieval_mass`).
    ``random``'s gap is taken on each prompt's drawn grid (``phase_grid``): on the reference
    grid a random offset flattens the gap by construction (``gap_reference`` keeps that view)."""
    mass = retrieval_mass(head_phase).set_index(["context", "setting"])
    df = targets.assign(phase=targets["needle_pos"] % a.probe.stride, seq_id=targets["group_id"])
    pairs, todo = fix_pairs(a, meta), []
    for context, t in df.groupby("context", sort=True):
        by_setting = dict(tuple(t.groupby("setting", sort=False)))
        todo += [(context, by_setting, p) for p in pairs
                 if p[2] in by_setting and p[3] in by_setting]  # fmt: skip
    rows = []
    for context, by_setting, (design, fix, base_name, name) in todo:
        budgets = (meta[base_name]["budget"][context], meta[name]["budget"][context])
        masses = [_phase_mass(mass, context, n) for n in (base_name, name)]
        pair = (by_setting[base_name], by_setting[name])
        row = _compare(a, *pair, drawn=fix == "random", budgets=budgets)
        about = VARIANTS[fix].about if fix in VARIANTS else f"{fix[5:]}'s selection rule"
        rows.append(dict(context=context, design=design, fix=fix, setting=name, about=about,
                         **row, needle_mass_baseline=masses[0], needle_mass=masses[1]))  # fmt: skip
    return pd.DataFrame(rows)


def _compare(a, base, fix, *, drawn: bool, budgets: tuple[int, int]) -> dict:
    from phasemech.measure.stats import compare_gaps

    ref = compare_gaps(base, fix, a.probe.stride, n_boot=0)["gap_other"] if drawn else None
    if drawn:
        fix = fix.assign(phase=drawn_phase(fix, a.probe.stride))
    c = compare_gaps(base, fix, a.probe.stride, n_boot=a.n_boot, seed=a.probe.seed)
    floor = max(base["correct"].mean(), fix["correct"].mean()) == 0
    verdict = _verdict(c, budgets[1] <= budgets[0])
    return dict(
        c, phase_grid="drawn" if drawn else "reference",
        gap_reference=c["gap_other"] if ref is None else ref,
        budget_baseline=budgets[0], budget=budgets[1],
        seconds_baseline=_seconds(base), seconds=_seconds(fix),
        verdict="0 on every phase: no evidence" if floor else verdict,
    )  # fmt: skip


def _seconds(t: pd.DataFrame) -> float:
    """Median seconds per forward over the prompts that read no per-head attention (those run
    the slow score path)."""
    plain = t[~t["attention"].astype(bool)] if "attention" in t else t
    return float((plain if len(plain) else t)["seconds"].median())


def drawn_phase(t: pd.DataFrame, stride: int) -> pd.Series:
    """The needle's phase on the grid each prompt was drawn with (``random``'s shift undone)."""
    return (t["needle_pos"] - t["grid_shift"]) % stride


def _phase_mass(mass: pd.DataFrame, context, name: str) -> list[float]:
    if (context, name) not in mass.index:
        return []
    return [round(float(x), 4) for x in mass.loc[[(context, name)]].sort_values("phase")["mass"]]


def drawn_grid_accuracy(a, targets: pd.DataFrame, meta: dict[str, dict]) -> pd.DataFrame:
    """``random`` settings by the phase on the grid each prompt was DRAWN with (``needle_pos -
    shift``): a random offset hides the weak phase from the reference grid, not from a prompt."""
    names = [n for n, m in meta.items() if m["variant"] == "random"]
    t = targets[targets["setting"].isin(names)]
    if t.empty:
        return pd.DataFrame(columns=["context", "setting", "drawn_phase", "accuracy", "n"])
    t = t.assign(drawn_phase=drawn_phase(t, a.probe.stride))
    g = t.groupby(["context", "setting", "drawn_phase"])["correct"]
    return g.agg(accuracy="mean", n="size").reset_index()


def fixes_markdown(table: pd.DataFrame, drawn: pd.DataFrame, skipped: list[str]) -> str:
    """``fixes.md``: the fixes table, the drawn-grid view of ``random``, what was skipped."""
    lines = [
        f"## Fixes against each design's aligned baseline (goal: debiased gap cut by >= "
        f"{GOAL_REDUCTION:.0%} with its CI above 0, mean accuracy not lower by more than "
        f"{NONINFERIORITY:.0%} (95% CI), budget no larger; {len(table)} rows, each with its own "
        "95% intervals, not corrected for the number of rows)",
        "",
        "| T | design | fix | budget (base) | acc base -> fix | acc change [95% CI] "
        "| gap base -> fix | gap cut [95% CI] | s per forward (base) | retrieval heads' needle "
        "attention by phase, base -> fix | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples():
        lines.append(
            f"| {r.context} | {r.design} | {r.fix}: {r.about} | {r.budget} ({r.budget_baseline}) "
            f"| {r.accuracy_baseline:.3f} -> {r.accuracy_other:.3f} | {r.accuracy_diff:+.3f} "
            f"[{r.accuracy_diff_lo:+.3f}, {r.accuracy_diff_hi:+.3f}] | {r.gap_baseline:.3f} -> "
            f"{r.gap_other:.3f} | {pct(r.reduction)} [{pct(r.reduction_lo)}, "
            f"{pct(r.reduction_hi)}] | {r.seconds:.2f} ({r.seconds_baseline:.2f}) | "
            f"{_masses(r.needle_mass_baseline)} -> {_masses(r.needle_mass)} | {r.verdict} |"
        )
    if len(drawn):
        lines += ["", "`random` by the phase on each prompt's drawn grid (`needle_pos - shift`):"]
        for (context, setting), g in drawn.groupby(["context", "setting"]):
            acc = ", ".join(f"phase {r.drawn_phase}: {r.accuracy:.2f} (n = {r.n})"
                            for r in g.sort_values("drawn_phase").itertuples())  # fmt: skip
            lines.append(f"- T = {context}, {setting}: {acc}")
    if skipped:
        lines += ["", "Skipped (the design cannot take the variant): " + "; ".join(skipped)]
    return "\n".join(lines) + "\n"


def _masses(xs: list[float]) -> str:
    return "/".join(f"{x:.2f}" for x in xs) if len(xs) else "n/a"


def pct(x: float) -> str:
    """A share as a whole percentage (``n/a`` when undefined)."""
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:.0f}%"


__all__ = [
    "FIXES",
    "VARIANTS",
    "Variant",
    "apply_variant",
    "check_variants",
    "drawn_grid_accuracy",
    "drawn_phase",
    "fix_pairs",
    "fix_table",
    "fixes_markdown",
    "pct",
    "retrieval_mass",
]
