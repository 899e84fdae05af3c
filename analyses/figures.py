"""Every figure of phasemech, from trained models to ``figures/index.html`` (``make figures``).

Runs the ``figures`` experiment on the launcher (``phasemech.experiments.showcase``: train and
score the profile's models, a dashboard panel per model, grid-contrast patching of the showcase
model, the theory's predictions; every job cached under ``RUNS/<folder>/jobs/``), then draws
from its tables: ``OUT/*.html``, ``OUT/*.png`` (kaleido with the system Chromium), the
dashboard (``OUT/dashboard.html`` and a screenshot ``OUT/dashboard.png``), ``OUT/index.html``
and ``OUT/captions.json`` with a one-line caption per figure whose numbers are read from the
tables. ``analyses/report.py`` then writes the claims report from the same tables.

Profiles: ``tiny`` (seconds; the end-to-end test), ``default`` (five 2-head models, T = 64:
``make figures``), ``full`` (``FULL=1``: the 72 models of the phase sweep's default profile,
sharing its cache), ``converged``, ``converged_d8`` and ``converged_d8_wide`` (the converged
phase sweeps' models, in their folders).

Usage: ``python analyses/figures.py [--profile PROFILE] [--runs runs] [--out figures]
[--no-png] [--address ADDR] [--num-cpus N]``.
"""

from __future__ import annotations

import html
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import pandas as pd
import typer
from rich.console import Console

from phasemech import viz
from phasemech.cli.base import fail
from phasemech.core.io import write_text_atomic
from phasemech.core.progress import progress_bar
from phasemech.experiments.configs import experiment
from phasemech.experiments.experiment import run_experiment
from phasemech.experiments.showcase.jobs import best_head, pick_showcase
from phasemech.experiments.showcase.profiles import SHOWCASE_DIR
from phasemech.interventions.clustering import cluster_heads
from phasemech.measure.learning import seeds_off_plateau
from phasemech.viz.dashboard import example_target, render_dashboard

console = Console()
CHROMIUM = "/usr/bin/chromium"
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Tables:
    """What the ``figures`` experiment wrote (``RUNS/<folder>/showcase/``)."""

    folder: Path
    table: pd.DataFrame  # per-phase accuracy with CIs, seeds pooled
    panels: list[dict]  # per model: {panel, phase_attention, head_effects}
    patch_grid: pd.DataFrame  # the showcase's grid-contrast patching by phase (empty: dense)
    theory: dict
    summary: dict

    @classmethod
    def load(cls, folder: Path) -> Tables:
        return cls(
            folder,
            pd.read_parquet(folder / "per_phase.parquet"),
            json.loads((folder / "panels.json").read_text()),
            pd.read_parquet(folder / "patch_grid.parquet"),
            load_json(folder / "theory_predictions.json"),
            load_json(folder / "summary.json"),
        )

    def panel_list(self) -> list[dict]:
        return [p["panel"] for p in self.panels]

    def of(self, name: str) -> dict:
        return next(p for p in self.panels if p["panel"]["name"] == name)


def load_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


# -------------------------------------------------------------------- labels and captions


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


def _acc_caption(series: dict[str, pd.DataFrame], per_setting_seeds: bool = False) -> str:
    parts = []
    for label, df in series.items():
        r = df.iloc[0]
        weak = df.loc[df["accuracy"].idxmin()]
        n = f" ({int(r.seeds)} seed{'s' if r.seeds > 1 else ''})" if per_setting_seeds else ""
        parts.append(
            f"{label}{n}: {r.overall:.3f} overall, weakest phase {int(weak.phase)} at "
            f"{weak.accuracy:.3f}, debiased gap {r.debiased_gap:.3f} "
            f"[{r.gap_lo:.3f}, {r.gap_hi:.3f}]"
        )
    return "; ".join(parts)


# --------------------------------------------------------------------------- figures


def accuracy_figures(t: Tables) -> list[dict]:
    table = t.table
    n_seeds = int(table["seeds"].max())
    # a converged profile pools only the seeds that learned: their number differs by setting
    varies = table["seeds"].nunique() > 1
    seeds = (
        "the seeds that reached the pooling threshold pooled (their number after each setting)"
        if varies
        else f"{n_seeds} seeds pooled"
        if n_seeds > 1
        else "one seed"
    )
    grids = sorted(table["grid"].unique())
    figs = []
    for grid in grids:
        series = _series(table, grid)
        figs.append(
            dict(
                name=f"accuracy_by_phase_d{grid}",
                figure=viz.per_phase_accuracy(series, int(grid)),
                caption=(
                    f"Held-out accuracy by needle phase on the stride-{grid} grid, 95% "
                    f"cluster-bootstrap bands, {seeds}; dotted: the mean that hides the cycle. "
                    + _acc_caption(series, varies)
                ),
            )
        )
    top = int(max(grids))
    dents = "; ".join(
        f"{label}: dent at phase {int(df.loc[df.accuracy.idxmin(), 'phase'])} "
        f"({df.accuracy.min():.3f} vs mean {df.overall.iloc[0]:.3f})"
        for label, df in _series(table, top).items()
    )
    caption = (
        f"The same accuracies with phase as the angle (stride {top}): a phase gap shows as a "
        "dent in the circle. " + dents
    )
    polar = viz.per_phase_polar(_series(table, top), top)
    return figs + [dict(name=f"accuracy_by_phase_polar_d{top}", figure=polar, caption=caption)]


