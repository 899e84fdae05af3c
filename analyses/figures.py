"""Every figure of phasemech, from trained models to ``figures/index.html`` (``make figures``).

Stages (each cached under ``RUNS/<sweep folder>/``; rerunning skips finished work):

1. **train + score** (``analyses/phase_sweep.py``'s worker): trains each model of the profile
   whose checkpoint is missing, one process per core and one torch thread each, and scores its
   checkpoints on the phase-balanced test set (``targets_step_*.parquet``);
2. **tables**: per-phase accuracy with cluster-bootstrap 95% CIs per (design, stride, heads,
   T), seeds pooled, at the final checkpoint (``per_phase.parquet``);
3. **model panels** (:func:`phasemech.experiments.panels.model_panel`, cached in
   ``<run>/dashboard/<setting>/``):
   per-phase accuracy and debiased gap, head attention mass on the needle by phase, head
   zero-ablation effects by phase with CIs and specialisation tests, an example pattern; and
   grid-contrast activation patching of the showcase model (``.../<setting>/patch_grid``);
4. **figures**: ``OUT/*.html``, ``OUT/*.png`` (kaleido with the system Chromium), the dashboard
   (``OUT/dashboard.html`` and a screenshot ``OUT/dashboard.png``) and ``OUT/index.html`` with a
   one-line caption per figure whose numbers are read from the tables above.

The *showcase* model (heatmaps, patching, dynamics, example pattern) is picked from the data:
the compressed model whose most phase-specialised compressed-layer head ranks first
(:func:`phasemech.viz.dashboard.head_rank_key`: Holm p < 0.05, then the range of its per-phase
ablation effect), among models with test-set accuracy >= 0.9 when any.

Profiles: ``tiny`` (seconds; the end-to-end test), ``default`` (five 2-head models, T = 64,
one seed each: ``make figures``), ``full`` (``FULL=1``: the 72 models of the
phase sweep's default profile, three seeds, 4096 test sequences; shares ``make sweep``'s cache).

Usage: ``python analyses/figures.py [--profile tiny|default|full] [--runs runs] [--out figures]
[--workers 2] [--no-png]``.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, as_completed, wait
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
import phase_sweep as ps  # noqa: E402  (the sweep's profiles, specs and worker)
import report  # noqa: E402  (REPORT.md and the analyses' figures)

from phasemech.core.progress import progress_bar  # noqa: E402
from phasemech.experiments.panels import PanelConfig, panel_dir
from phasemech.viz.dashboard import example_target, head_rank_key

console = Console()
CHROMIUM = "/usr/bin/chromium"


@dataclass(frozen=True)
class FigureProfile:
    sweep: ps.Profile
    folder: str  # the sweep folder under RUNS (shared with analyses/phase_sweep.py when equal)
    panel: PanelConfig
    models: tuple[str, ...] | None = None  # only these runs of the sweep (None: all)
    patch_pairs: int = 256
    theory_scale: float = 1.0  # phasemech.theory.dynamics.predictions(scale): < 1 only for tests


PROFILES = {
    "tiny": FigureProfile(
        sweep=ps.PROFILES["tiny"],
        folder="phase_sweep_tiny",
        panel=PanelConfig(sequences=64, n_boot=50, n_perm=50),
        patch_pairs=32,
        theory_scale=0.05,
    ),
    # one seed of the four design families that the sweep found most telling: the dense
    # control, mean pooling (largest gap), gated (heads split the phases), route (no gap)
    "default": FigureProfile(
        sweep=replace(
            ps.PROFILES["default"],
            designs=("none", "mean", "gated", "route"),
            heads=(2,),
            seq_lens=(64,),
            seeds=(0, 1),
            test_sequences=2048,
            n_boot=400,
            n_perm=400,
        ),
        folder="figures_default",
        panel=PanelConfig(sequences=2048, n_boot=400, n_perm=400),
        # longest first, so that the two workers finish together
        models=(
            "mean_d8_h2_T64_s0",
            "mean_d4_h2_T64_s0",
            "route_d4_h2_T64_s0",
            "gated_d4_h2_T64_s1",
            "none_d8_h2_T64_s0",
        ),
    ),
    "full": FigureProfile(
        sweep=ps.PROFILES["default"],
        folder="phase_sweep_default",
        panel=PanelConfig(sequences=4096, n_boot=1000, n_perm=1000),
    ),
}


def _progress():
    return progress_bar(console)


def specs_of(fp: FigureProfile) -> list[ps.RunSpec]:
    specs = ps.run_specs(fp.sweep)
    if fp.models is None:
        return specs
    by_name = {s.name: s for s in specs}
    missing = [m for m in fp.models if m not in by_name]
    if missing:  # a profile naming a run its sweep does not define: a bug, said plainly
        raise ValueError(f"profile models {missing} are not runs of its sweep")
    return [by_name[m] for m in fp.models]


# ------------------------------------------------------------------------- stage 1: training


def train_and_score(specs: list[ps.RunSpec], fp: FigureProfile, sweep_dir: Path, workers: int):
    todo = [s for s in specs if not _scored(sweep_dir / s.name)]
    console.print(
        f"[bold]1/4 train + score[/]: {len(specs) - len(todo)} of {len(specs)} models cached; "
        f"training {len(todo)} on {workers} worker processes (1 torch thread each)"
    )
    if not todo:
        return
    steps = fp.sweep.steps
    with _progress() as bar, ProcessPoolExecutor(min(workers, len(todo))) as pool:
        # the whole stage in training steps (early stops count as done), and one bar per model
        # read from its metrics.jsonl, so that the ETA follows the steps actually run
        total = bar.add_task("train + score", total=steps * len(todo), item="")
        rows = {s.name: bar.add_task(f"  {s.name}", total=steps, item="queued") for s in todo}
        futures = {pool.submit(ps.run_one, s, fp.sweep, str(sweep_dir)): s for s in todo}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=2.0, return_when=FIRST_COMPLETED)
            for fut in finished:
                info = fut.result()
                bar.update(
                    rows[info["name"]],
                    completed=steps,
                    item=(
                        f"step {info['step']}, held-out acc {info['accuracy']:.3f}, "
                        f"{info['total_seconds']:.0f} s"
                    ),
                )
            for fut, s in futures.items():
                if fut.done():
                    continue
                step, acc = _last_eval(sweep_dir / s.name)
                if step:
                    bar.update(rows[s.name], completed=step, item=f"step {step}, acc {acc:.3f}")
            bar.update(total, completed=sum(bar.tasks[t].completed for t in rows.values()))


def _last_eval(run: Path) -> tuple[int, float]:
    """``(step, held-out accuracy)`` of a run's last evaluation line, ``(0, 0.0)`` if none."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0, 0.0
    for line in reversed(path.read_text().splitlines()):
        try:
            row = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError:  # a line the worker is still writing
            continue
        if "accuracy_by_phase" in row:
            return int(row["step"]), float(row["accuracy"])
    return 0, 0.0


