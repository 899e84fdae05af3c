"""The claims report's section 5: the evaluation fix (report retrieval
per phase, never only averaged).

Axes: ``phase``; rows are models.
"""

from __future__ import annotations

from phasemech.experiments.claims.sources import Sources, f3, figure_line, model_rows


def claim_evaluation(src: Sources) -> str:
    out = ["## 5. The evaluation fix: report per phase", ""]
    out.append("*Paper*: report retrieval per phase, never only averaged over positions.")
    out.append("")
    models = model_rows(src)
    top = models.iloc[0]
    dense = models[models["design"] == "none"]
    out.append(
        "- phasemech reports per phase by default: `phasemech eval RUN` prints accuracy per "
        "phase with Wilson and cluster-bootstrap CIs, the debiased gap with its permutation "
        "null, a depth-adjusted logistic test and the paired test (docs/statistics.md)."
    )
    out.append(
        f"- What the average hides: {top['model']} averages {top['accuracy']:.3f}, but phase "
        f"{top['weak_phase']} is at {top['weak_accuracy']:.3f}."
    )
    if len(dense):
        d = dense.iloc[0]
        out.append(
            f"- The dense control's debiased gap is {f3(d['gap'])} [{f3(d['lo'])}, "
            f"{f3(d['hi'])}]"
            + (
                ": its CI includes 0, so no phase effect is claimed where none is expected, "
                "though a raw max-min gap is never exactly 0."
                if d["lo"] <= 0 <= d["hi"]
                else ": its CI excludes 0 (a small phase effect even without compression; "
                "compare the compressed models' gaps with it)."
            )
        )
    out += [
        "",
        "Verdict: **Adopted** (a practice, not a measurement): every phasemech evaluation is "
        "per phase.",
        "",
        figure_line(src, "accuracy_by_phase_polar_d8", "accuracy_by_phase_polar_d4"),
    ]
    return "\n".join(out)


__all__ = ["claim_evaluation"]
