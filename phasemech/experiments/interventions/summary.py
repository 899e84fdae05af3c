"""The interventions experiment's summary: the small tables each job returns, the overview row
per model, the pooled head clusters and the markdown (``summary.md``).

:func:`summary_tables` runs inside an :class:`~phasemech.experiments.interventions
.InterventionJob` on the folder the job has just written; everything else runs in the finish on
the jobs' results alone (they travel back through Ray: the finish reads no job's folder).

Axes: ``layer, unit, phase``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from phasemech.interventions.specialization import floor_note

_EFFECT_COLUMNS = ["component", "mode", "layer", "unit", "phase", "baseline", "ablated", "effect"]


def _records(df: pd.DataFrame) -> dict[str, list]:
    return df.reset_index(drop=True).to_dict(orient="list")


def summary_tables(folder: Path) -> dict[str, Any]:
    """What the summary reads from one model's folder, as JSON-able columns: the accuracy
    effects of every ablation, the specialization table, per contrast the head patching by
    phase (patched layers) with its clean/corrupted means and the 5 largest by-position
    patches, the answer contrast's entry and pattern patches, attribution vs exact (overall
    and by position class) and the phase probes."""
    effects = pd.read_parquet(folder / "ablate" / "effects.parquet")
    acc = effects.loc[effects.metric == "accuracy", _EFFECT_COLUMNS]
    patches = {}
    for kind in ("grid", "answer"):
        sub = folder / f"patch_{kind}_z"
        if not sub.exists():
            continue
        meta = json.loads((sub / "patch.json").read_text())
        bp = pd.read_parquet(sub / "by_phase.parquet")
        bp = bp.loc[bp.layer.isin(meta["layers"]), ["layer", "unit", "phase", "normalized"]]
        pos = pd.read_parquet(folder / f"patch_{kind}_z_pos" / "effects.parquet")
        top = pos.reindex(pos.normalized.abs().sort_values(ascending=False).index).head(5)
        meta_pos = json.loads((folder / f"patch_{kind}_z_pos" / "patch.json").read_text())
        patches[kind] = {
            "clean_mean": meta["clean_mean"],
            "corrupted_mean": meta["corrupted_mean"],
            "by_phase": _records(bp),
            "top": _records(top[["layer", "unit", "pos", "normalized"]]),
            "n_run": meta_pos["n_run"],
        }
    sites = {}
    for site in ("kv_block", "pattern"):
        sub = folder / f"patch_answer_{site}"
        if sub.exists():
            eff = pd.read_parquet(sub / "effects.parquet")
            sites[site] = _records(eff[["layer", "unit", "normalized"]])
    return {
        "effects": _records(acc),
        "specialization": _records(pd.read_parquet(folder / "ablate" / "specialization.parquet")),
        "patches": patches,
        "sites": sites,
        "attribution": _records(pd.read_parquet(folder / "attribution.parquet")),
        "attribution_where": _records(pd.read_parquet(folder / "attribution_where.parquet")),
        "probe": _records(pd.read_parquet(folder / "probe.parquet")),
    }


def _frame(columns: dict[str, list]) -> pd.DataFrame:
    """A returned table as a frame, ``component`` and ``mode`` categorical again (JSON made them
    strings): tables list units in the ablation's component and mode order, not alphabetically."""
    from phasemech.interventions.ablation import COMPONENTS, MODES

    df = pd.DataFrame(columns)
    for col, cats in (("component", COMPONENTS), ("mode", MODES)):
        if col in df.columns:
            df[col] = pd.Categorical(df[col], categories=list(cats))
    return df


# ------------------------------------------------------------------------------ per model


def _pct(x: float) -> str:
    return "" if pd.isna(x) else f"{100 * x:+.1f}"


