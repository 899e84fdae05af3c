"""The claims report's section 4: the gradient-flow theory, its predictions
recomputed on every run and against the recorded trained gated models.

Axes: ``head``, ``phase``; rows are trained models.
"""

from __future__ import annotations

from pathlib import Path

from phasemech.experiments.claims.converged import D_MODEL
from phasemech.experiments.claims.sources import Sources, figure_line, load_json, not_measured
from phasemech.experiments.theory_trained.profiles import D_HEAD
from phasemech.theory.dynamics import fmt_num, fmt_time


def _shape(r: dict) -> str:
    """What the flow ended with: sharp weights, broad ones, or still uniform pooling."""
    return "sharp" if r["sharp"] else "broad" if r["left_uniform"] else "uniform"


def claim_theory(src: Sources) -> str:
    t = src.theory
    out = ["## 4. Gradient-flow theory", ""]
    out.append(
        "*Paper*: gradient flow of an idealized retrieval model favours sharp phase "
        "specialisation. phasemech implements the paper's theory model "
        "(`phasemech.theory.dynamics`; alpha "
        f"{t['alpha']:g}, V {t['vocab']}, which the model leaves open) and re-derives its numbers "
        "on every `make figures` (`phasemech theory`, `python analyses/theory_predictions.py`)."
    )
    out.append("")
    lines, (held, failed) = _theory_model_lines(src.theory)
    out += lines
    lines, pooled = _theory_trained_lines(src)
    out += lines
    ranked = pooled is not None and pooled["p"] == pooled["p"] and pooled["p"] < 0.05
    verdict = (
        f"**{'Supported' if not failed and ranked else 'Partly supported'}**: "
        f"{len(held)} of {len(t['checks'])} of the model's predictions hold in the idealized "
        "model; "
        + (
            "trained models' weak phases follow the theory read off their own pooling weights "
            f"(pooled p {pooled['p']:.2g})"
            if ranked
            else "trained models' weak phases are not significantly ranked by the theory"
            if pooled is not None
            else "trained models not compared"
        )
    )
    out += [
        "",
        "Verdict (rule: every qualitative prediction holds, and the pooled rank test against "
        "trained models has p < 0.05): " + verdict + ".",
        "",
        figure_line(src, "theory_plateau", "theory_vs_trained"),
    ]
    return "\n".join(out)


def _theory_model_lines(t: dict) -> tuple[list[str], tuple[list[str], list[str]]]:
    """The theory model's own predictions, recomputed on this run, as report lines; and its
    qualitative checks that held and that failed."""
    md = t["theory_md"]
    out: list[str] = []
    shifts = [r["critical_beta_over_d"] - r["log_n_minus_1"] for r in t["critical"]]
    crit = ", ".join(
        f"N={r['n_windows']}: {r['critical_beta_over_d']:.2f} vs {r['log_n_minus_1']:.2f}"
        for r in t["critical"]
    )
    out.append(
        f"- Uniform pooling is unstable iff g''(1/d) > 0; the critical beta/d against log(N-1): "
        f"{crit} (slope {t['critical_slope']:.2f}; critical minus log(N-1) from "
        f"{min(shifts):+.2f} to {max(shifts):+.2f})."
    )
    stab = "; ".join(
        f"beta/d={r['beta_over_d']:g}: lambda {r['eigenvalue']:+.3f}, final mean max weight "
        f"{r['final_mean_max_weight']:.2f} ({_shape(r)})"
        for r in t["stability"]
    )
    out.append(f"- Eigenvalue at uniform pooling vs the flow ({t['stability_setup']}): {stab}.")
    both = [r for r in t["plateau"] if r["time"] is not None]
    rel_diff = max((abs(r["time"] / r["theory_md"] - 1) for r in both), default=None)
    plateau = ", ".join(
        f"N={r['n_windows']}: {fmt_time(r['time'])} (reference {r['theory_md']})"
        for r in t["plateau"]
    )
    budget = ", ".join(
        f"N={r['n_windows']}: gap {r['gap_at_budget']:.2f}, mean {r['mean_at_budget']:.2f}"
        for r in t["plateau"]
    )
    out.append(
        f"- Plateau before specialisation ({t['plateau_setup']}): {plateau}; log-log slope "
        f"{fmt_num(t['plateau_loglog_slope'])}; largest relative difference from the reference "
        f"times {fmt_num(rel_diff)}. At the fixed budget: {budget}."
    )
    cap = ", ".join(
        f"H={r['heads']}: {r['covered']} covered, {r['served']} served" for r in t["capacity"]
    )
    low = t["capacity_low_alpha"]
    out.append(
        f"- Capacity ({t['capacity_setup']}): {cap}. A covered phase reaches "
        f"{max(t['capacity'][0]['accuracy']):.2f} here; the reference "
        f"{md['capacity_h2_accuracy']} is the level at {low['setup']} "
        f"({low['covered_level']:.2f})."
    )
    by_off = {r["offsets"]: r for r in t["handicap"]}
    hand = "; ".join(
        f"{r['offsets']}: gap {r['gap']:.2f}, mean {r['mean']:.2f} (reference "
        f"{r['theory_md']['gap']:.2f} / {r['theory_md']['mean']:.2f})"
        for r in t["handicap"]
    )
    out.append(
        f"- Shared slot handicap ({t['handicap_setup']}): {hand}. Phases below 0.5: "
        + ", ".join(f"{r['offsets']} {sum(x < 0.5 for x in r['accuracy'])}" for r in t["handicap"])
        + "."
        + (
            " Random and aligned offsets end at the same mean: one shift per sequence shared by "
            "all heads leaves the expected loss under uniform phases unchanged, so random "
            "offsets train exactly as aligned ones and only spread the same accuracy over the "
            "phases at test time."
            if abs(by_off["random"]["mean"] - by_off["aligned"]["mean"]) < 1e-6
            else ""
        )
    )
    conc = "; ".join(
        f"{r['share']:.0%} of training on phase 0: {r['covered']} covered"
        for r in t["concentrated"]
    )
    out.append(f"- Training phase distribution: {conc}.")
    ab = t["ablation"]
    out.append(
        f"- Causal signature: ablating a head hurts most the phase it weighs most for "
        f"{ab['matches']} of {ab['heads']} heads."
    )
    held = [k for k, ok in t["checks"].items() if ok]
    failed = [k for k, ok in t["checks"].items() if not ok]
    out.append(
        f"- The model's qualitative predictions, checked on these numbers: {len(held)} of "
        f"{len(t['checks'])} hold"
        + (f"; not reproduced: {'; '.join(failed)}" if failed else "")
        + "."
    )
    return out, (held, failed)


