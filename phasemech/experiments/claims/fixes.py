"""The claims report's section 6: the untested fixes (staggered or random
offsets, phase-jittered data), from the recorded fixes runs.

Axes: ``phase``; rows are fixes (seeds pooled) or comparisons with a baseline.

A comparison is *untestable* where its baseline has no gap (:func:`baseline_has_gap`: a seed
of the baseline never learned, or its pooled debiased-gap CI reaches 0): a fix cannot be shown
to shrink a gap that is not there. The verdict (:func:`fixes_verdict`) says so where no
comparison was testable.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from phasemech.experiments.claims.sources import Sources, f3, figure_line, load_json, not_measured
from phasemech.measure.learning import all_off_plateau, seeds_off_plateau

# fixes.py profiles, in order of training budget (converged: every model trained to 0.99)
FIX_PROFILES = ("default", "long", "converged")


def _learned_at(fx: dict) -> tuple[float, str]:
    """The held-out accuracy at which a recorded fixes run counts a seed as learned."""
    at = fx["profile"].get("min_accuracy", fx["plateau_exit"])
    return at, "converged" if at > fx["plateau_exit"] else "left the loss plateau"


def fix_runs(results: Path) -> list[tuple[str, dict]]:
    """The recorded fixes runs, ``(profile, summary)``, shortest training budget first."""
    runs = ((name, load_json(results / f"fixes_{name}.json")) for name in FIX_PROFILES)
    return [(name, fx) for name, fx in runs if fx is not None]


def baseline_has_gap(res: pd.DataFrame, baseline: str, at: float) -> bool:
    """Whether ``baseline`` has a gap a fix could cut: every seed learned (held-out accuracy
    >= ``at``: an unlearned model's gap is no design's) and its pooled debiased-gap CI lies
    above 0."""
    row = res[(res["seed"] == "pooled") & (res["targets"] == "all") & (res["fix"] == baseline)]
    learned = all_off_plateau(res, baseline, at)
    return learned and bool(len(row)) and float(row["debiased_lo"].iloc[0]) > 0


def base_why(res: pd.DataFrame, baseline: str, at: float) -> str:
    """Why ``baseline`` has no gap to cut (:func:`baseline_has_gap` is False)."""
    up, n = seeds_off_plateau(res, baseline, at)
    if up < n:
        return f"{n - up} of {n} baseline seeds below {at} accuracy"
    return "its debiased-gap CI reaches 0"


def fixes_verdict(met: list[str], testable: list[str], untestable: list[str]) -> str:
    """``met``: the fixes that met the goal; ``testable`` / ``untestable``: the comparisons at
    the longest budget whose baseline has / has no gap to cut."""
    if met:
        return f"**Goal met** by {', '.join(met)}"
    if not testable:
        return (
            "**Untestable**: no baseline has a gap to cut (a seed not learned, or its debiased-gap "
            "CI reaches 0) in " + ", ".join(untestable)
        )
    tail = (
        f"; untestable (the baseline has no gap to cut): {', '.join(untestable)}"
        if untestable
        else ""
    )
    return f"**Goal not met** by any of the {len(testable)} testable comparisons{tail}"


def _fixes_run(name: str, fx: dict) -> tuple[list[str], list[str]]:
    """The lines for one recorded fixes profile, and the fixes that met the goal there."""
    prof = fx["profile"]
    res = pd.DataFrame(fx["results"])
    pooled = res[(res["seed"] == "pooled") & (res["targets"] == "all")]
    out = [
        f"**Profile {name}**: matched {prof['design']} models, d = {prof['stride']}, "
        f"{prof['heads']} heads, T = {prof['seq_len']}, {len(prof['seeds'])} seeds, "
        f"{prof['steps']} steps; one shared test set of {prof['test_sequences']} phase-balanced "
        f"sequences (`phasemech run fixes --profile {name}`, recorded; "
        f"`analyses/results/fixes_{name}.md`).",
        "",
    ]
    at, learned = _learned_at(fx)
    for r in pooled.itertuples():
        up, n = seeds_off_plateau(res, r.fix, at)
        out.append(
            f"- {r.fix}: accuracy {r.accuracy:.3f}, by phase "
            f"{' '.join(f'{x:.3f}' for x in r.acc_by_phase)}, debiased gap {f3(r.debiased_gap)} "
            f"[{f3(r.debiased_lo)}, {f3(r.debiased_hi)}]; {up} of {n} seeds {learned} "
            f"(accuracy >= {at})."
        )
    out.append("")
    cmp = pd.DataFrame(fx["comparison"])
    met = []
    for r in cmp[cmp["targets"] == "all"].itertuples():
        up, n = seeds_off_plateau(res, r.fix, at)
        base_up, base_n = seeds_off_plateau(res, r.baseline, at)
        why = []
        if not r.meets_goal:
            if not r.reduction >= fx["goal_reduction"]:
                why.append(f"reduction below {fx['goal_reduction']:.0%}")
            if r.reduction_hi < 0:
                why.append("the gap grows (reduction CI below 0)")
            elif not r.reduction_lo > 0:
                why.append("reduction CI reaches 0")
            if not r.accuracy_diff_lo > -fx["noninferiority"]:
                why.append("costs mean accuracy")
            if up < n:
                why.append(f"{n - up} of {n} seeds below {at} accuracy, so their gap is no fix")
            if base_up < base_n:
                why.append(f"{base_n - base_up} of {base_n} baseline seeds below {at} accuracy")
        reading = (
            "meets the goal."
            if r.meets_goal
            else f"misses the goal ({'; '.join(why)})."
            if baseline_has_gap(res, r.baseline, at)
            else f"untestable: the baseline has no gap to cut ({base_why(res, r.baseline, at)})."
        )
        out.append(
            f"- {r.fix} vs {r.baseline}: gap {f3(r.gap_baseline)} -> {f3(r.gap_other)}, "
            f"reduction {100 * r.reduction:.0f}% [{100 * r.reduction_lo:.0f}%, "
            f"{100 * r.reduction_hi:.0f}%], accuracy change {r.accuracy_diff:+.3f} "
            f"[{r.accuracy_diff_lo:+.3f}, {r.accuracy_diff_hi:+.3f}]: " + reading
        )
        if r.meets_goal:
            met.append(f"{r.fix} ({name})")
    return out, met


def fixes_training_lines(fx: dict) -> list[str]:
    """Along training (profiles that record convergence and matched tables): each fix's steps
    to 0.95 held-out accuracy beside its baseline's, and their held-out raw gaps at equal
    accuracy (the 0.9-0.99 band, where converging models spend most evaluations)."""
    conv, matched = pd.DataFrame(fx.get("convergence", [])), pd.DataFrame(fx.get("matched", []))
    if not len(conv) or not len(matched):
        return []

    def steps(fix: str) -> str:
        s = conv.loc[conv["fix"] == fix, "steps_to_95"].dropna()
        n = int((conv["fix"] == fix).sum())
        return f"median {s.median():.0f} ({len(s)} of {n} seeds)" if len(s) else f"never ({n})"

    out = ["", "Along training (held-out evaluations):"]
    band = matched[matched["band"] == "0.9-0.99"].set_index("fix")
    for fix, base in matched.dropna(subset=["baseline"]).groupby("fix")["baseline"].first().items():
        gap = (
            f"raw gap at accuracy 0.9-0.99 {f3(band.loc[fix, 'raw_gap'])} vs "
            f"{f3(band.loc[base, 'raw_gap'])} ({band.loc[fix, 'n']} vs {band.loc[base, 'n']} "
            "evaluations)"
            if fix in band.index and base in band.index
            else "no evaluations of both at accuracy 0.9-0.99"
        )
        out.append(f"- {fix} vs {base}: steps to 0.95 {steps(fix)} vs {steps(base)}; {gap}.")
    return out


def claim_fixes(src: Sources) -> str:
    out = ["## 6. The untested fixes: staggered or random offsets, phase-jittered data", ""]
    runs = fix_runs(src.results)
    goal = f">= {runs[-1][1]['goal_reduction']:.0%}" if runs else "the recorded goal"
    out.append(
        "*Paper*: randomised or staggered stride offsets per layer or per head, and "
        f"phase-jittered training data, are open. Goal tested: cut the debiased gap by {goal} "
        "at no loss of mean accuracy."
    )
    out.append("")
    if not runs:
        out.append(
            not_measured(
                "analyses/results/fixes_default.json", "phasemech run fixes --profile default"
            )
        )
        return "\n".join([*out, "", "Verdict: **Open**: the fixes have not been measured."])
    met = []
    for name, fx in runs:
        lines, m = _fixes_run(name, fx)
        out += [*lines, *fixes_training_lines(fx), ""]
        met += m
    name, fx = runs[-1]
    cmp = pd.DataFrame(fx["comparison"])
    cmp = cmp[cmp["targets"] == "all"]
    res = pd.DataFrame(fx["results"])
    at, word = _learned_at(fx)
    learned = [f for f in cmp["fix"] if all_off_plateau(res, f, at)]
    wider = list(cmp.loc[cmp["reduction_hi"] < 0, "fix"])
    narrower = list(cmp.loc[cmp["reduction_lo"] > 0, "fix"])
    out += [
        f"At the longest budget recorded ({name}, {fx['profile']['steps']} steps): every seed "
        f"{word} for {len(learned)} of {len(cmp)} fixes; the gap is significantly "
        f"wider than the baseline's for {len(wider)} ({', '.join(wider) or 'none'}) and "
        f"significantly narrower for {len(narrower)} ({', '.join(narrower) or 'none'}).",
        "",
    ]
    has = {
        f"{r.fix} vs {r.baseline}": baseline_has_gap(res, r.baseline, at) for r in cmp.itertuples()
    }
    verdict = fixes_verdict(
        met, [k for k, v in has.items() if v], [k for k, v in has.items() if not v]
    )
    out += [
        f"Verdict (rule: reduction >= {fx['goal_reduction']:.0%} with its CI above 0, the "
        f"accuracy change's CI above -{fx['noninferiority']:.0%}, every seed of the fix and of "
        f"its baseline {word} (held-out accuracy >= {at}); untestable where the baseline has no "
        "gap to cut (a seed not learned, or its debiased-gap CI reaches 0), at the longest "
        "budget): " + verdict + ".",
        "",
        figure_line(src, "fixes_by_phase"),
    ]
    return "\n".join(out)


__all__ = [
    "FIX_PROFILES",
    "base_why",
    "baseline_has_gap",
    "claim_fixes",
    "fix_runs",
    "fixes_training_lines",
    "fixes_verdict",
]