def _md(df: pd.DataFrame, floats: str = ".3f") -> str:
    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        cells = [f"{v:{floats}}" if isinstance(v, float) else str(v) for v in row]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def weak_spots(
    acc: pd.DataFrame, spec: pd.DataFrame, alpha: float = 0.05, min_range: float = 0.10
) -> pd.DataFrame:
    """Units whose accuracy effect (``acc``: the accuracy rows of an effects table) depends on
    phase (Holm p < alpha, per-phase range of the effect >= min_range): the phase each serves
    (largest drop), the ablated model's weakest phase, and whether the ablation *opens* a weak
    spot there (the ablated model's accuracy varies with phase by at least ``min_range`` more
    than the intact model's, lowest at the served phase) rather than flooring every phase
    (which only mirrors the intact profile)."""
    # less 1e-9: a range of exactly min_range computes as a hair below it (0.7 - 0.6 < 0.1)
    sig = spec[(spec.p_holm < alpha) & (spec.phase_range >= min_range - 1e-9)]
    rows = []
    for r in sig.sort_values("rank").itertuples():
        sel = acc[
            (acc.component == r.component)
            & (acc["mode"] == r.mode)
            & (acc.layer == r.layer)
            & (acc.unit == r.unit)
        ].set_index("phase")
        weakest = int(sel.ablated.idxmin())
        opens = (
            not pd.isna(r.served_phase)
            and weakest == int(r.served_phase)
            and r.ablated_range >= r.base_range + min_range - 1e-9
        )
        rows.append(
            {
                "unit": f"{r.component}/{r.mode} L{r.layer}.{r.unit}",
                "served": "" if pd.isna(r.served_phase) else int(r.served_phase),
                "drop there (pts)": 100 * float(sel.effect.min()),
                "mean drop (pts)": 100 * float(r.overall),
                "si": float(r.si),
                "intact range (pts)": 100 * float(r.base_range),
                "ablated range (pts)": 100 * float(r.ablated_range),
                "weakest after": weakest,
                "opens weak spot": "yes" if opens else "no",
            }
        )
    return pd.DataFrame(rows)


def weak_phase_server(acc: pd.DataFrame, spec: pd.DataFrame) -> dict[str, Any]:
    """The intact model's weakest phase and the unit of any component (a head, a branch, a
    slot bias, the blocks a selector kept) that serves it most specifically: whose ablation
    costs the most accuracy there beyond its mean cost at the other phases (a unit every phase
    needs, such as the induction head, is no server of one phase). Its drop there and elsewhere
    (points) and whether its effect depends on phase (Holm p < 0.05)."""
    base = acc.groupby("phase", observed=True).baseline.first()
    weak = int(base.idxmin())
    keys = ["component", "mode", "layer", "unit"]
    units = acc.assign(at=acc.phase == weak).groupby([*keys, "at"], observed=True).effect.mean()
    units = units.unstack("at")
    if True not in units.columns or False not in units.columns:
        return {"weak_phase": weak, "weak_phase_server": ""}
    specific = (units[True] - units[False]).sort_values()
    top = specific.index[0]
    sp = spec.set_index(keys).loc[top]
    return {
        "weak_phase": weak,
        "weak_phase_server": f"{top[0]}/{top[1]} L{top[2]}.{top[3]}",
        "weak_phase_drop_pts": 100 * float(units.loc[top, True]),
        "weak_phase_server_mean_drop_pts": 100 * float(units.loc[top, False]),
        "weak_phase_server_p_holm": float(sp.p_holm),
    }