def _scored(run: Path) -> bool:
    """Trained to the end (the ``done`` line) and every checkpoint scored."""
    from phasemech.training.checkpoints import checkpoint_dirs

    metrics = run / "metrics.jsonl"
    if not metrics.is_file() or '"event": "done"' not in metrics.read_text():
        return False
    return all((run / f"targets_{c.name}.parquet").is_file() for c in checkpoint_dirs(run))


# --------------------------------------------------------------------------- stage 2: tables


def per_phase_table(specs: list[ps.RunSpec], fp: FigureProfile, sweep_dir: Path) -> pd.DataFrame:
    """Per-phase accuracy with CIs per (design, stride, heads, T) and phase grid, seeds pooled,
    final checkpoint of each run."""
    from phasemech.core.grid import phase_of
    from phasemech.measure.stats import per_phase, phase_gap

    targets = ps.load_targets(sweep_dir, specs)
    final = targets.groupby("run")["step"].transform("max")
    targets = targets[targets["step"] == final]
    rows = []
    for (design, stride, heads, seq_len), df in targets.groupby(
        ["design", "stride", "heads", "seq_len"]
    ):
        for grid in ps._grids(design, stride, fp.sweep):
            sdf = df.assign(
                phase=phase_of(df["source_pos"].to_numpy(), grid),
                seq_id=df["group_id"] + 1_000_000 * df["seed"],
            )
            if sdf["seed"].nunique() == 1:
                sdf = sdf.drop(columns="seed")
            pp = per_phase(sdf, grid, n_boot=fp.sweep.n_boot, seed=0)
            gap = phase_gap(sdf, grid, n_perm=fp.sweep.n_perm, n_boot=fp.sweep.n_boot, seed=0)
            pp = pp.assign(
                design=design,
                stride=int(stride),
                grid=int(grid),
                heads=int(heads),
                seq_len=int(seq_len),
                seeds=int(df["seed"].nunique()),
                overall=float(sdf["correct"].mean()),
                debiased_gap=gap["debiased_gap"],
                gap_lo=gap["debiased_lo"],
                gap_hi=gap["debiased_hi"],
            )
            rows.append(pp)
    table = pd.concat(rows, ignore_index=True)
    table.to_parquet(sweep_dir / "per_phase.parquet")
    return table