def showcase_figures(t: Tables) -> list[dict]:
    """Head attention and ablation of the showcase model, and its patching."""
    show = pick_showcase(t.panel_list())
    name, best = show["name"], best_head(show)
    pa = pd.DataFrame(t.of(name)["phase_attention"])
    mass = pa[(pa.layer == best["layer"]) & (pa["head"] == best["head"])].sort_values("phase")
    d = int(show["phase_stride"])
    eff = pd.DataFrame(t.of(name)["head_effects"])
    figs = [
        dict(
            name="head_phase_attention",
            figure=viz.head_phase_heatmap(pa, title=f"Attention answer -> needle ({name})"),
            caption=(
                f"{name}: mean attention of each head from the answer position onto its needle, "
                f"by needle phase. {best['label']}: "
                + ", ".join(f"phase {int(r.phase)} {r.mass:.3f}" for r in mass.itertuples())
                + "."
            ),
        ),
        dict(
            name="ablation_effects",
            figure=viz.effect_heatmap(eff, title=f"Zero-ablation effect ({name})"),
            caption=(
                f"{name}: accuracy change when one head's output is zeroed, by needle phase "
                f"(hover: 95% CI, n). {best['label']}: "
                + ", ".join(_num(e, "+.3f") for e in best["effect"])
                + f" at phases 0-{d - 1}, specialisation index {_num(best['si'], '.2f')}, "
                f"Holm p {_num(best['p_holm'], '.3g')}."
            ),
        ),
    ]
    patched = t.patch_grid
    if len(patched) and patched["normalized"].notna().any():
        cell = patched.loc[patched["normalized"].abs().idxmax()]
        figs.append(
            dict(
                name="patching_grid",
                figure=viz.effect_heatmap(
                    patched, value="normalized", title=f"Grid-contrast patching ({name})"
                ),
                caption=(
                    f"{name}: fraction of the clean logit difference restored by patching one "
                    "head's output (all positions) from the run on the model's grid into the "
                    "run on the grid shifted by d/2, by the needle's clean phase. Largest: "
                    f"L{int(cell.layer)}H{int(cell.unit)} at phase {int(cell.phase)}, "
                    f"{cell.normalized:.2f}."
                ),
            )
        )
    return figs


def specialization_figure(t: Tables) -> dict:
    """Every head of the showcase's stride: specialisation vs overall effect, by cluster."""
    d = int(pick_showcase(t.panel_list())["phase_stride"])
    spec_rows, prof_rows = [], []
    for p in t.panel_list():
        if int(p["phase_stride"]) != d:
            continue
        for h in p["heads"]:
            keep = ("overall", "si", "p_holm", "served_phase")
            spec_rows.append(
                dict(model=p["name"], layer=h["layer"], unit=h["head"], **{k: h[k] for k in keep})
            )
            prof_rows += [
                dict(model=p["name"], layer=h["layer"], head=h["head"], phase=ph, effect=e)
                for ph, e in enumerate(h["effect"])
            ]
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
    return dict(
        name="specialization",
        figure=viz.specialization_scatter(spec, labels),
        caption=(
            f"Every head of the stride-{d} models ({len(models)} models, {len(spec)} heads): "
            f"specialisation index vs overall zero-ablation effect, coloured by cluster of "
            f"phase profile (k = {clusters.k}); {n_sig} heads with Holm p < 0.05 (filled)."
        ),
    )


