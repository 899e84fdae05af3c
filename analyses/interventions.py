"""Which heads serve which phases? Ablation, patching, attribution and probes on trained models.

For each trained model of the phase sweep (``analyses/phase_sweep.py``; default: a dense
control and the compressed models that learned MQAR or show a phase gap), on its
phase-balanced test set:

1. **ablation** (``phasemech.interventions.ablation``): zero / mean / resample of every head,
   and of the compressed layer's parts (block entries: mask / mean / resample; raw window:
   mask; gated phase bias: zero); accuracy effect per target phase with cluster-bootstrap CIs; the
   specialization index and the within-content permutation test per unit;
2. **do ablations open the weak spots?**: for every unit whose effect depends on phase
   (Holm-corrected p < 0.05), the phase it serves (largest drop), the weakest phase of the
   ablated model, and whether the intact model is already weak there;
3. **activation patching** (``phasemech.interventions.patching``): the grid contrast (same
   tokens, grid shifted by d/2: the cleanest phase contrast) and the corrupted-answer contrast
   for head outputs at every position and by position; compressed entries and patterns under
   the answer contrast (the only one where entry i covers the same tokens in both runs);
4. **attribution patching** vs exact patching on the answer contrast (overall, by layer, and
   split by saturated last-layer attention);
5. **linear probes** for the token's phase on a randomly shifted grid (phase decoupled from
   absolute position), with ``pos mod d`` as the control;
6. **clusters** of heads by their ablation profile across phases, pooled over models.

Per model, everything is written under ``OUT/<model>/``; the summary goes to
``OUT/summary.md`` (and, with ``--record``, to ``analyses/results/interventions.md``).

Usage: ``python analyses/interventions.py [--sweep runs/phase_sweep_default] [--models a,b]
[--out runs/interventions] [--workers 2] [--sequences 1024] [--pairs 256]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODELS = (
    "none_d8_h4_T64_s0",  # dense control
    "route_d8_h4_T64_s0",
    "route_d4_h4_T64_s0",
    "gated_d4_h2_T64_s1",  # converged gated
    "gated_d4_h2_T64_s0",
    "mean_d8_h2_T64_s0",  # partly learned, large phase gap
    "mean_d4_h2_T64_s0",
    "mlp_d4_h2_T64_s0",
)


def components_for(design: str) -> tuple[str, ...]:
    from phasemech.core.config import SELECTING_DESIGNS

    comps = ["head"]
    if design != "none":
        comps += ["blocks"] + (["raw"] if design not in SELECTING_DESIGNS else [])
        comps += ["phase_bias"] if design == "gated" else []
    return tuple(comps)


def analyse(run_dir: str, out_dir: str, sequences: int, pairs: int, seed: int) -> dict:
    """Every analysis for one trained model (one process, one torch thread)."""
    import torch

    torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    from phasemech.core.grid import reference_grid
    from phasemech.data.tasks import balanced_test_set, to_tensors
    from phasemech.interventions.ablation import ablate
    from phasemech.interventions.attribution import (
        attribution_by_position,
        attribution_patch,
        compare_attribution,
    )
    from phasemech.interventions.contrasts import make_contrast
    from phasemech.interventions.patching import patch_sites
    from phasemech.interventions.patching_fast import patch_heads
    from phasemech.interventions.probes import phase_probe
    from phasemech.training.checkpoints import load_trained

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    with threadpool_limits(1):
        model, cfg, model_dir = load_trained(run_dir)
        design = cfg.compression.design
        stride, offset = reference_grid(cfg.compression)
        ds = balanced_test_set(cfg.task, sequences, 777)

        t0 = time.perf_counter()
        result = ablate(model, ds, components=components_for(design), seed=seed)
        spec = result.specialization(metric="accuracy", n_perm=1000, seed=seed)
        result.save(out / "ablate", specialization=spec)
        timings["ablation_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        shuffled = ds.shuffle(seed=seed)  # balanced sets come in blocks of one content
        kinds = (["grid"] if design != "none" else []) + ["answer"]
        runs = {}
        for kind in kinds:
            contrast = make_contrast(
                shuffled, kind, stride=stride, grid_offset=offset, n_pairs=pairs, seed=seed
            )
            for by_pos in (False, True):
                res = patch_heads(model, contrast, by_pos=by_pos)
                res.save(out / f"patch_{kind}_z{'_pos' if by_pos else ''}", seed=seed)
                runs[(kind, by_pos)] = (contrast, res)
            if kind == "answer" and design != "none":  # entries align only on one grid
                for site in ("kv_block", "pattern"):
                    patch_sites(model, contrast, site=site).save(
                        out / f"patch_{kind}_{site}", seed=seed
                    )
        timings["patching_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        contrast, exact = runs[("answer", True)]
        atp = attribution_patch(model, contrast)
        comparison = compare_attribution(atp, exact)
        comparison.to_parquet(out / "attribution.parquet")
        attribution_by_position(atp, exact, contrast).to_parquet(out / "attribution_where.parquet")
        timings["attribution_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        tokens = to_tensors(ds.select(range(min(256, len(ds)))))[0]
        probe = phase_probe(model, tokens, stride=stride, grid_offset=offset, seed=seed)
        probe.save(out / "probe.parquet")
        timings["probe_s"] = time.perf_counter() - t0
    info = {
        "model": Path(run_dir).name,
        "checkpoint": str(model_dir),
        "design": design,
        "stride": stride,
        "heads": cfg.model.n_heads,
        "compressed_layers": list(model.compressed_layers()),
        **timings,
    }
    (out / "info.json").write_text(json.dumps(info, indent=2))
    return info


# ------------------------------------------------------------------------------------ summary


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
    effects: pd.DataFrame, spec: pd.DataFrame, alpha: float = 0.05, min_range: float = 0.10
) -> pd.DataFrame:
    """Units whose accuracy effect depends on phase (Holm p < alpha, per-phase range of the
    effect >= min_range): the phase each serves (largest drop), the ablated model's weakest
    phase, and whether the ablation *opens* a weak spot there (the ablated model's accuracy
    varies with phase by at least ``min_range`` more than the intact model's, lowest at the
    served phase) rather than flooring every phase (which only mirrors the intact profile)."""
    acc = effects[effects.metric == "accuracy"]
    sig = spec[(spec.p_holm < alpha) & (spec.phase_range >= min_range)]
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
            and r.ablated_range >= r.base_range + min_range
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


def overview_row(name: str, info: dict, d: Path) -> dict:
    """One line per model for the overview table."""
    effects = pd.read_parquet(d / "ablate" / "effects.parquet")
    spec = pd.read_parquet(d / "ablate" / "specialization.parquet")
    acc = effects[effects.metric == "accuracy"]
    base = acc.groupby("phase", observed=True).baseline.first()
    heads = spec[(spec.component == "head") & (spec["mode"] == "zero")]
    ws = weak_spots(effects, heads)
    opened = ws[ws["opens weak spot"] == "yes"] if len(ws) else ws
    comp = pd.read_parquet(d / "attribution.parquet").set_index(["pairs", "layer"])
    probe = pd.read_parquet(d / "probe.parquet")
    final = probe[(probe.label == "phase") & (probe.layer == probe.layer.max())].iloc[0]

    where = pd.read_parquet(d / "attribution_where.parquet").set_index(["layer", "where"])
    big = [(0, "source"), (int(where.index.get_level_values(0).max()), "query")]
    big = [k for k in big if k in where.index]
    ratio = (where.loc[big, "mean_atp"] * where.loc[big, "n"]).sum() / (
        where.loc[big, "mean_exact"] * where.loc[big, "n"]
    ).sum()

    def corr(pairs: str) -> str:
        key = (pairs, "all")
        return f"{comp.loc[key, 'pearson_single']:.2f}" if key in comp.index else ""

    return {
        "model": name,
        "acc": float(base.mean()),
        "phase range (pts)": 100 * float(base.max() - base.min()),
        "phase-dependent heads": len(ws),
        "heads opening a weak spot (served phase)": ", ".join(
            f"{u.split()[-1]}->{s}"
            for u, s in zip(opened.get("unit", []), opened.get("served", []), strict=True)
        ),
        "AtP r (sat / unsat)": f"{corr('saturated')} / {corr('unsaturated')}",
        "AtP/exact, needle+answer patches": f"{ratio:.2f}",
        "their share of AtP error": f"{where.loc[big, 'share_of_error'].sum():.2f}",
        "phase probe, last layer": f"{final.accuracy:.3f} ({final.chance:.3f})",
    }


def _collect_profiles(profiles: list[dict], name: str, info: dict, d: Path) -> None:
    """Zero-ablation accuracy effect per phase of every head, for the pooled clustering."""
    effects = pd.read_parquet(d / "ablate" / "effects.parquet")
    heads = effects[
        (effects.metric == "accuracy") & (effects.component == "head") & (effects["mode"] == "zero")
    ]
    for r in heads.itertuples():
        profiles.append(
            {
                "model": name,
                "layer": r.layer,
                "head": r.unit,
                "phase": r.phase,
                "effect": r.effect,
                "stride": info["stride"],
            }
        )


def summarise(out: Path, infos: list[dict], detail: set[str]) -> str:
    from phasemech.interventions.clustering import cluster_heads

    lines = [
        "# Interventions on trained models",
        "",
        "Generated by `python analyses/interventions.py` from the phase sweep's checkpoints. "
        "Effects are in accuracy points (ablated minus intact) unless noted; phases are on each "
        "model's reference grid; every test set is phase-balanced (each content at every "
        "prefix).",
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
        _md(pd.DataFrame([overview_row(i["model"], i, out / i["model"]) for i in infos]), ".3f"),
        "",
    ]
    profiles = []
    for info in infos:
        name = info["model"]
        d = out / name
        if name not in detail:
            _collect_profiles(profiles, name, info, d)
            continue
        effects = pd.read_parquet(d / "ablate" / "effects.parquet")
        spec = pd.read_parquet(d / "ablate" / "specialization.parquet")
        acc = effects[effects.metric == "accuracy"]
        base = acc.groupby("phase", observed=True).baseline.first()
        lines += [
            f"## {name}",
            "",
            f"{info['design']}, stride {info['stride']}, {info['heads']} heads, compressed "
            f"layers {info['compressed_layers']}. Intact accuracy {base.mean():.3f}; per phase: "
            + ", ".join(f"{p}: {v:.3f}" for p, v in base.items()),
            "",
            "### Ablation: accuracy effect per target phase (points)",
            "",
        ]
        wide = acc.pivot_table(
            index=["component", "mode", "layer", "unit"],
            columns="phase",
            values="effect",
            observed=True,
        )
        wide = wide.map(_pct).reset_index()
        wide.columns = [str(c) for c in wide.columns]
        sp = spec.set_index(["component", "mode", "layer", "unit"])
        key = list(zip(wide.component, wide["mode"], wide.layer, wide.unit, strict=True))
        wide["si"] = [float(sp.loc[k, "si"]) for k in key]
        wide["p_holm"] = [f"{float(sp.loc[k, 'p_holm']):.2g}" for k in key]
        lines += [_md(wide, ".2f"), ""]
        ws = weak_spots(effects, spec)
        lines += [
            "### Phase-dependent units: served phase vs weak spots",
            "",
            "Units with Holm p < 0.05 and a per-phase effect range >= 10 points.",
            "",
        ]
        lines += [_md(ws, ".1f") if len(ws) else "None.", ""]

        lines += ["### Activation patching (normalised effect, 1 = clean restored)", ""]
        for kind in ("grid", "answer"):
            folder = d / f"patch_{kind}_z"
            if not folder.exists():
                continue
            meta = json.loads((folder / "patch.json").read_text())
            bp = pd.read_parquet(folder / "by_phase.parquet")
            bp = bp[bp.layer.isin(meta["layers"])]
            table = bp.pivot_table(index=["layer", "unit"], columns="phase", values="normalized")
            table.columns = [f"phase {c}" for c in table.columns]
            table = table.reset_index()
            lines += [
                f"**{kind} contrast**, head outputs at all positions: clean "
                f"{meta['clean_mean']:.2f} vs corrupted {meta['corrupted_mean']:.2f} "
                f"(logit difference); rows are heads, columns the clean needle's phase.",
                "",
                _md(table, ".2f"),
                "",
            ]
            pos = pd.read_parquet(d / f"patch_{kind}_z_pos" / "effects.parquet")
            meta_pos = json.loads((d / f"patch_{kind}_z_pos" / "patch.json").read_text())
            top = pos.reindex(pos.normalized.abs().sort_values(ascending=False).index).head(5)
            lines += [
                f"By position, the 5 largest patches ({meta_pos['n_run']} copies run): "
                + "; ".join(
                    f"L{r.layer}H{r.unit}@{r.pos}: {r.normalized:+.2f}" for r in top.itertuples()
                ),
                "",
            ]
        for site in ("kv_block", "pattern"):
            folder = d / f"patch_answer_{site}"
            if folder.exists():
                eff = pd.read_parquet(folder / "effects.parquet")
                lines += [
                    f"Answer contrast, {site} patches (normalised): "
                    + ", ".join(
                        f"L{r.layer}.{r.unit}: {r.normalized:+.2f}" for r in eff.itertuples()
                    ),
                    "",
                ]
        comp = pd.read_parquet(d / "attribution.parquet")
        lines += ["### Attribution patching vs exact (answer contrast, by position)", ""]
        lines += [_md(comp, ".3f"), ""]
        where = pd.read_parquet(d / "attribution_where.parquet")
        lines += [
            "Where the error sits (position classes relative to each pair's needle):",
            "",
            _md(where, ".3f"),
            "",
        ]
        probe = pd.read_parquet(d / "probe.parquet")
        pt = probe.pivot(index=["layer", "site"], columns="label", values="accuracy")
        pt = pt.droplevel("layer").reset_index()
        chance = float(probe.chance.max())
        lines += [
            f"### Linear phase probes (random grid shift per sequence; chance about {chance:.3f})",
            "",
            _md(pt, ".3f"),
            "",
        ]
        _collect_profiles(profiles, name, info, d)
    prof = pd.DataFrame(profiles)
    lines += [
        "## Head clusters (zero-ablation accuracy profiles, pooled per stride)",
        "",
        "KMeans on each head's effect across phases minus its mean (how the effect varies with "
        "phase), L2-normalised, k by silhouette; 'flat' = no phase-specific part.",
        "",
    ]
    for stride, group in prof.groupby("stride"):
        models = sorted(group.model.unique())
        # one synthetic layer id per (model, layer): cluster_heads wants (layer, head) units
        group = group.assign(layer=group.model.map(models.index) * 100 + group.layer)
        clusters = cluster_heads(group[["layer", "head", "phase", "effect"]])
        labels = clusters.labels
        lines += [
            f"Stride {stride}: k = {clusters.k} (silhouette "
            f"{clusters.silhouette.score.max():.2f}). {clusters.note}",
            "",
        ]
        for c, cname in clusters.names.items():
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
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=Path, default=ROOT / "runs/phase_sweep_default")
    ap.add_argument("--models", help="comma-separated run names, or 'all' (default: a chosen set)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/interventions")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--sequences", type=int, default=1024, help="balanced test-set size")
    ap.add_argument("--pairs", type=int, default=256, help="patching pairs per contrast")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="copy the summary to analyses/results")
    ap.add_argument("--summary-only", action="store_true", help="rebuild the summary")
    ap.add_argument("--force", action="store_true", help="re-analyse models already done")
    args = ap.parse_args()
    if args.models == "all":
        names = sorted(p.parent.name for p in args.sweep.glob("*/train_config.json"))
    else:
        names = args.models.split(",") if args.models else list(DEFAULT_MODELS)
    # detailed sections for the chosen set (or for every model when fewer than 10)
    detail = set(names) if len(names) < 10 else set(DEFAULT_MODELS) & set(names)
    missing = [n for n in names if not (args.sweep / n / "train_config.json").is_file()]
    if missing:
        raise SystemExit(
            f"no trained run for {missing} under {args.sweep}: run `make sweep` first "
            "(or pass --sweep/--models)"
        )
    t0 = time.perf_counter()
    infos = []
    done = [n for n in names if (args.out / n / "info.json").is_file()]
    if args.summary_only:
        infos = [json.loads((args.out / n / "info.json").read_text()) for n in done]
    else:
        from rich.progress import Progress

        if not args.force:  # cached: analysed models are read back
            infos = [json.loads((args.out / n / "info.json").read_text()) for n in done]
        todo = names if args.force else [n for n in names if n not in done]
        with ProcessPoolExecutor(args.workers) as pool, Progress() as bar:
            task = bar.add_task("models analysed", total=len(todo))
            futures = {
                pool.submit(
                    analyse,
                    str(args.sweep / n),
                    str(args.out / n),
                    args.sequences,
                    args.pairs,
                    args.seed,
                ): n
                for n in todo
            }
            for fut in as_completed(futures):
                info = fut.result()
                infos.append(info)
                bar.console.print(
                    f"{info['model']}: ablation {info['ablation_s']:.0f}s, patching "
                    f"{info['patching_s']:.0f}s, attribution {info['attribution_s']:.0f}s, "
                    f"probes {info['probe_s']:.0f}s"
                )
                bar.advance(task)
        infos.sort(key=lambda i: names.index(i["model"]))
    text = summarise(args.out, infos, detail)
    wall = time.perf_counter() - t0
    timing = args.out / "timing.json"
    if not args.summary_only:
        timing.write_text(json.dumps({"wall_s": wall, "workers": args.workers, "models": todo}))
    if timing.is_file():  # the analysing run's time (a summary-only rebuild reports it too)
        t = json.loads(timing.read_text())
        text += (
            f"\nWall time of the last analysing run: {t['wall_s'] / 60:.1f} min for "
            f"{len(t['models'])} models with {t['workers']} workers.\n"
        )
    (args.out / "summary.md").write_text(text)
    if args.record:
        (ROOT / "analyses/results/interventions.md").write_text(text)
    print(f"wrote {args.out / 'summary.md'} ({wall:.0f} s)")


if __name__ == "__main__":
    main()
