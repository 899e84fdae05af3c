"""The claims report's section 2: the weak spots reproduce from
scratch, across designs (the figures run's models, the recorded phase sweep, and at
convergence the converged sweeps with the rules of :mod:`phasemech.experiments.claims.converged`).

Axes: ``phase``; rows are settings (design x stride x heads x T).
"""

from __future__ import annotations

from pathlib import Path

from phasemech.experiments.claims.converged import converged_claim_lines, merge_summaries
from phasemech.experiments.claims.sources import (
    Sources,
    f3,
    figure_line,
    load_json,
    model_rows,
    not_measured,
)
from phasemech.experiments.sweep.profiles import PROFILES as SWEEP_PROFILE_DEFS


def claim_from_scratch(src: Sources) -> str:
    out = ["## 2. Reproducible from scratch, across designs", ""]
    out.append("*Paper*: small transformers pretrained with several compression designs show it.")
    out.append("")
    models = model_rows(src)
    for r in models.itertuples():
        sig = "CI excludes 0" if r.lo > 0 else "CI includes 0"
        out.append(
            f"- {r.model}: accuracy {r.accuracy:.3f}, debiased gap {f3(r.gap)} "
            f"[{f3(r.lo)}, {f3(r.hi)}] ({sig})."
        )
    out.append(f"  (`{src.command}`.)")
    sweep = load_json(src.results / "phase_sweep_default.json")
    gapped: set[str] = set()
    if sweep is not None:
        rows = [r for r in sweep["rows"] if r["seed"] == "pooled" and r["targets"] == "all"]
        largest: dict[str, float] = {}
        for r in rows:
            g, lo = r["debiased_gap"], r["debiased_lo"]
            largest[r["design"]] = max(largest.get(r["design"], -1.0), g)
            if r["design"] != "none" and lo > 0 and g > r["null_p95"]:
                gapped.add(r["design"])
        out.append(
            f"- The phase sweep ({sweep['models']} models, {len(largest)} designs, seeds "
            f"pooled): designs with a gap above the permutation null's 95th percentile and a "
            f"CI excluding 0 in some setting: {', '.join(sorted(gapped)) or 'none'}. Largest "
            "debiased gap per design: "
            + ", ".join(f"{k} {v:.3f}" for k, v in largest.items())
            + ". Source `analyses/results/phase_sweep_default.json` (`make sweep`)."
        )
    else:
        out.append("- " + not_measured("analyses/results/phase_sweep_default.json", "make sweep"))
    designs = {r.design for r in models.itertuples() if r.lo > 0 and r.design != "none"}
    designs |= gapped
    verdict = (
        f"**Supported** for {len(designs)} designs ({', '.join(sorted(designs))})"
        if len(designs) >= 2
        else f"**Not supported**: only {len(designs)} design(s) show a gap"
    )
    rule = "at least two compressed designs with a debiased-gap CI above 0"
    conv_lines, conv_verdict = converged_sweep_lines(src)
    out += conv_lines
    if conv_verdict is not None:
        rule, verdict = CONVERGED_RULE, conv_verdict
    out += [
        "",
        f"Verdict (rule: {rule}): " + verdict + ".",
        "",
        figure_line(src, "accuracy_by_phase_d4", "accuracy_by_phase_polar_d8", "training_dynamics"),
    ]
    return "\n".join(out)


# sweep.py's converged profiles: d = 4 at T = 64, d = 8 (d_model 64 and 128), and the context
# axis at T = 128
SWEEP_PROFILES = ("converged", "converged_d8", "converged_d8_wide", "converged_T128")


CONVERGED_RULE = (
    "only models with held-out accuracy >= 0.95 are pooled; a setting has a gap when its "
    "debiased-gap CI lies above 0 and above its dense control's CI, and, where dense models "
    "were evaluated at the accuracy band the setting ends in, its held-out raw gap in that band "
    "exceeds theirs"
)


def converged_sweeps(results: Path) -> list[tuple[str, dict]]:
    """The recorded converged phase sweeps, ``(profile, summary)``, in profile order."""
    runs = [(n, load_json(results / f"phase_sweep_{n}.json")) for n in SWEEP_PROFILES]
    return [(n, s) for n, s in runs if s is not None]


def converged_sweep_lines(src: Sources) -> tuple[list[str], str | None]:
    """The gap claim at convergence over every recorded converged sweep, and its verdict
    (None: no converged sweep is recorded)."""
    convs = converged_sweeps(src.results)
    if not convs:
        cmd = "phasemech run phase_sweep --profile converged"
        return ["- " + not_measured("analyses/results/phase_sweep_converged.json", cmd)], None
    named = ", ".join(
        f"`analyses/results/phase_sweep_{n}.json` (`phasemech run phase_sweep --profile {n}`)"
        for n, _ in convs
    )
    # the width a recording states; recordings made before sweeps wrote it: the profile's
    widths = [c.get("profile", {}).get("d_model", SWEEP_PROFILE_DEFS[n].d_model) for n, c in convs]
    merged = merge_summaries([c for _, c in convs], widths)
    lines, verdict = converged_claim_lines(merged, "the converged sweeps")
    intro = (
        f"At convergence ({named}; the models above and the older sweep mostly never left the "
        "loss plateau, so the verdict reads these):"
    )
    return ["", intro, "", *lines], verdict


__all__ = [
    "CONVERGED_RULE",
    "SWEEP_PROFILES",
    "claim_from_scratch",
    "converged_sweep_lines",
    "converged_sweeps",
]