# ---------------------------------------------------------------------- stage 3: model panels


def _panel_job(run: str, config: PanelConfig) -> dict:
    import torch

    torch.set_num_threads(1)
    from phasemech.experiments.panels import model_panel

    return model_panel(run, config)


def panels(specs: list[ps.RunSpec], fp: FigureProfile, sweep_dir: Path, workers: int):
    console.print("[bold]3/4 model panels[/]: ablation, attention and statistics per model")
    out: dict[str, dict] = {}
    with _progress() as bar, ProcessPoolExecutor(min(workers, len(specs))) as pool:
        task = bar.add_task("model panels", total=len(specs), item="")
        futures = {
            pool.submit(_panel_job, str(sweep_dir / s.name), fp.panel): s.name for s in specs
        }
        for fut in as_completed(futures):
            out[futures[fut]] = fut.result()
            bar.update(task, advance=1, item=f"done: {futures[fut]}")
    return [out[s.name] for s in specs]


def best_head(panel: dict) -> dict:
    """A panel's most phase-specialised head (:func:`phasemech.viz.dashboard.head_rank_key`),
    among its compressed layers' heads when it has any."""
    return max([h for h in panel["heads"] if h["compressed"]] or panel["heads"], key=head_rank_key)


def pick_showcase(panel_list: list[dict]) -> dict:
    """The compressed model whose most specialised head ranks first (see the module docstring),
    among models with test-set accuracy >= 0.9 when any."""
    comp = [p for p in panel_list if p["design"] != "none"] or panel_list
    good = [p for p in comp if (p["summary"]["accuracy"] or 0) >= 0.9] or comp
    return max(good, key=lambda p: head_rank_key(best_head(p)))


def patch_grid(run: Path, fp: FigureProfile) -> pd.DataFrame | None:
    """Grid-contrast head patching of the showcase (cached); ``None`` for a dense model."""
    from phasemech.core.grid import reference_grid
    from phasemech.core.io import write_json_atomic
    from phasemech.data.tasks import balanced_test_set
    from phasemech.interventions.contrasts import make_contrast
    from phasemech.interventions.patching_fast import patch_heads
    from phasemech.training.checkpoints import load_trained

    # cached beside the panel, valid for the weights the panel was computed on
    dest = panel_dir(run, fp.panel) / "patch_grid"
    key = {
        "panel": json.loads((panel_dir(run, fp.panel) / "panel.json").read_text())["key"],
        "pairs": fp.patch_pairs,
    }
    if (dest / "by_phase.parquet").is_file() and (dest / "key.json").is_file():
        if json.loads((dest / "key.json").read_text()) == key:
            return pd.read_parquet(dest / "by_phase.parquet")
    model, cfg, _ = load_trained(run)
    if not cfg.compression.enabled:
        return None
    stride, offset = reference_grid(cfg.compression)
    ds = balanced_test_set(cfg.task, fp.panel.sequences, fp.panel.data_seed).shuffle(seed=0)
    contrast = make_contrast(
        ds, "grid", stride=stride, grid_offset=offset, n_pairs=fp.patch_pairs, seed=0
    )
    res = patch_heads(model, contrast)
    res.save(dest, n_boot=fp.panel.n_boot, seed=0)
    write_json_atomic(dest / "key.json", key)
    return pd.read_parquet(dest / "by_phase.parquet")


