"""``analyses/REPORT.md``: each claim of the paper against phasemech's measurement of it.

Built by ``make figures`` after ``analyses/figures.py``. Every number is read from a JSON or
parquet result file, never typed or parsed out of markdown:

- the tables of the ``figures`` experiment (``RUNS/<folder>/showcase/``: its per-phase table,
  model panels and the theory's predictions, recomputed on every run) and the figure links of
  ``OUT/captions.json``;
- the recorded results of the longer analyses in ``analyses/results/`` (their commands are
  named next to each number): the 60-model phase sweep, the SmolLM2 passkey sweeps, the fixes,
  theory vs trained gated models.

A result file that is missing is reported as missing, with the command that makes it; verdicts
are computed from the numbers by the rules written next to them. The claims themselves are
:mod:`phasemech.experiments.claims` (one module per claim; ``claims.report`` joins them): this
script only reads the figures run's tables and writes the report. ``--recorded-only`` writes
it from ``analyses/results/`` alone (no figures run on this machine: the model panels, whose
numbers vary by machine, are left out), which is how the committed report is regenerated
without retraining: ``python analyses/report.py --recorded-only``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer

from phasemech.experiments.claims.report import write_report
from phasemech.experiments.claims.sources import Sources, load_json

RESULTS = Path(__file__).resolve().parent / "results"


def main(
    showcase: Annotated[
        Path, typer.Option(help="the figures experiment's tables (RUNS/<folder>/showcase)")
    ] = Path("runs/figures_default/showcase"),
    captions: Annotated[
        Path, typer.Option(help="analyses/figures.py's captions.json (figure links)")
    ] = Path("figures/captions.json"),
    out: Annotated[Path, typer.Option(help="the report")] = RESULTS.parent / "REPORT.md",
    recorded_only: Annotated[
        bool,
        typer.Option(
            help="write the report from analyses/results/ alone: the figure links from the "
            "recorded captions (figures_default.json, linked into figures/), the theory from "
            "theory_predictions.json; the figures run's own model panels are left out"
        ),
    ] = False,
) -> None:
    """Write the claims report from the figures experiment's tables and the recorded results."""
    if recorded_only:
        captions, figures = RESULTS / "figures_default.json", RESULTS.parent.parent / "figures"
        table = panels = None
        theory = load_json(RESULTS / "theory_predictions.json")
    else:
        figures = captions.parent
        if not captions.is_file() or not (showcase / "per_phase.parquet").is_file():
            raise typer.BadParameter(
                f"{captions} or {showcase}/per_phase.parquet is missing: run analyses/figures.py "
                "first (or pass --recorded-only)"
            )
        panels = [p["panel"] for p in json.loads((showcase / "panels.json").read_text())]
        theory = load_json(showcase / "theory_predictions.json")
        table = pd.read_parquet(showcase / "per_phase.parquet")
    meta = load_json(captions)
    links = {
        e["name"]: os.path.relpath(figures / (e["png"] or e["html"]), out.parent)
        for e in meta["figures"]
    }
    write_report(Sources(table, panels, links, theory, meta["command"], RESULTS), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
