"""One table from several ``phasemech audit`` folders: design x regime x context, with the null.

Axes: ``regime``, ``context``, ``setting``; one row per (audit, context, setting).

Usage: ``python analyses/audit_table.py AUDIT_DIR [AUDIT_DIR ...] [--out FILE.md]``. Reads each
folder's ``summary.json`` (what ``phasemech audit`` wrote) and prints, per row: accuracy, the
per-phase accuracies, the debiased gap with its 95% CI, Cochran's p over the paired phases, the
number of paired prompts, and the audit's wall and worker time. Records nothing unless
``--out`` is given (then the same table as markdown, written atomically).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from phasemech.core.io import write_text_atomic


def collect(folders: list[Path]) -> pd.DataFrame:
    rows = []
    for folder in folders:
        summary = json.loads((folder / "summary.json").read_text())
        cfg = summary["config"]
        for r in summary["rows"]:
            rows.append(
                dict(
                    audit=folder.name, regime=cfg["regime"], T=r["context"],
                    setting=r["setting"], accuracy=r["accuracy"],
                    by_phase=" / ".join(f"{x:.2f}" for x in r["acc_by_phase"]),
                    gap=r["debiased_gap"], gap_lo=r["gap_lo"], gap_hi=r["gap_hi"],
                    p_cochran=r["p_cochran"], prompts=r["n"],
                    wall_s=summary["wall_s"], worker_s=summary["worker_s"],
                )
            )  # fmt: skip
    return pd.DataFrame(rows)


def markdown(df: pd.DataFrame) -> str:
    lines = [
        "| regime | T | setting | acc | acc by phase | debiased gap [95% CI] | p (Cochran) "
        "| prompts | audit wall / worker s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in df.itertuples():
        p = "" if pd.isna(r.p_cochran) else f"{r.p_cochran:.2g}"
        lines.append(
            f"| {r.regime} | {r.T} | {r.setting} | {r.accuracy:.3f} | {r.by_phase} | "
            f"{r.gap:.3f} [{r.gap_lo:.3f}, {r.gap_hi:.3f}] | {p} | {r.prompts} | "
            f"{r.wall_s:.0f} / {r.worker_s:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    missing = [f for f in args.folders if not (f / "summary.json").is_file()]
    if missing:
        p.error(f"no summary.json in {', '.join(map(str, missing))}: run phasemech audit first")
    text = markdown(collect(args.folders))
    print(text, end="")
    if args.out is not None:
        write_text_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