# --------------------------------------------------------------------------- stage 4: figures


def _label(design: str, stride: int, heads: int, seq_len: int, multi_t: bool) -> str:
    # a dense model has no stride of its own: it is drawn on every grid
    grid = "" if design == "none" else f" d={stride}"
    return f"{design}{grid} H={heads}" + (f" T={seq_len}" if multi_t else "")


def _series(table: pd.DataFrame, grid: int) -> dict[str, pd.DataFrame]:
    sub = table[table["grid"] == grid]
    multi_t = table["seq_len"].nunique() > 1
    out = {}
    for (design, stride, heads, seq_len), df in sub.groupby(
        ["design", "stride", "heads", "seq_len"], sort=False
    ):
        out[_label(design, stride, heads, seq_len, multi_t)] = df
    # the dense control first: drawn underneath, first in the legend
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].startswith("none"), kv[0])))


def _num(x: float | None, spec: str) -> str:
    """A panel number for a caption (panels hold ``None`` where a value is undefined)."""
    return "n/a" if x is None else format(x, spec)


def _acc_caption(series: dict[str, pd.DataFrame]) -> str:
    parts = []
    for label, df in series.items():
        r = df.iloc[0]
        weak = df.loc[df["accuracy"].idxmin()]
        parts.append(
            f"{label}: {r.overall:.3f} overall, weakest phase {int(weak.phase)} at "
            f"{weak.accuracy:.3f}, debiased gap {r.debiased_gap:.3f} "
            f"[{r.gap_lo:.3f}, {r.gap_hi:.3f}]"
        )
    return "; ".join(parts)


