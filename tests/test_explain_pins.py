"""The phase-dependence rule of the reports pinned at its thresholds: Holm p < 0.05 (not the
uncorrected p) and a per-phase range >= 10 points, with units just either side of each, in
the explanation's findings and table and in the interventions' weak spots.

Axes: ``unit`` (a head: ``layer.unit``), ``phase``.
"""

from __future__ import annotations

import pandas as pd

from phasemech.experiments.explain.summary import findings, head_lines
from phasemech.experiments.interventions.summary import weak_spots

#: (layer, unit): (p_perm, p_holm, phase_range), each just inside or outside the rule
EDGES = {
    (0, 0): (0.001, 0.049, 0.101),  # in: both just inside
    (0, 1): (0.001, 0.051, 0.5),  # out: Holm p just above 0.05
    (1, 0): (0.01, 0.2, 0.5),  # out: only the uncorrected p is below 0.05
    (1, 1): (0.001, 0.01, 0.099),  # out: range just below 10 points
    (2, 0): (0.001, 0.001, 0.10),  # in: range exactly 10 points
    (2, 1): (0.001, 0.001, 0.7 - 0.6),  # in: 10 points as the means' difference (0.0999...)
}
IN = [(0, 0), (2, 0), (2, 1)]


def _spec(metric: str = "accuracy") -> pd.DataFrame:
    rows = [
        dict(component="head", metric=metric, mode="zero", layer=layer, unit=unit,
             overall=-0.05 * (1 + layer + unit), served_phase=1, si=0.4, p_perm=pp, p_holm=ph,
             phase_range=r, rank=1 + i, base_range=0.0, ablated_range=r)
        for i, ((layer, unit), (pp, ph, r)) in enumerate(EDGES.items())
    ]  # fmt: skip
    return pd.DataFrame(rows)


def test_findings_apply_holm_and_the_range_at_their_thresholds():
    spec = pd.concat([_spec("accuracy"), _spec("logit_diff")], ignore_index=True)
    f = findings({"ablation_specialization": spec}, n_layers=3)
    got = sorted((h["layer"], h["unit"]) for h in f["phase_dependent_heads"])
    assert got == IN
    assert f["n_heads_tested"] == len(EDGES)


def test_head_lines_print_the_uncorrected_and_the_holm_p():
    lines = head_lines({"ablation_specialization": _spec("logit_diff")})
    row = next(x for x in lines if x.startswith("| 1.0 |"))
    assert row.endswith("| 0.01 | 0.2 | nan |"), row  # p (perm) | p (Holm) | p (F, Holm)
    header = "| layer.head | mean effect | served phase | SI | p (perm) | p (Holm) | p (F, Holm) |"
    assert lines.count(header) == 1


def test_weak_spots_apply_holm_and_the_range_at_their_thresholds():
    spec = _spec()
    acc = pd.DataFrame(
        [
            dict(
                component="head",
                mode="zero",
                layer=layer,
                unit=unit,
                phase=phase,
                ablated=0.9 - 0.2 * (phase == 1),
                effect=-0.2 * (phase == 1),
            )
            for (layer, unit) in EDGES
            for phase in range(4)
        ]  # fmt: skip
    )
    got = weak_spots(acc, spec)["unit"].tolist()
    assert got == [f"head/zero L{layer}.{unit}" for layer, unit in IN]