def dynamics_figures(t: Tables) -> list[dict]:
    """The showcase's accuracy by phase along training, and one attention pattern."""
    show = pick_showcase(t.panel_list())
    name, best, d = show["name"], best_head(show), int(show["phase_stride"])
    rows = [r for r in t.summary["curves"][name] if r.get("accuracy_by_phase")]
    first = next((r for r in rows if r["accuracy"] >= 0.9), None)
    ex = show["example"]
    # the farthest target whose needle has the phase this head attends most
    mass_best = [m if m is not None else -1.0 for m in best["mass"]]
    i, needle, query = example_target(show, int(max(range(d), key=mass_best.__getitem__)))
    pattern = ex["examples"][i]["patterns"][best["layer"]][best["head"]]
    return [
        dict(
            name="training_dynamics",
            figure=viz.training_dynamics(rows, d, title=f"Accuracy by phase ({name})"),
            caption=(
                f"{name}: held-out accuracy per needle phase every {t.summary['eval_every']} "
                f"steps; final {rows[-1]['accuracy']:.3f} at step {rows[-1]['step']}"
                + (f", first >= 0.9 at step {first['step']}." if first else ".")
            ),
        ),
        dict(
            name="attention_pattern",
            figure=viz.attention_pattern_phases(
                pattern, d, grid_offset=ex["grid_offset"], needle=needle, query=query,
                title=f"{name} {best['label']} on one example",
            ),
            caption=(
                f"{name} {best['label']} (its most phase-specialised head): attention of every "
                "query on one test sequence, key phases on top, chunk starts dotted; needle at "
                f"{needle} (phase {(needle - ex['grid_offset']) % d}, the phase the head attends "
                f"most), query at {query}, attention {pattern[query][needle]:.3f}."
            ),
        ),
    ]  # fmt: skip


def make_figures(t: Tables) -> list[dict]:
    """``[{name, figure, caption}]``: every figure, built from the experiment's tables and the
    recorded analyses."""
    return (
        accuracy_figures(t)
        + showcase_figures(t)
        + [specialization_figure(t)]
        + dynamics_figures(t)
        + analysis_figures(t.theory)
    )


def _first_recorded(results: Path, experiment: str, profiles: tuple[str, ...]) -> dict | None:
    """The first recorded ``<experiment>_<profile>.json`` of ``profiles`` (converged first)."""
    runs = (load_json(results / f"{experiment}_{p}.json") for p in profiles)
    return next((x for x in runs if x), None)


def analysis_figures(theory: dict, results: Path = RESULTS) -> list[dict]:
    """``[{name, figure, caption}]`` for the theory and the recorded analyses (those present)."""
    figs = [viz.theory_plateau(theory)]
    tt = _first_recorded(results, "theory_trained", ("converged", "default"))
    if tt:
        rows = [
            {"model": f"H={m['heads']} s{m['seed']}", "predicted": p, "observed": o}
            for m in tt["models"]
            for p, o in zip(m["predicted_accuracy"], m["acc_by_phase"], strict=True)
        ]
        rhos = [m["spearman"] for m in tt["models"]]
        figs.append(
            {
                "name": "theory_vs_trained",
                "figure": viz.prediction_scatter(
                    pd.DataFrame(rows),
                    "predicted",
                    "observed",
                    "model",
                    title="Theory from effective pooling weights vs measured accuracy by phase",
                ),
                "caption": (
                    "Each point a phase of a trained gated model (d = "
                    f"{tt['profile']['stride']}): the theory's accuracy computed from the model's "
                    "effective pooling weights (x) against the measured accuracy (y); Spearman "
                    "per model " + ", ".join(f"{r:.2f}" for r in rhos) + "."
                ),
            }
        )
    fx = _first_recorded(results, "fixes", ("converged", "long", "default"))
    if fx:  # the longest training budget recorded
        res = pd.DataFrame(fx["results"])
        pooled = res[(res["seed"] == "pooled") & (res["targets"] == "all")]
        d = int(fx["profile"]["stride"])
        at = fx["profile"].get("min_accuracy", fx["plateau_exit"])  # a seed that learned
        series = {
            r.fix: pd.DataFrame({"phase": np.arange(d), "accuracy": r.acc_by_phase})
            for r in pooled.itertuples()
        }
        figs.append(
            {
                "name": "fixes_by_phase",
                "figure": viz.per_phase_accuracy(
                    series,
                    d,
                    title=f"Fixes: held-out accuracy by phase ({fx['profile']['steps']} steps, "
                    "seeds pooled)",
                ),
                "caption": (
                    f"Matched models with each fix ({fx['profile']['steps']} steps), accuracy "
                    "by needle phase: "
                    + "; ".join(
                        f"{r.fix} {r.accuracy:.3f} (gap {_num(r.debiased_gap, '.3f')}, "
                        "{}/{} seeds >= {})".format(*seeds_off_plateau(res, r.fix, at), at)
                        for r in pooled.itertuples()
                    )
                    + "."
                ),
            }
        )
    return figs


# ---------------------------------------------------------------------------- output


