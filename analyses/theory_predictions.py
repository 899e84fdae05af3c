"""Re-derive THEORY.md's predictions with ``phasemech.theory`` (about 40 s; no training).

Critical beta/d (uniform pooling turns stable) vs log(N-1), and the stability eigenvalue's sign
against what the flow does; the plateau length vs N; capacity H vs d; the shared slot handicap
under aligned / staggered / random offsets; training concentrated on one phase; the causal
signature of ablating a head. alpha 8, V 64 (THEORY.md leaves them open), side by side with the
numbers THEORY.md quotes.

Writes ``--out`` (JSON, default ``runs/theory/predictions.json``); ``--record`` also copies it to
``analyses/results/theory_predictions.json``. ``make figures`` runs it.

Usage: ``python analyses/theory_predictions.py [--out PATH] [--record]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from phasemech.io import write_json_atomic
from phasemech.theory import fmt_num, fmt_time, predictions

RESULTS = Path(__file__).resolve().parent / "results"


def markdown(p: dict) -> str:
    lines = ["critical beta/d vs log(N-1):"]
    for r in p["critical"]:
        lines.append(
            f"  N={r['n_windows']:5d}: {r['critical_beta_over_d']:.2f} vs {r['log_n_minus_1']:.2f}"
        )
    lines.append(f"  slope {p['critical_slope']:.2f}")
    lines.append("stability at d=H=8, N=64 (eigenvalue at uniform vs the flow):")
    for r in p["stability"]:
        lines.append(
            f"  beta/d={r['beta_over_d']:.0f}: lambda {r['eigenvalue']:+.4f}, final mean max "
            f"weight {r['final_mean_max_weight']:.2f}, left uniform {r['left_uniform']}, "
            f"sharp {r['sharp']}"
        )
    lines.append("plateau (flow time to mean max weight > 0.5), d=H=8, beta=8:")
    for r in p["plateau"]:
        lines.append(f"  N={r['n_windows']:5d}: {fmt_time(r['time'])} (THEORY.md {r['theory_md']})")
    lines.append(f"  log-log slope {fmt_num(p['plateau_loglog_slope'])}")
    lines.append("capacity, d=8, beta=8:")
    for r in p["capacity"]:
        lines.append(f"  H={r['heads']:2d}: covered {r['covered']}, served {r['served']}")
    lines.append("slot handicap c_l = 0.8^(d-1-l), d=H=8, beta=16:")
    for r in p["handicap"]:
        md = r["theory_md"]
        lines.append(
            f"  {r['offsets']:9s}: gap {r['gap']:.2f}, mean {r['mean']:.2f} "
            f"(THEORY.md {md['gap']:.2f} / {md['mean']:.2f})"
        )
    for r in p["concentrated"]:
        lines.append(f"training {r['share']:.0%} on phase 0: covered {r['covered']}")
    a = p["ablation"]
    lines.append(f"ablation: {a['matches']}/{a['heads']} heads hurt most the phase they weigh most")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/theory/predictions.json"))
    parser.add_argument("--record", action="store_true", help="copy the JSON to results/")
    args = parser.parse_args()
    p = predictions()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, json.loads(json.dumps(p, default=float)))
    print(markdown(p))
    if args.record:
        shutil.copy(args.out, RESULTS / "theory_predictions.json")


if __name__ == "__main__":
    main()
