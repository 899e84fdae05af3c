"""The offset fixes with the attention sink handled beside the same fixes without it: one
markdown table from two fixes audits' ``summary.json`` (``phasemech audit --fix ...``, the
second with ``--sink-tokens N``), joined on (context, design, fix).

Axes: ``context``, ``design``, ``fix``; one row per pair that both audits scored. Each side
gives its aligned baseline (accuracy, debiased gap), the fix's gap cut ``1 - gap_fix /
gap_base`` and accuracy change with their 95% intervals, the budgets and the verdict the audit
gave (the goal: gap cut >= 70% with its interval above 0, accuracy not lower by more than one
point, budget no larger; ``docs/audit.md``). Then the fixes that meet it with the sink.

Usage: ``python analyses/sink_fixes.py WITHOUT/summary.json WITH/summary.json [--out F.md]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

KEY = ["context", "design", "fix"]
MEETS = "meets the goal"


def fixes_frame(path: Path) -> pd.DataFrame:
    """The fixes records of one audit summary, one row per (context, design, fix)."""
    records = json.loads(Path(path).read_text())["fixes"]
    return pd.DataFrame(records)


def _interval(mid, lo, hi, pct: bool) -> str:
    if pd.isna(mid):
        return "n/a"
    f = (lambda x: f"{100 * x:+.0f}%") if pct else (lambda x: f"{x:+.3f}")
    if pd.isna(lo):
        return f(mid)
    return f"{f(mid)} [{f(lo)}, {f(hi)}]"


def _side(r: pd.Series, suffix: str) -> str:
    base = f"{r['accuracy_baseline' + suffix]:.3f} / {r['gap_baseline' + suffix]:.3f}"
    cut = _interval(r["reduction" + suffix], r["reduction_lo" + suffix],
                    r["reduction_hi" + suffix], pct=True)  # fmt: skip
    acc = _interval(r["accuracy_diff" + suffix], r["accuracy_diff_lo" + suffix],
                    r["accuracy_diff_hi" + suffix], pct=False)  # fmt: skip
    budget = f"{r['budget' + suffix]} vs {r['budget_baseline' + suffix]}"
    return f"{base} | {cut} | {acc} | {budget} | {r['verdict' + suffix]}"


def side_by_side(without: pd.DataFrame, with_sink: pd.DataFrame) -> pd.DataFrame:
    """The pairs both audits scored, the sinkless columns suffixed ``_plain``, the others
    ``_sink``."""
    return without.merge(with_sink, on=KEY, suffixes=("_plain", "_sink"))


def table(joined: pd.DataFrame) -> str:
    head = ("baseline acc / gap | gap cut [95% CI] | accuracy change [95% CI] | budget fix vs "
            "base | verdict")  # fmt: skip
    lines = [
        f"| T | design | fix | without sink: {head} | with sink: {head} |",
        "|---" * 13 + "|",
    ]
    for _, r in joined.sort_values(KEY).iterrows():
        lines.append(f"| {r['context']} | {r['design']} | {r['fix']} | {_side(r, '_plain')} | "
                     f"{_side(r, '_sink')} |")  # fmt: skip
    return "\n".join(lines)


def meeting(joined: pd.DataFrame) -> list[str]:
    """``design/fix at T`` for each fix the sink audit says meets the goal."""
    hits = joined[joined["verdict_sink"].str.startswith(MEETS)]
    return [f"{r.design}/{r.fix} at T={r.context}" for r in hits.itertuples()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("without", type=Path, help="summary.json of the fixes audit without a sink")
    p.add_argument("with_sink", type=Path, help="summary.json of the same audit with a sink")
    p.add_argument("--out", type=Path, default=None, help="write the markdown here too")
    args = p.parse_args(argv)
    joined = side_by_side(fixes_frame(args.without), fixes_frame(args.with_sink))
    if joined.empty:
        raise SystemExit("no (context, design, fix) scored by both audits")
    hits = meeting(joined)
    text = table(joined) + "\n\nMeets the goal with the sink: " + (", ".join(hits) or "none")
    print(text)
    if args.out is not None:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
