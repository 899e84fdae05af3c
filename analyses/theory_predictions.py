"""Re-derive THEORY.md's predictions with ``phasemech.theory`` (seconds; prints a table).

First pass (issue 7 starts here): the critical beta/d vs log(N-1), the plateau length vs N,
capacity H vs d, and the slot-handicap gap under aligned / staggered / random offsets, with the
parameters this module uses by default (alpha 8, V 64; THEORY.md leaves them open).

Usage: ``python analyses/theory_predictions.py``.
"""

from __future__ import annotations

import math

import numpy as np

from phasemech.theory import TheoryConfig, critical_beta_over_d, simulate


def main() -> None:
    print("critical beta/d (uniform pooling turns stable) vs log(N-1):")
    ns = (16, 64, 256, 1024)
    crit = [critical_beta_over_d(n) for n in ns]
    for n, c in zip(ns, crit, strict=True):
        print(f"  N={n:5d}: {c:.2f} vs {math.log(n - 1):.2f}")
    slope = np.polyfit([math.log(n - 1) for n in ns], crit, 1)[0]
    print(f"  slope of critical beta/d against log(N-1): {slope:.2f}")
    print("plateau (flow time to mean max weight > 0.5), d=H=8, beta=8, 6000 steps, dt 0.5:")
    for n in (16, 64, 256, 1024):
        tr = simulate(TheoryConfig(d=8, heads=8, n_windows=n, beta=8.0), steps=6000)
        print(f"  N={n:5d}: {tr.time_to_specialize()} (phases covered {tr.covered()})")
    print("capacity, d=8, beta=8: final accuracy proxy per phase")
    for h in (2, 4, 8):
        tr = simulate(TheoryConfig(d=8, heads=h, beta=8.0), steps=6000)
        print(f"  H={h}: covered {tr.covered()}: {np.round(tr.accuracy[-1], 2).tolist()}")
    gain = tuple(0.8 ** (8 - 1 - slot) for slot in range(8))
    print("slot handicap c_l = 0.8^(d-1-l), d=H=8, beta=16:")
    for off in ("aligned", "staggered", "random"):
        tr = simulate(TheoryConfig(beta=16.0, gain=gain, offsets=off), steps=6000)
        print(f"  {off:9s}: gap {tr.gap:.2f}, mean {tr.accuracy[-1].mean():.2f}")


if __name__ == "__main__":
    main()