# theory_trained.py profiles: the converged ones first (the verdict reads the first recorded)
THEORY_PROFILES = ("converged", "converged_d8", "default")


def theory_runs(results: Path) -> list[tuple[str, dict]]:
    """The recorded theory-vs-trained runs, ``(profile, summary)``: the converged profiles when
    any is recorded (the older one's models mostly never learned), else the default one."""
    runs = [(n, load_json(results / f"theory_trained_{n}.json")) for n in THEORY_PROFILES]
    runs = [(n, tt) for n, tt in runs if tt is not None]
    return [r for r in runs if r[0] != "default"] or runs


def model_learned(m: dict) -> bool:
    """A model that learned by the recorded run's rule (older runs: off the loss plateau)."""
    return bool(m.get("learned", m["off_plateau"]))


def _theory_trained_lines(src: Sources) -> tuple[list[str], dict | None]:
    """Theory vs the recorded trained gated models: report lines and the first run's pooled
    rank test (the verdict's)."""
    runs = theory_runs(src.results)
    if not runs:
        cmd = "phasemech run theory_trained --profile converged"
        return ["- " + not_measured("analyses/results/theory_trained_converged.json", cmd)], None
    out: list[str] = []
    for name, tt in runs:
        out += theory_run_lines(name, tt)
    return out, runs[0][1]["pooled_rank_test"]["all"]


def theory_run_lines(name: str, tt: dict) -> list[str]:
    """The report lines of one recorded ``theory_trained`` run: the models left out and the
    theory's rank agreement with the measured accuracy by phase."""
    ms, pooled = tt["models"], tt["pooled_rank_test"]["all"]
    at = tt.get("learned_at", tt["plateau_exit"])
    word = "converged" if at > tt["plateau_exit"] else "left the loss plateau"
    learned = [m for m in ms if model_learned(m)]
    stuck = [f"H={m['heads']} seed {m['seed']}" for m in ms if not model_learned(m)]
    weak_hit = sum(m["weak_observed"] == m["weak_predicted"] for m in learned)
    out = [
        f"- Against trained gated models (d = {tt['profile']['stride']}, H in "
        f"{sorted({m['heads'] for m in ms})}, d_model {tt['profile'].get('d_model', D_MODEL)}, "
        f"d_head {tt['profile'].get('d_head', D_HEAD)}, {len(ms)} models"
        + (
            f"; {', '.join(stuck)} never {word} (accuracy < {at}) and are left out of the test"
            if stuck
            else f"; all {word} (accuracy >= {at})"
        )
        + "): the theory's accuracy from each model's effective pooling weights vs its "
        "measured accuracy by phase (targets beyond the raw window): mean Spearman "
        f"{fmt_num(pooled['mean_spearman'])} over {pooled['n_models']} models, pooled "
        f"permutation p {pooled['p']:.2g}; per H: "
        + ", ".join(
            f"{k} {fmt_num(v['mean_spearman'])} (p {v['p']:.2g}, {v['n_models']} models)"
            if v["n_models"]
            else f"{k} not tested (no model {word})"
            for k, v in tt["pooled_rank_test"].items()
            if k != "all"
        )
        + f"; weakest phase predicted in {weak_hit} of {len(learned)}."
    ]
    for m in ms:
        out.append(
            f"  - H={m['heads']} seed {m['seed']}: accuracy {m['accuracy']:.3f}, heads' "
            f"strongest phases {m['assignment']} (max weights "
            f"{', '.join(f'{x:.2f}' for x in m['max_weight'])}; bias alone at most "
            f"{max(m['bias_max_weight']):.2f}); {m['specialised_heads']} heads specialised, "
            f"serving {m['served_phases']} distinct phases; phases covered by weight "
            f"{m['covered_weight']} / by accuracy {m['covered_accuracy']}; the theory from "
            f"scratch covers {m['theory_covered']} and serves {m['theory_served']}."
        )
    out.append(
        f"  Source `analyses/results/theory_trained_{name}.md` "
        f"(`phasemech run theory_trained --profile {name}`, recorded)."
    )
    return out


__all__ = ["THEORY_PROFILES", "claim_theory", "model_learned", "theory_run_lines", "theory_runs"]