def overview_row(info: dict[str, Any], tables: dict[str, Any]) -> dict[str, Any]:
    """One row per model of ``overview.parquet``: intact accuracy and its per-phase range,
    the heads whose zero ablation depends on phase and those opening a weak spot, AtP's
    agreement with exact patching, the last layer's phase probe."""
    acc, spec = _frame(tables["effects"]), _frame(tables["specialization"])
    base = acc.groupby("phase", observed=True).baseline.first()
    ws = weak_spots(acc, spec[(spec.component == "head") & (spec["mode"] == "zero")])
    opened = ws[ws["opens weak spot"] == "yes"] if len(ws) else ws
    comp = pd.DataFrame(tables["attribution"]).set_index(["pairs", "layer"])
    probe = pd.DataFrame(tables["probe"])
    final = probe[(probe.label == "phase") & (probe.layer == probe.layer.max())].iloc[0]
    where = pd.DataFrame(tables["attribution_where"]).set_index(["layer", "where"])
    # the largest patches: layer 0 at the needle token, the last layer at the answer position
    big = [(0, "source"), (int(where.index.get_level_values(0).max()), "query")]
    big = [k for k in big if k in where.index]
    ratio = (where.loc[big, "mean_atp"] * where.loc[big, "n"]).sum() / (
        where.loc[big, "mean_exact"] * where.loc[big, "n"]
    ).sum()

    def corr(pairs: str) -> float:
        key = (pairs, "all")
        return float(comp.loc[key, "pearson_single"]) if key in comp.index else float("nan")

    return {
        "model": info["model"],
        "design": info["design"],
        "stride": info["stride"],
        "heads": info["heads"],
        "accuracy": float(base.mean()),
        "phase_range_pts": 100 * float(base.max() - base.min()),
        "phase_dependent_heads": len(ws),
        "heads_opening_weak_spot": ", ".join(
            f"{u.split()[-1]}->{s}"
            for u, s in zip(opened.get("unit", []), opened.get("served", []), strict=True)
        ),
        **weak_phase_server(acc, spec),
        "atp_r_saturated": corr("saturated"),
        "atp_r_unsaturated": corr("unsaturated"),
        "atp_over_exact_big": float(ratio),
        "atp_error_share_big": float(where.loc[big, "share_of_error"].sum()),
        "probe_accuracy": float(final.accuracy),
        "probe_chance": float(final.chance),
    }


def _overview_cells(row: dict[str, Any]) -> dict[str, Any]:
    """An overview row as the markdown table shows it."""

    def r(x: float) -> str:
        return "" if pd.isna(x) else f"{x:.2f}"

    return {
        "model": row["model"],
        "acc": row["accuracy"],
        "phase range (pts)": row["phase_range_pts"],
        "phase-dependent heads": row["phase_dependent_heads"],
        "heads opening a weak spot (served phase)": row["heads_opening_weak_spot"],
        "AtP r (sat / unsat)": f"{r(row['atp_r_saturated'])} / {r(row['atp_r_unsaturated'])}",
        "AtP/exact, needle+answer patches": f"{row['atp_over_exact_big']:.2f}",
        "their share of AtP error": f"{row['atp_error_share_big']:.2f}",
        "phase probe, last layer": f"{row['probe_accuracy']:.3f} ({row['probe_chance']:.3f})",
    }


def _ablation_lines(info: dict[str, Any], tables: dict[str, Any]) -> list[str]:
    acc, spec = _frame(tables["effects"]), _frame(tables["specialization"])
    base = acc.groupby("phase", observed=True).baseline.first()
    lines = [
        f"{info['design']}, stride {info['stride']}, {info['heads']} heads, compressed "
        f"layers {info['compressed_layers']}. Intact accuracy {base.mean():.3f}; per phase: "
        + ", ".join(f"{p}: {v:.3f}" for p, v in base.items()),
        "",
        "### Ablation: accuracy effect per target phase (points)",
        "",
    ]
    wide = acc.pivot_table(
        index=["component", "mode", "layer", "unit"], columns="phase", values="effect",
        observed=True,
    )  # fmt: skip
    wide = wide.map(_pct).reset_index()
    wide.columns = [str(c) for c in wide.columns]
    sp = spec.set_index(["component", "mode", "layer", "unit"])
    key = list(zip(wide.component, wide["mode"], wide.layer, wide.unit, strict=True))
    wide["si"] = [float(sp.loc[k, "si"]) for k in key]
    wide["p_holm"] = [f"{float(sp.loc[k, 'p_holm']):.2g}" for k in key]
    lines += [_md(wide, ".2f"), ""]
    ws = weak_spots(acc, spec)
    lines += [
        f"Phase dependence (`p_holm`): {floor_note(spec)}",
        "",
        "### Phase-dependent units: served phase vs weak spots",
        "",
        "Units with Holm p < 0.05 and a per-phase effect range >= 10 points.",
        "",
    ]
    return lines + [_md(ws, ".1f") if len(ws) else "None.", ""]