def make_figures(
    table: pd.DataFrame,
    panel_list: list[dict],
    sweep_dir: Path,
    fp: FigureProfile,
) -> list[dict]:
    """``[{name, figure, caption}]``, every figure built from the tables and panels."""
    from phasemech import viz
    from phasemech.interventions.ablation import AblationResult
    from phasemech.interventions.clustering import cluster_heads
    from phasemech.training.checkpoints import read_metrics

    figs: list[dict] = []
    n_seeds = int(table["seeds"].max())
    seeds = f"{n_seeds} seed{'s' if n_seeds > 1 else ''} pooled" if n_seeds > 1 else "one seed"
    grids = sorted(table["grid"].unique())
    for grid in grids:
        series = _series(table, grid)
        figs.append(
            dict(
                name=f"accuracy_by_phase_d{grid}",
                figure=viz.per_phase_accuracy(series, int(grid)),
                caption=(
                    f"Held-out accuracy by needle phase on the stride-{grid} grid, 95% "
                    f"cluster-bootstrap bands, {seeds}; dotted: the mean that hides the cycle. "
                    + _acc_caption(series)
                ),
            )
        )
    top = int(max(grids))
    figs.append(
        dict(
            name=f"accuracy_by_phase_polar_d{top}",
            figure=viz.per_phase_polar(_series(table, top), top),
            caption=f"The same accuracies with phase as the angle (stride {top}): a phase gap "
            "shows as a dent in the circle. "
            + "; ".join(
                f"{label}: dent at phase {int(df.loc[df.accuracy.idxmin(), 'phase'])} "
                f"({df.accuracy.min():.3f} vs mean {df.overall.iloc[0]:.3f})"
                for label, df in _series(table, top).items()
            ),
        )
    )

    show = pick_showcase(panel_list)
    run = sweep_dir / show["name"]
    d = int(show["phase_stride"])
    best = best_head(show)
    pa = pd.read_parquet(panel_dir(run, fp.panel) / "phase_attention.parquet")
    mass = pa[(pa.layer == best["layer"]) & (pa["head"] == best["head"])].sort_values("phase")
    figs.append(
        dict(
            name="head_phase_attention",
            figure=viz.head_phase_heatmap(pa, title=f"Attention answer -> needle ({show['name']})"),
            caption=(
                f"{show['name']}: mean attention of each head from the answer position onto its "
                f"needle, by needle phase. {best['label']}: "
                + ", ".join(f"phase {int(r.phase)} {r.mass:.3f}" for r in mass.itertuples())
                + "."
            ),
        )
    )

    abl = AblationResult.load(panel_dir(run, fp.panel) / "ablate")
    eff = abl.effects
    eff = eff[(eff.metric == "accuracy") & (eff.component == "head") & (eff["mode"] == "zero")]
    figs.append(
        dict(
            name="ablation_effects",
            figure=viz.effect_heatmap(eff, title=f"Zero-ablation effect ({show['name']})"),
            caption=(
                f"{show['name']}: accuracy change when one head's output is zeroed, by needle "
                f"phase (hover: 95% CI, n). {best['label']}: "
                + ", ".join(_num(e, "+.3f") for e in best["effect"])
                + f" at phases 0-{d - 1}, specialisation index {_num(best['si'], '.2f')}, "
                f"Holm p {_num(best['p_holm'], '.3g')}."
            ),
        )
    )

    patched = patch_grid(run, fp)
    if patched is not None and patched["normalized"].notna().any():
        cell = patched.loc[patched["normalized"].abs().idxmax()]
        figs.append(
            dict(
                name="patching_grid",
                figure=viz.effect_heatmap(
                    patched,
                    value="normalized",
                    title=f"Grid-contrast patching ({show['name']})",
                ),
                caption=(
                    f"{show['name']}: fraction of the clean logit difference restored by "
                    "patching one head's output (all positions) from the run on the model's grid "
                    "into the run on the grid shifted by d/2, by the needle's clean phase. "
                    f"Largest: L{int(cell.layer)}H{int(cell.unit)} at phase {int(cell.phase)}, "
                    f"{cell.normalized:.2f}."
                ),
            )
        )

    spec_rows, prof_rows = [], []
    for p in panel_list:
        if int(p["phase_stride"]) != d:
            continue
        for h in p["heads"]:
            spec_rows.append(
                dict(
                    model=p["name"],
                    layer=h["layer"],
                    unit=h["head"],
                    overall=h["overall"],
                    si=h["si"],
                    p_holm=h["p_holm"],
                    served_phase=h["served_phase"],
                )
            )
            for ph, e in enumerate(h["effect"]):
                prof_rows.append(
                    dict(model=p["name"], layer=h["layer"], head=h["head"], phase=ph, effect=e)
                )
    spec = pd.DataFrame(spec_rows).astype({"overall": float, "si": float, "p_holm": float})
    prof = pd.DataFrame(prof_rows).astype({"effect": float}).fillna({"effect": 0.0})
    models = sorted(prof.model.unique())
    # cluster_heads wants (layer, head) units: one synthetic layer id per (model, layer)
    keyed = prof.assign(layer=prof.model.map(models.index) * 100 + prof.layer)
    clusters = cluster_heads(keyed[["layer", "head", "phase", "effect"]])
    labels = clusters.labels.assign(
        model=lambda x: [models[i // 100] for i in x.layer], layer=lambda x: x.layer % 100
    )
    n_sig = int((spec.p_holm < 0.05).sum())
    figs.append(
        dict(
            name="specialization",
            figure=viz.specialization_scatter(spec, labels),
            caption=(
                f"Every head of the stride-{d} models ({len(models)} models, {len(spec)} heads): "
                f"specialisation index vs overall zero-ablation effect, coloured by cluster of "
                f"phase profile (k = {clusters.k}); {n_sig} heads with Holm p < 0.05 (filled)."
            ),
        )
    )

    rows = [r for r in read_metrics(run) if "accuracy_by_phase" in r]
    first = next((r for r in rows if r["accuracy"] >= 0.9), None)
    figs.append(
        dict(
            name="training_dynamics",
            figure=viz.training_dynamics(rows, d, title=f"Accuracy by phase ({show['name']})"),
            caption=(
                f"{show['name']}: held-out accuracy per needle phase every "
                f"{fp.sweep.eval_every} steps; final {rows[-1]['accuracy']:.3f} at step "
                f"{rows[-1]['step']}"
                + (f", first >= 0.9 at step {first['step']}." if first else ".")
            ),
        )
    )

    ex = show["example"]
    # the farthest target whose needle has the phase this head attends most
    mass_best = [m if m is not None else -1.0 for m in best["mass"]]
    i, needle, query = example_target(show, int(max(range(d), key=mass_best.__getitem__)))
    pattern = ex["examples"][i]["patterns"][best["layer"]][best["head"]]
    figs.append(
        dict(
            name="attention_pattern",
            figure=viz.attention_pattern_phases(
                pattern,
                d,
                grid_offset=ex["grid_offset"],
                needle=needle,
                query=query,
                title=f"{show['name']} {best['label']} on one example",
            ),
            caption=(
                f"{show['name']} {best['label']} (its most phase-specialised head): attention "
                f"of every query on one test sequence, key phases on top, chunk starts dotted; "
                f"needle at {needle} (phase {(needle - ex['grid_offset']) % d}, the phase the "
                f"head attends most), query at {query}, attention {pattern[query][needle]:.3f}."
            ),
        )
    )

    return figs


def write_pngs(figs: list, paths: list[Path]) -> bool:
    """All PNGs in one kaleido (Chromium) session; ``False`` (and a warning) without Chromium."""
    import plotly.io as pio

    try:
        pio.write_images(figs, paths, scale=2)
        return True
    except Exception as err:  # kaleido needs Chrome/Chromium: a missing one only skips PNGs
        console.print(f"[yellow]no PNGs[/]: {type(err).__name__}: {err}")
        return False


def screenshot(page_path: Path, png: Path) -> bool:
    """A PNG of the dashboard as a browser draws it (headless Chromium via Playwright)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return False
    if not Path(CHROMIUM).exists():
        return False
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1300, "height": 1000})
            page.goto(page_path.resolve().as_uri())
            page.wait_for_selector("#heatmap .main-svg")
            page.screenshot(path=str(png), full_page=True)
            browser.close()
    except Exception as err:  # a screenshot is a nicety: never lose the index over it
        console.print(f"[yellow]no dashboard screenshot[/]: {type(err).__name__}: {err}")
        return False
    return True


INDEX = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>phasemech figures</title>
<style>body{{font-family:Helvetica,Arial,sans-serif;max-width:1000px;margin:16px auto;color:#111}}
li{{margin:0 0 14px}} img{{max-width:480px;display:block;border:1px solid #ddd;margin-top:4px}}
.cmd{{font-family:monospace;font-size:12px;color:#444}}</style></head><body>
<h1>phasemech figures</h1>
<p class="cmd">{command} &middot; profile {profile} &middot; {n_models} models &middot;
runs in {runs} &middot; {seconds:.0f} s</p>
<ul>
{items}
</ul></body></html>
"""


def write_index(entries: list[dict], out: Path, meta: dict) -> Path:
    items = []
    for e in entries:
        img = f'<img src="{e["png"]}" alt="{e["name"]}">' if e.get("png") else ""
        items.append(
            f'<li><a href="{e["html"]}"><b>{html.escape(e["name"])}</b></a>: '
            f"{html.escape(e['caption'])}{img}</li>"
        )
    page = INDEX.format(items="\n".join(items), **meta)
    (out / "index.html").write_text(page)
    (out / "captions.json").write_text(json.dumps({**meta, "figures": entries}, indent=2))
    return out / "index.html"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--no-png", action="store_true", help="HTML only (no kaleido export)")
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        help="where the claims report goes (default analyses/REPORT.md; OUT/REPORT.md for the "
        "tiny profile, so that a smoke run never replaces the real report)",
    )
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers {args.workers} is invalid: expected >= 1")
    fp = PROFILES[args.profile]
    if args.report is None:
        here = Path(__file__).resolve().parent
        args.report = args.out / "REPORT.md" if args.profile == "tiny" else here / "REPORT.md"
    t0 = time.perf_counter()
    sweep_dir = args.runs / fp.folder
    sweep_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    specs = specs_of(fp)
    console.print(
        f"[bold]make figures[/] profile {args.profile}: {len(specs)} models, cache {sweep_dir}, "
        f"output {args.out}"
    )
    train_and_score(specs, fp, sweep_dir, args.workers)
    console.print("[bold]2/4 tables[/]: per-phase accuracy with CIs, seeds pooled")
    table = per_phase_table(specs, fp, sweep_dir)
    panel_list = panels(specs, fp, sweep_dir, args.workers)
    console.print("[bold]4/4 figures[/]")
    from phasemech.core.io import write_json_atomic, write_text_atomic
    from phasemech.theory.dynamics import predictions
    from phasemech.viz.dashboard import render_dashboard

    entries = []
    with console.status("theory: re-deriving the theory model's predictions"):
        theory = predictions(scale=fp.theory_scale)
    write_json_atomic(sweep_dir / "theory_predictions.json", json.loads(json.dumps(theory)))
    figs = make_figures(table, panel_list, sweep_dir, fp) + report.analysis_figures(theory)
    with _progress() as bar:
        task = bar.add_task("figures", total=len(figs) + 2, item="")
        for f in figs:
            bar.update(task, item=f["name"])
            # one plotly.min.js beside the pages (offline, small pages); the dashboard inlines it
            f["figure"].write_html(args.out / f"{f['name']}.html", include_plotlyjs="directory")
            bar.advance(task)
        bar.update(task, item="PNGs (kaleido)")
        png = not args.no_png and write_pngs(
            [f["figure"] for f in figs], [args.out / f"{f['name']}.png" for f in figs]
        )
        bar.advance(task)
        for f in figs:
            entries.append(
                dict(
                    name=f["name"],
                    html=f"{f['name']}.html",
                    png=f"{f['name']}.png" if png else None,
                    caption=f["caption"],
                )
            )
        bar.update(task, item="dashboard")
        dash = args.out / "dashboard.html"
        show = pick_showcase(panel_list)
        write_text_atomic(
            dash, render_dashboard(panel_list, f"phasemech: {fp.folder}", initial=show["name"])
        )
        shot = not args.no_png and screenshot(dash, args.out / "dashboard.png")
        bar.advance(task)
    entries.append(
        dict(
            name="dashboard",
            html="dashboard.html",
            png="dashboard.png" if shot else None,
            caption=(
                f"Interactive head-attribution dashboard over the {len(panel_list)} models "
                "(one self-contained file, works offline): pick a model, click a head cell, "
                f"slide the phase. Opens on {show['name']}: accuracy "
                f"{_num(show['summary']['accuracy'], '.3f')}, debiased gap "
                f"{_num(show['summary']['debiased_gap'], '.3f')} "
                f"[{_num(show['summary']['gap_lo'], '.3f')}, "
                f"{_num(show['summary']['gap_hi'], '.3f')}]."
            ),
        )
    )
    seconds = time.perf_counter() - t0
    meta = dict(
        command=f"python analyses/figures.py --profile {args.profile}",
        profile=args.profile,
        n_models=len(specs),
        runs=str(sweep_dir),
        seconds=seconds,
    )
    index = write_index(entries, args.out, meta)
    links = {
        e["name"]: os.path.relpath(args.out / (e["png"] or e["html"]), args.report.parent)
        for e in entries
    }
    src = report.Sources(table, panel_list, links, theory, meta["command"])
    report.write_report(src, args.report)
    console.print(f"wrote {len(entries)} figures, {index} and {args.report} in {seconds:.0f} s")
    if shutil.which("chromium") is None and not Path(CHROMIUM).exists():
        console.print("[yellow]no Chromium: PNGs and the dashboard screenshot were skipped[/]")


if __name__ == "__main__":
    main()
