"""The from-scratch gap claim at convergence, read from a phase sweep's ``summary.json`` (a
profile with a learning-rate search and ``pool_min_accuracy``, e.g. ``converged``).

The verdict rules, stated where the report prints them:

- only models that reached :data:`~phasemech.experiments.lr_search.CONVERGED` held-out
  accuracy are pooled into a setting's gap (the sweep's stats already leave the rest out); a
  setting none of whose seeds converged has no gap, and is listed as such;
- a compressed setting *has a gap* when its debiased gap's CI lies above 0 and above the CI of
  the dense control of the same stride, heads, context and width (trained on the same data to the
  same early-stop accuracy): a gap dense models show too is the task's, not the design's;
  and where dense models were evaluated, along training, at the accuracy band the setting
  ends in, the setting's held-out raw gap in that band exceeds theirs (a gap every model
  shows at that accuracy is not the design's);
- along training, each design's held-out raw gap is set against the dense one at the same
  accuracy band (the excess is what compression adds there).

Axes: rows are settings (design x stride x heads x T x d_model); bands are held-out accuracy
bands.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from phasemech.experiments.claims.sources import f3
from phasemech.experiments.experiment import Profile
from phasemech.experiments.sweep.summary import ACC_BINS, BAND_LABELS

KEYS = ["stride", "heads", "seq_len", "d_model"]
#: the width of a summary row that carries none: a profile's default (every sweep profile
#: before the wide one)
D_MODEL = Profile.d_model
#: the tables of a sweep summary that hold one row per setting (or finer); merging profiles
#: concatenates them, which is sound because every row carries its stride, heads, T and width
TABLES = ("rows", "convergence", "matched")


def merge_summaries(
    summaries: list[dict[str, Any]], d_models: list[int] | None = None
) -> dict[str, Any]:
    """One summary from the sweeps of several profiles (e.g. ``converged`` at d = 4,
    ``converged_d8``, ``converged_T128``), for one table and one verdict over all of them.
    ``d_models``: each profile's model width, given to its rows that carry none (default
    :data:`D_MODEL`). A setting (design, stride, heads, T, width) recorded by two profiles
    would be pooled twice, or against two dense controls: refused."""
    widths = [D_MODEL] * len(summaries) if d_models is None else list(d_models)
    if len(widths) != len(summaries):
        raise ValueError(f"d_models={d_models!r} is invalid: need one width per summary")
    seen: dict[tuple, int] = {}
    out: dict[str, list] = {t: [] for t in TABLES}
    for i, (s, width) in enumerate(zip(summaries, widths, strict=True)):
        for t in TABLES:
            for r in s.get(t, []):
                r = {"d_model": width, **r}  # a copy: the caller's rows stay as they were
                if r["d_model"] != width:
                    raise ValueError(
                        f"d_models[{i}]={width} is invalid: summary {i} records d_model="
                        f"{r['d_model']}"
                    )
                key = (r["design"], *(r[k] for k in KEYS))
                if seen.setdefault(key, i) != i:
                    raise ValueError(
                        f"setting {dict(zip(['design', *KEYS], key, strict=True))} is recorded "
                        f"by two sweep profiles (summaries {seen[key]} and {i}): keep one"
                    )
                out[t].append(r)
    return out


def _with_width(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` whose rows all carry a width (:data:`D_MODEL` where a row has none)."""
    width = df["d_model"] if "d_model" in df.columns else pd.Series(np.nan, index=df.index)
    return df.assign(d_model=width.fillna(D_MODEL).astype(int))


def _table(summary: dict[str, Any], name: str, columns: list[str] | None = None) -> pd.DataFrame:
    """A summary table as a frame whose rows all carry a width."""
    return _with_width(pd.DataFrame(summary.get(name, []), columns=columns))


