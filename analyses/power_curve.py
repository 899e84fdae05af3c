"""Power of the audit's per-phase tests at the audit's own sample size, against the planted gap.

Axes: ``gap`` (the planted gap, percentage points), ``sim`` (simulated audits), ``content``,
``phase``, ``test``.

One simulated audit is one setting of ``phasemech audit`` at its defaults: 50 contents, each
at one depth (the contents cycle through depths 0.1, 0.3, 0.5, 0.7, 0.9, ten per depth, as
the probe builds them) and at every phase of stride 4: 200 paired prompts. Per-phase
accuracy is ``acc`` at three phases and ``acc - gap`` at the weak phase (phase 1); with
``content_sd > 0`` each content's logit is shifted by a ``N(0, content_sd)`` draw (some
contents are harder at every phase) and the logit-scale dip is chosen so that the *marginal*
per-phase accuracies are still ``acc`` and ``acc - gap``. Each audit is scored by the tests
the audit reports per setting (:func:`phasemech.measure.pretrained.report`): ``perm`` (the
raw gap's permutation p, within depth bins, 1000 permutations), ``cochran`` (Cochran's Q over
the paired phases), ``logistic`` (the depth-adjusted likelihood-ratio test) and ``mcnemar``
(the smallest Holm-adjusted exact McNemar p over the 6 phase pairs: the p-values of
:func:`~phasemech.measure.pretrained.mcnemar_pairs`, computed here from the content x phase
table, since that function's statsmodels Holm runs the garbage collector on each call).
Power is the share of audits with ``p < alpha``; at gap 0 it is the test's size.

Writes ``OUT/power_curve.json`` and ``OUT/power_curve.md`` (default ``analyses/results``):

    nice -n 5 .venv/bin/python analyses/power_curve.py --sims 250
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import brentq
from scipy.special import expit, logit
from scipy.stats import binom

from phasemech.core.io import write_json_atomic, write_text_atomic
from phasemech.measure.stats import holm, logistic_phase_test, paired_phase_test, phase_gap

N_CONTENTS, DEPTHS, STRIDE, WEAK = 50, (0.1, 0.3, 0.5, 0.7, 0.9), 4, 1
GAPS_PP = (0, 2, 5, 8, 10, 15, 20, 30)
TESTS = ("perm", "cochran", "logistic", "mcnemar")
#: Gauss-Hermite nodes for the marginal accuracy over the contents' logit shifts
_NODES, _WEIGHTS = np.polynomial.hermite_e.hermegauss(40)


def _marginal_logit(p: float, sd: float) -> float:
    """The logit ``eta`` with ``E expit(eta + sd * Z) = p``, ``Z ~ N(0, 1)``."""
    if sd == 0:
        return float(logit(p))
    mean = lambda eta: (_WEIGHTS * expit(eta + sd * _NODES)).sum() / _WEIGHTS.sum() - p  # noqa: E731
    return float(brentq(mean, -30, 30))


def simulate(gap_pp: float, rng: np.random.Generator, acc: float, content_sd: float):
    """One simulated audit's targets frame: ``correct, phase, depth, seq_id, group_id,
    pair_id`` (one row per prompt, 50 contents x 4 phases)."""
    content = np.repeat(np.arange(N_CONTENTS), STRIDE)
    phase = np.tile(np.arange(STRIDE), N_CONTENTS)
    depth = np.asarray(DEPTHS)[content % len(DEPTHS)]
    eta = np.full(STRIDE, _marginal_logit(acc, content_sd))
    eta[WEAK] = _marginal_logit(acc - gap_pp / 100, content_sd)
    shift = content_sd * rng.normal(size=N_CONTENTS)[content]
    correct = rng.random(len(content)) < expit(eta[phase] + shift)
    return pd.DataFrame({"correct": correct, "phase": phase, "depth": depth, "seq_id": content,
                         "group_id": content, "pair_id": content})  # fmt: skip


def p_values(df: pd.DataFrame, tests=TESTS, n_perm: int = 1000, seed: int = 0) -> dict:
    """Each named test's p on one simulated audit (as the audit computes it)."""
    out = {}
    if "perm" in tests:
        gap = phase_gap(df, STRIDE, n_perm=n_perm, n_boot=0, n_splits=1, seed=seed)
        out["perm"] = gap["p_perm"]
    if "cochran" in tests:
        out["cochran"] = paired_phase_test(df, STRIDE)["p"]
    if "logistic" in tests:
        out["logistic"] = logistic_phase_test(df, STRIDE)["p"]
    if "mcnemar" in tests:
        out["mcnemar"] = mcnemar_min_holm(df)
    return out