def _patching_lines(tables: dict[str, Any]) -> list[str]:
    lines = ["### Activation patching (normalised effect, 1 = clean restored)", ""]
    for kind, patch in tables["patches"].items():
        bp = pd.DataFrame(patch["by_phase"])
        table = bp.pivot_table(index=["layer", "unit"], columns="phase", values="normalized")
        table.columns = [f"phase {c}" for c in table.columns]
        table = table.reset_index()
        lines += [
            f"**{kind} contrast**, head outputs at all positions: clean "
            f"{patch['clean_mean']:.2f} vs corrupted {patch['corrupted_mean']:.2f} "
            f"(logit difference); rows are heads, columns the clean needle's phase.",
            "",
            _md(table, ".2f"),
            "",
        ]
        top = pd.DataFrame(patch["top"])
        lines += [
            f"By position, the 5 largest patches ({patch['n_run']} copies run): "
            + "; ".join(
                f"L{r.layer}H{r.unit}@{r.pos}: {r.normalized:+.2f}" for r in top.itertuples()
            ),
            "",
        ]
    for site, columns in tables["sites"].items():
        eff = pd.DataFrame(columns)
        lines += [
            f"Answer contrast, {site} patches (normalised): "
            + ", ".join(f"L{r.layer}.{r.unit}: {r.normalized:+.2f}" for r in eff.itertuples()),
            "",
        ]
    return lines


def _attribution_probe_lines(tables: dict[str, Any]) -> list[str]:
    lines = ["### Attribution patching vs exact (answer contrast, by position)", ""]
    lines += [_md(pd.DataFrame(tables["attribution"]), ".3f"), ""]
    lines += [
        "Where the error sits (position classes relative to each pair's needle):",
        "",
        _md(pd.DataFrame(tables["attribution_where"]), ".3f"),
        "",
    ]
    probe = pd.DataFrame(tables["probe"])
    pt = probe.pivot(index=["layer", "site"], columns="label", values="accuracy")
    pt = pt.droplevel("layer").reset_index()
    chance = float(probe.chance.max())
    return lines + [
        f"### Linear phase probes (random grid shift per sequence; chance about {chance:.3f})",
        "",
        _md(pt, ".3f"),
        "",
    ]


def model_section(info: dict[str, Any], tables: dict[str, Any]) -> list[str]:
    """The detailed markdown section of one model."""
    lines = [f"## {info['model']}", ""]
    lines += _ablation_lines(info, tables)
    lines += _patching_lines(tables)
    return lines + _attribution_probe_lines(tables)


# ------------------------------------------------------------------------------ head clusters


