"""What a ``phasemech explain`` folder's finished ``observe`` jobs already say, before the run
ends (an interrupted run resumes from the same cache).

Axes: ``prompt``, ``layer``, ``phase``.

Usage: ``python analyses/explain_progress.py EXPLAIN_DIR``. Reads ``EXPLAIN_DIR/jobs/*.json``
(the launcher's cache) and prints, over the prompts observed so far: the design's and the
null's accuracy by phase; selection recall of the needle's block at the answer row by layer
band and phase; the oracle's accuracy by phase in every layer (each form) and the share of
displaced picks that were the sink's block; the single layers whose forcing (``replace``,
every row after the needle) lifts the weakest phase most. Records nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from phasemech.experiments.explain.tables import long_frame, oracle_summary, prompts_frame


def observed(folder: Path) -> list[dict]:
    """The prompts of every finished ``observe`` job in ``folder/jobs``."""
    out = []
    for f in sorted((folder / "jobs").glob("*.json")):
        job = json.loads(f.read_text())
        if job["config"].get("kind") == "explain" and job["config"]["step"] == "observe":
            out += job["result"]["prompts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    obs = observed(ap.parse_args().folder)
    prompts = prompts_frame(obs)
    print(f"{len(prompts)} prompts, {prompts.group_id.nunique()} contents observed")
    print(prompts.groupby("phase")[["design_correct", "null_correct"]].mean().round(2).T)
    sel = long_frame(obs, "selection")
    sel["band"] = pd.cut(sel.layer, [1, 11, 20, 29], labels=["2-11", "12-20", "21-29"])
    print(sel.groupby(["band", "phase"], observed=True).selected.mean().unstack().round(2))
    orc = oracle_summary(long_frame(obs, "oracle"), prompts, n_boot=0, seed=0)
    every = orc[orc.scope.isin(["none", "all"])]
    print(every.pivot_table("accuracy", ["scope", "form", "rows"], "phase").round(2))
    raw = long_frame(obs, "oracle")
    raw = raw[raw.scope == "all"].groupby(["form", "rows"])
    print("sink share of displaced picks:")
    print((raw.displaced_sink.sum() / raw.displaced.sum()).round(2))
    weak = int(prompts.groupby("phase").design_correct.mean().idxmin())
    one = orc[orc.scope.str.startswith("layer") & (orc.form == "replace")]
    table = one.pivot_table("accuracy", "scope", "phase")
    print(f"single layers, replace after the needle, by phase {weak} (the weakest):")
    print(table.sort_values(weak, ascending=False).head(6).round(2))


if __name__ == "__main__":
    main()
