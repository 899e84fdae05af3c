"""Re-derive the theory model's predictions with ``phasemech.theory.dynamics`` (about 40 s; no
training).

Critical beta/d (uniform pooling turns stable) vs log(N-1), and the stability eigenvalue's sign
against what the flow does; the plateau length vs N; capacity H vs d; the shared slot handicap
under aligned / staggered / random offsets; training concentrated on one phase; the causal
signature of ablating a head. alpha 8, V 64 (the model leaves them open), side by side with the
reference numbers of the model's original check (docs/theory.md).

Writes ``--out`` (JSON, default ``runs/theory/predictions.json``); ``--record`` also copies it to
``analyses/results/theory_predictions.json``. ``make figures`` computes the same predictions
itself (``phasemech.theory.dynamics.predictions``).

Usage: ``python analyses/theory_predictions.py [--out PATH] [--record]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from phasemech.core.io import write_json_atomic
from phasemech.theory.dynamics import predictions, predictions_text

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/theory/predictions.json"))
    parser.add_argument("--record", action="store_true", help="copy the JSON to results/")
    args = parser.parse_args()
    p = predictions()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, json.loads(json.dumps(p, default=float)))
    print(predictions_text(p))
    if args.record:
        shutil.copy(args.out, RESULTS / "theory_predictions.json")


if __name__ == "__main__":
    main()