def head_profiles(results: list[dict[str, Any]]) -> pd.DataFrame:
    """Zero-ablation accuracy effect per phase of every head of every model."""
    frames = []
    for r in results:
        acc, info = _frame(r["tables"]["effects"]), r["info"]
        heads = acc[(acc.component == "head") & (acc["mode"] == "zero")]
        frames.append(
            pd.DataFrame(
                {
                    "model": info["model"],
                    "layer": heads.layer.to_numpy(),
                    "head": heads.unit.to_numpy(),
                    "phase": heads.phase.to_numpy(),
                    "effect": heads.effect.to_numpy(),
                    "stride": info["stride"],
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def head_clusters(results: list[dict[str, Any]]) -> list[tuple[int, list[str], Any]]:
    """``(stride, models, HeadClusters)`` per stride: every model's heads pooled, clustered by
    the shape of their zero-ablation profile across phases."""
    from phasemech.interventions.clustering import cluster_heads

    prof = head_profiles(results)
    out = []
    for stride, group in prof.groupby("stride"):
        models = sorted(group.model.unique())
        # one synthetic layer id per (model, layer): cluster_heads wants (layer, head) units
        group = group.assign(layer=group.model.map(models.index) * 100 + group.layer)
        units = group[["layer", "head", "phase", "effect"]]
        out.append((int(stride), models, cluster_heads(units)))
    return out


def cluster_labels(clusters: list[tuple[int, list[str], Any]]) -> pd.DataFrame:
    """``head_clusters.parquet``: per head its model, layer, head, stride, cluster and name."""
    frames = []
    for stride, models, c in clusters:
        lab = c.labels[["layer", "head", "cluster", "name"]].copy()
        lab.insert(0, "model", [models[lay // 100] for lay in lab["layer"]])
        frames.append(lab.assign(layer=lab["layer"] % 100, stride=stride))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def cluster_summary(clusters: list[tuple[int, list[str], Any]]) -> list[dict[str, Any]]:
    """Per stride: k, the best silhouette, the note and each cluster's name and size."""
    return [
        {
            "stride": stride,
            "k": int(c.k),
            "silhouette": float(c.silhouette.score.max()),
            "note": c.note,
            "clusters": [
                {"cluster": int(k), "name": name, "heads": int((c.labels.cluster == k).sum())}
                for k, name in c.names.items()
            ],
        }
        for stride, _, c in clusters
    ]


def _cluster_lines(clusters: list[tuple[int, list[str], Any]]) -> list[str]:
    lines = [
        "## Head clusters (zero-ablation accuracy profiles, pooled per stride)",
        "",
        "KMeans on each head's effect across phases minus its mean (how the effect varies with "
        "phase), L2-normalised, k by silhouette; 'flat' = no phase-specific part.",
        "",
    ]
    for stride, models, clusters_ in clusters:
        labels = clusters_.labels
        lines += [
            f"Stride {stride}: k = {clusters_.k} (silhouette "
            f"{clusters_.silhouette.score.max():.2f}). {clusters_.note}",
            "",
        ]
        for c, cname in clusters_.names.items():
            members = labels[labels.cluster == c]
            if cname == "flat":  # the many heads without a phase-specific part: a count
                lines.append(f"- cluster {c} (flat): {len(members)} heads")
                continue
            text = ", ".join(
                f"{models[lay // 100]} L{lay % 100}H{h}"
                for lay, h in zip(members["layer"], members["head"], strict=True)
            )
            lines.append(f"- cluster {c} ({cname}): {text}")
        lines.append("")
    return lines


# ------------------------------------------------------------------------------------ summary


def analysis_seconds(info: dict[str, Any]) -> float:
    return sum(info[k] for k in ("ablation_s", "patching_s", "attribution_s", "probe_s"))


def summary_markdown(
    folder: str,
    results: list[dict[str, Any]],
    overview: pd.DataFrame,
    clusters: list[tuple[int, list[str], Any]],
    detail: set[str],
) -> str:
    """``summary.md``: the overview, a detailed section per model of ``detail``, the head
    clusters and the analysis time."""
    lines = [
        "# Interventions on trained models",
        "",
        f"Generated by `phasemech run interventions` (folder `{folder}`) from the phase sweep's "
        "trained models. Effects are in accuracy points (ablated minus intact) unless noted; "
        "phases are on each model's reference grid; every test set is phase-balanced (each "
        "content at every prefix).",
        "",
        "## Overview",
        "",
        "Per model: intact accuracy and its per-phase range; heads whose zero-ablation effect "
        "depends on phase (Holm p < 0.05, range >= 10 points); those whose ablation opens a "
        "weak spot at the phase they serve (layer.head -> phase); attribution patching's "
        "Pearson r with exact by-position patching (answer contrast, single patches) on pairs "
        "whose last-layer attention is saturated (max >= 0.95) vs not; AtP's estimate over the "
        "exact effect summed over the largest patches (layer 0 at the needle token, the last "
        "layer at the answer position) and their share of AtP's total absolute error; the "
        "linear phase probe at the last residual stream (chance in brackets).",
        "",
        _md(pd.DataFrame([_overview_cells(r) for r in overview.to_dict("records")]), ".3f"),
        "",
    ]
    for r in results:
        if r["info"]["model"] in detail:
            lines += model_section(r["info"], r["tables"])
    lines += _cluster_lines(clusters)
    seconds = sum(analysis_seconds(r["info"]) for r in results)
    lines.append(
        f"Analysis time: {seconds / 60:.1f} min summed over {len(results)} models (one worker "
        "each; training not included)."
    )
    return "\n".join(lines) + "\n"


__all__ = [
    "analysis_seconds",
    "cluster_labels",
    "cluster_summary",
    "head_clusters",
    "head_profiles",
    "model_section",
    "overview_row",
    "summary_markdown",
    "summary_tables",
    "weak_spots",
]