def write_pngs(figs: list, paths: list[Path]) -> bool:
    """All PNGs in one kaleido (Chromium) session; ``False`` (and a warning) without Chromium.
    With Chromium present a failure is retried once (a loaded machine can time the browser
    out), then raised: PNGs that should exist are never skipped silently."""
    import plotly.io as pio

    for attempt in (1, 2):
        try:
            pio.write_images(figs, paths, scale=2)
            return True
        except Exception as err:  # kaleido needs Chrome/Chromium: a missing one skips PNGs
            if Path(CHROMIUM).exists() and attempt == 2:
                raise
            if not Path(CHROMIUM).exists():
                console.print(f"[yellow]no PNGs[/]: {type(err).__name__}: {err}")
                return False
            console.print(f"[yellow]PNG export failed, retrying[/]: {type(err).__name__}")
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


def write_figures(figs: list[dict], out: Path, png: bool) -> list[dict]:
    """Each figure as HTML (one plotly.min.js beside the pages: offline, small pages) and, with
    ``png``, all PNGs in one kaleido session; the index entries."""
    with progress_bar(console) as bar:
        task = bar.add_task("figures", total=len(figs) + 1, item="")
        for f in figs:
            bar.update(task, item=f["name"])
            f["figure"].write_html(out / f"{f['name']}.html", include_plotlyjs="directory")
            bar.advance(task)
        bar.update(task, item="PNGs (kaleido)")
        png = png and write_pngs(
            [f["figure"] for f in figs], [out / f"{f['name']}.png" for f in figs]
        )
        bar.advance(task)
    return [
        dict(
            name=f["name"],
            html=f"{f['name']}.html",
            png=f"{f['name']}.png" if png else None,
            caption=f["caption"],
        )
        for f in figs
    ]


def write_dashboard(t: Tables, out: Path, png: bool) -> dict:
    """The dashboard over every model (one self-contained page) and its index entry."""
    show = pick_showcase(t.panel_list())
    dash = out / "dashboard.html"
    title = f"phasemech: {t.folder.parent.name}"
    write_text_atomic(dash, render_dashboard(t.panel_list(), title, initial=show["name"]))
    shot = png and screenshot(dash, out / "dashboard.png")
    s = show["summary"]
    return dict(
        name="dashboard",
        html="dashboard.html",
        png="dashboard.png" if shot else None,
        caption=(
            f"Interactive head-attribution dashboard over the {len(t.panels)} models (one "
            "self-contained file, works offline): pick a model, click a head cell, slide the "
            f"phase. Opens on {show['name']}: accuracy {_num(s['accuracy'], '.3f')}, debiased "
            f"gap {_num(s['debiased_gap'], '.3f')} [{_num(s['gap_lo'], '.3f')}, "
            f"{_num(s['gap_hi'], '.3f')}]."
        ),
    )


def main(
    profile: Annotated[
        str, typer.Option(help="tiny | default | full | converged | converged_d8[_wide]")
    ] = "default",
    runs: Annotated[Path, typer.Option(help="the experiment's folder goes here")] = Path("runs"),
    out: Annotated[Path, typer.Option(help="where the figures go")] = Path("figures"),
    no_png: Annotated[bool, typer.Option("--no-png", help="HTML only (no kaleido)")] = False,
    address: Annotated[str | None, typer.Option(help="a Ray cluster to join")] = None,
    num_cpus: Annotated[int | None, typer.Option(min=1, help="embedded Ray's CPUs")] = None,
) -> None:
    """Run the figures experiment on the launcher, then draw every figure and the dashboard."""
    t0 = time.perf_counter()
    exp = experiment("figures")
    try:
        exp.profile(profile)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    try:
        done = run_experiment(exp, profile, runs, address=address, num_cpus=num_cpus)
    except (ConnectionError, ValueError) as err:  # a cluster that refused: one line, exit 1
        raise fail(err) from err
    console.print(f"figures ({profile}): {done.ran} jobs run, {done.cached} cached")
    for failure in done.failures:
        console.print(f"[red]failed[/] {failure.label}:\n{failure.error}", highlight=False)
    if done.failures:
        raise typer.Exit(1)
    t = Tables.load(done.folder / SHOWCASE_DIR)
    out.mkdir(parents=True, exist_ok=True)
    entries = write_figures(make_figures(t), out, png=not no_png)
    entries.append(write_dashboard(t, out, png=not no_png))
    meta = dict(
        command=f"python analyses/figures.py --profile {profile}",
        profile=profile,
        n_models=t.summary["models"],
        runs=str(done.folder),
        seconds=time.perf_counter() - t0,
    )
    index = write_index(entries, out, meta)
    console.print(f"wrote {len(entries)} figures and {index} in {meta['seconds']:.0f} s")
    if shutil.which("chromium") is None and not Path(CHROMIUM).exists():
        console.print("[yellow]no Chromium: PNGs and the dashboard screenshot were skipped[/]")


if __name__ == "__main__":
    typer.run(main)