def mcnemar_min_holm(df: pd.DataFrame) -> float:
    """The smallest Holm-adjusted exact McNemar p over the phase pairs (every content at every
    phase): ``min(1, 2 P(Bin(b + c, 1/2) <= min(b, c)))``, 1 without discordant pairs."""
    wide = df.pivot(index="group_id", columns="phase", values="correct").to_numpy(bool)
    a, b = np.triu_indices(STRIDE, 1)
    n10 = (wide[:, a] & ~wide[:, b]).sum(0)
    n01 = (~wide[:, a] & wide[:, b]).sum(0)
    p = np.minimum(1.0, 2 * binom.cdf(np.minimum(n10, n01), n10 + n01, 0.5))
    return float(holm(np.where(n10 + n01 > 0, p, 1.0)).min())


def power(
    gap_pp: float,
    n_sims: int,
    *,
    acc: float = 0.9,
    content_sd: float = 0.0,
    tests=TESTS,
    alpha: float = 0.05,
    n_perm: int = 1000,
    seed: int = 0,
) -> dict[str, float]:
    """Share of ``n_sims`` simulated audits in which each test has ``p < alpha``."""
    rng = np.random.default_rng([seed, int(round(gap_pp * 100)), int(content_sd * 100)])
    rejected = {t: 0 for t in tests}
    for s in range(n_sims):
        for t, p in p_values(simulate(gap_pp, rng, acc, content_sd), tests, n_perm, s).items():
            rejected[t] += bool(p < alpha)  # NaN (no variation) never rejects
    return {t: k / n_sims for t, k in rejected.items()}


def _markdown(rec: dict) -> str:
    lines = [
        "# Power of the audit's per-phase tests",
        "",
        f"{rec['design']}; alpha {rec['alpha']}, {rec['n_sims']} simulated audits per point, "
        f"{rec['n_perm']} permutations; command `{rec['command']}`; {rec['seconds']:.0f} s.",
    ]
    for curve in rec["curves"]:
        head = f"## accuracy {curve['acc']}, content logit sd {curve['content_sd']}"
        lines += ["", head, "", "| gap (pp) | " + " | ".join(TESTS) + " |"]
        lines.append("|---|" + "---|" * len(TESTS))
        for row in curve["rows"]:
            cells = " | ".join(f"{row[t]:.3f}" for t in TESTS)
            lines.append(f"| {row['gap_pp']} | {cells} |")
    lines += ["", "Monte Carlo standard error of a power p: sqrt(p (1 - p) / n_sims) "
              f"(at most {0.5 / np.sqrt(rec['n_sims']):.3f})."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sims", type=int, default=250)
    ap.add_argument("--acc", type=float, default=0.9)
    ap.add_argument("--content-sd", type=float, nargs="+", default=[0.0, 1.5])
    ap.add_argument("--out", type=Path, default=Path("analyses/results"))
    args = ap.parse_args(argv)
    start, curves = time.time(), []
    for sd in args.content_sd:
        rows = []
        for g in GAPS_PP:
            rows.append({"gap_pp": g, **power(g, args.sims, acc=args.acc, content_sd=sd)})
            print(sd, rows[-1], flush=True)
        curves.append({"acc": args.acc, "content_sd": sd, "rows": rows})
    sds = " ".join(str(s) for s in args.content_sd)
    rec = {
        "design": f"{N_CONTENTS} contents (depths {list(DEPTHS)} cycling) x {STRIDE} phases = "
        f"{N_CONTENTS * STRIDE} paired prompts, a dip of `gap` at phase {WEAK}",
        "alpha": 0.05, "n_sims": args.sims, "n_perm": 1000, "tests": list(TESTS),
        "command": f"python analyses/power_curve.py --sims {args.sims} --acc {args.acc} "
        f"--content-sd {sds}",
        "seconds": time.time() - start, "curves": curves,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / "power_curve.json", rec)
    write_text_atomic(args.out / "power_curve.md", _markdown(rec))
    print(_markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