def converged_settings(summary: dict[str, Any]) -> pd.DataFrame:
    """One row per setting: converged seeds, pooled accuracy and debiased gap with its CI,
    the dense control's gap and CI, the raw gaps at the setting's accuracy band, and
    ``has_gap`` by the rule above."""
    conv, rows = _table(summary, "convergence"), _table(summary, "rows")
    if not len(conv):
        return pd.DataFrame()
    n = conv.groupby(["design", *KEYS])["converged"].agg(["sum", "count"]).reset_index()
    pooled = rows[
        (rows["seed"] == "pooled") & (rows["targets"] == "all") & (rows["step"] == "final")
    ]
    cols = ["design", *KEYS, "accuracy", "debiased_gap", "debiased_lo", "debiased_hi"]
    out = n.merge(pooled[cols] if len(pooled) else pd.DataFrame(columns=cols), how="left")
    dense = out[out["design"] == "none"][[*KEYS, "debiased_gap", "debiased_lo", "debiased_hi"]]
    dense = dense.rename(columns=lambda c: c if c in KEYS else f"dense_{c.split('_', 1)[1]}")
    out = _at_own_band(out.merge(dense, on=KEYS, how="left"), summary)
    above_dense = out["debiased_lo"] > out["dense_hi"].fillna(np.inf)
    # where dense models were evaluated at the setting's accuracy band, its gap there must
    # exceed theirs too (a gap any model shows at that accuracy is not the design's)
    beyond_matched = out["band_dense_gap"].isna() | (out["band_gap"] > out["band_dense_gap"])
    out["has_gap"] = (
        (out["design"] != "none") & (out["debiased_lo"] > 0) & above_dense & beyond_matched
    )
    return out.rename(columns={"sum": "converged", "count": "seeds"})


def _at_own_band(out: pd.DataFrame, summary: dict[str, Any]) -> pd.DataFrame:
    """Add each setting's accuracy band (of its pooled final accuracy), its mean held-out raw
    gap along training in that band (``band_gap``, over ``band_n`` evaluations) and the dense
    control's (``band_dense_gap``, ``band_dense_n``; NaN where dense models were never
    evaluated at that accuracy)."""
    band = pd.cut(out["accuracy"], ACC_BINS, labels=BAND_LABELS, right=False)
    out = out.assign(band=band.astype(object))  # NaN where no seed converged
    m = _table(summary, "matched", columns=["design", *KEYS, "band", "raw_gap", "n"])
    own = m.rename(columns={"raw_gap": "band_gap", "n": "band_n"})
    dense = own[own["design"] == "none"].drop(columns="design")
    dense = dense.rename(columns={"band_gap": "band_dense_gap", "band_n": "band_dense_n"})
    # one matched row per (setting, band): these merges add columns, never rows
    return out.merge(own, on=["design", *KEYS, "band"], how="left", validate="one_to_one").merge(
        dense, on=[*KEYS, "band"], how="left", validate="many_to_one"
    )


def _band_cell(r) -> str:
    if pd.isna(r.band):  # no seed converged: nothing to compare
        return "-"
    mine = "no evaluation" if pd.isna(r.band_gap) else f"{f3(r.band_gap)} ({int(r.band_n)})"
    dense = (
        "no dense evaluation"
        if pd.isna(r.band_dense_gap)
        else f"{f3(r.band_dense_gap)} ({int(r.band_dense_n)})"
    )
    return f"{mine} / {dense} (band {r.band})"


def matched_excess(summary: dict[str, Any]) -> pd.DataFrame:
    """Per design and accuracy band: its mean held-out raw gap minus the dense one's."""
    m = _table(summary, "matched")
    if not len(m):
        return m
    dense = m[m["design"] == "none"][[*KEYS, "band", "raw_gap"]]
    out = m[m["design"] != "none"].merge(
        dense.rename(columns={"raw_gap": "dense_raw_gap"}), on=[*KEYS, "band"], how="inner"
    )
    return out.assign(excess=out["raw_gap"] - out["dense_raw_gap"])


def _width(d_model: int) -> str:
    return "" if d_model == D_MODEL else f" d_model={d_model}"


def converged_claim_lines(summary: dict[str, Any], source: str) -> tuple[list[str], str]:
    """Markdown lines for the report and the verdict."""
    s = converged_settings(summary)
    if not len(s):
        return [f"- `{source}` holds no convergence table."], "not measured"
    lines = [
        "| design | d | H | T | d_model | converged seeds | accuracy | debiased gap [95% CI] | "
        "dense gap [95% CI] | raw gap at the same accuracy: design / dense (evaluations) | "
        "gap beyond dense |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s.sort_values([*KEYS, "design"]).itertuples():
        gap = (
            f"{f3(r.debiased_gap)} [{f3(r.debiased_lo)}, {f3(r.debiased_hi)}]"
            if r.converged
            else "none converged: no gap"
        )
        dense = f"{f3(r.dense_gap)} [{f3(r.dense_lo)}, {f3(r.dense_hi)}]"
        lines.append(
            f"| {r.design} | {r.stride} | {r.heads} | {r.seq_len} | {r.d_model} "
            f"| {r.converged} of {r.seeds} "
            f"| {f3(r.accuracy) if r.converged else '-'} | {gap} | {dense} | {_band_cell(r)} | "
            f"{'yes' if r.has_gap else 'no'} |"
        )
    ex = matched_excess(summary)
    if len(ex):
        top = ex.loc[ex["excess"].idxmax()]
        lines += [
            "",
            f"Along training, at equal held-out accuracy, the largest excess of a design's raw "
            f"gap over the dense one is {f3(top['excess'])} ({top['design']} d={top['stride']} "
            f"H={top['heads']} T={top['seq_len']}{_width(top['d_model'])}, accuracy band "
            f"{top['band']}, {top['n']} "
            "evaluations).",
        ]
    gapped = s[s["has_gap"]]
    verdict = (
        "**Supported at convergence** for "
        + ", ".join(
            f"{r.design} d={r.stride} H={r.heads} T={r.seq_len}{_width(r.d_model)}"
            # one model's CI resamples its content only, not seeds: say so beside it
            + (" (one converged seed)" if r.converged == 1 else "")
            for r in gapped.itertuples()
        )
        if len(gapped)
        else "**Not supported at convergence**: no converged compressed setting has a gap "
        "beyond its dense control"
    )
    return lines, verdict


def interventions_claim_lines(summary: dict[str, Any], source: str) -> tuple[list[str], str]:
    """Markdown lines for the specialisation claim from an interventions ``summary.json`` of
    converged models, and its verdict: compressed models with a phase-dependent head (its
    zero-ablation effect differs across phases, Holm p < 0.05, range >= 10 points) against the
    dense controls of the same d: supported at a d where a larger share of compressed models
    than of dense ones has such a head (a dense control's is the task's, not the compression's)."""
    models = pd.DataFrame(summary.get("models", []))
    if not len(models):
        return [f"- `{source}` holds no models."], "not measured"
    lines = []
    for r in models.itertuples():
        served = f"; heads opening a weak spot (served phase): {r.heads_opening_weak_spot}"
        lines.append(
            f"- {r.model}: accuracy {f3(r.accuracy)}, per-phase range "
            f"{r.phase_range_pts:.1f} pts, {r.phase_dependent_heads} phase-dependent heads"
            + (served if r.heads_opening_weak_spot else "")
            + "."
        )
    # each d (and width) against its own dense controls: at d = 8 the task itself can make a
    # dense head's ablation effect phase-dependent (its data are laid out on the stride-8 grid)
    models = _with_width(models)
    per_d = []
    for (d, width), g in models.groupby(["stride", "d_model"]):
        comp, dense = g[g["design"] != "none"], g[g["design"] == "none"]
        sig = int((comp["phase_dependent_heads"] > 0).sum())
        dense_sig = int((dense["phase_dependent_heads"] > 0).sum())
        ok = bool(sig) and len(dense) > 0 and sig / len(comp) > dense_sig / len(dense)
        per_d.append(
            (ok, f"d = {d}{_width(width)}: {sig} of {len(comp)} converged compressed models have a "
                 f"phase-dependent head, {dense_sig} of {len(dense)} dense controls do")
        )  # fmt: skip
    supported = [t for ok, t in per_d if ok]
    rest = [t for ok, t in per_d if not ok]
    verdict = (
        "**Supported at convergence** at " + "; ".join(supported)
        + ("" if not rest else "; not at " + "; ".join(rest))
        if supported
        else "**Not supported at convergence**: " + "; ".join(rest)
    )  # fmt: skip
    return lines, verdict


__all__ = [
    "D_MODEL",
    "converged_claim_lines",
    "merge_summaries",
    "converged_settings",
    "interventions_claim_lines",
    "matched_excess",
]
