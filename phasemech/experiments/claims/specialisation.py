"""The claims report's section 3: phase specialisation under interventions (different
components handle different source phases).

Axes: ``phase``, ``layer``, ``head``; rows are models (trained from scratch) or recorded
explanation runs (a real model).

From scratch: the figures run's model panels (each compressed model's most phase-specific
head), the theory comparison's gated models (:mod:`phasemech.experiments.claims.theory`) and,
where recorded, the converged interventions runs (``interventions_<profile>.json``), judged by
:func:`~phasemech.experiments.claims.converged.interventions_claim_lines`.

On a real model, from the recorded explanations (each one ``phasemech explain`` summary,
``analyses/results/explain_*.json``: a copy of the run's ``summary.json``). Per run it states
the setting (model, design, grid, regime, context, prompt count), the design's accuracy by
phase beside the null, where the selection loses the needle (recall by layer band), whether
forcing the needle's block restores the weak phase (the oracle: then the weak spot is the
selection), what patching from the strong phase restores, and the heads whose zero ablation
depends on the phase. The verdict's rule is the lab's: a head whose
zero-ablation effect on accuracy differs across phases (Holm p < 0.05, range >= 10 points).
The real model has no ablated dense control, which the verdict says. Its verdict
(:func:`real_model_verdict`) separates what the evidence can say: the paper's claim is about
components trained under the compression, and no head of a real model compressed post hoc was,
so the claim is *not testable post hoc*; what the post-hoc head test itself says is, per run,
*not testable with this test* where its smallest attainable Holm p (:func:`head_test_floor`:
the recorded ``p_holm_floor`` where a run states one, else the family size times
``1 / (n_perm + 1)``) is not below :data:`~phasemech.experiments.claims.sources.ALPHA`, *not
supported* where it could reject and found no head, *supported post hoc* where it found one.
The oracle's reading
(where the unforced range exceeds 5 points): forcing that leaves a per-phase range of at most 5
points means the weak spot is the selection; at most half the unforced range, most of it;
more, not the selection alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phasemech.experiments.claims.converged import D_MODEL, interventions_claim_lines
from phasemech.experiments.claims.sources import (
    ALPHA,
    Sources,
    f3,
    figure_line,
    figures_run_note,
    holm_floor,
    load_json,
    not_measured,
)
from phasemech.experiments.claims.theory import model_learned, theory_runs
from phasemech.experiments.explain.config import ExplainConfig
from phasemech.experiments.explain.text import layer_span, phases_text

#: the ablations explain's head test holds in one Holm family: every head under zero and under
#: mean ablation (``explain.tables.ablation_tables`` tests both in one ``specialization`` call)
HEAD_TEST_FORMS = ("zero", "mean")
RULE = "a head whose zero-ablation effect on accuracy differs across phases (Holm p < 0.05, range >= 10 points)"  # noqa: E501


def explain_runs(results: Path) -> list[tuple[str, dict[str, Any]]]:
    return [(p.stem, json.loads(p.read_text())) for p in sorted(results.glob("explain_*.json"))]


def _oracle(f: dict) -> str | None:
    rows = {(o["scope"], o["form"], o["rows"]): o for o in f.get("oracle", [])}
    o = rows.get(("all", "replace", "answer"))
    if o is None:
        return None
    sink = o.get("displaced_sink")
    share = f"; {sink:.0%} of the displaced picks were the sink's block" if sink else ""
    if o.get("lost") is not None:  # runs recorded before the column existed lack it
        share += f"; it lost {o['lost']} of the design's right answers"
    before, after = _range(o["unforced"]), _range(o["accuracy"])
    reading = (
        "no gap to read" if before <= 0.05
        else "the weak spot is the selection" if after <= 0.05
        else "the selection is most of the weak spot" if after <= before / 2
        else "the weak spot is not the selection alone"
    )  # fmt: skip
    return (
        f"forcing the needle's block in place of the lowest pick (every selecting layer, "
        f"answer rows, same budget): {phases_text(o['accuracy'])} "
        f"(unforced {phases_text(o['unforced'])}){share}; "
        f"the per-phase range goes from {before:.2f} to {after:.2f}: {reading}"
    )


def _range(acc: list[float]) -> float:
    return float(max(acc) - min(acc))


def explain_run_lines(stem: str, s: dict) -> tuple[list[str], int | None]:
    """The report lines of one recorded explain run (``analyses/results/{stem}.json``)
    and its count of phase-dependent heads (``None``: the run had no ablation step)."""
    c, f = s["config"], s.get("findings", {})
    head = (
        f"- {s['model']}, `{c['setting']}`, {c['regime']} regime, T = {c['context']}, "
        f"compressed layers {layer_span(c.get('layers'))}, {c['contents']} contents x "
        f"{c['stride']} phases = {s['n_prompts']} prompts "
        f"(`analyses/results/{stem}.json`): accuracy by phase "
        f"{phases_text(s['accuracy_by_phase'])} "
        f"(null {phases_text(s['null_by_phase'])})."
    )
    lines = [head]
    bands = f.get("selection_bands")
    if bands:
        txt = "; ".join(f"layers {b['layers']}: {phases_text(b['recall_by_phase'])}" for b in bands)
        lines.append(f"  - Selection recall of the needle's block at the answer row: {txt}.")
    orc = _oracle(f)
    if orc:
        lines.append(f"  - Oracle: {orc}.")
    cp = s.get("contrast_phases") or [None, None]
    if f.get("top_patching"):
        tops = ", ".join(
            f"L{h['layer']}H{h['head']} {h['effect']:.2f}" for h in f["top_patching"][:5]
        )
        sel = [x for x in f.get("selection_patching", []) if x["layer"] == -1]
        every = f"; every layer's selection: {sel[0]['effect']:.2f}" if sel else ""
        lines.append(
            f"  - Patching phase {cp[0]} into phase {cp[1]} ({s['n_pairs']} pairs), normalised "
            f"effect (1 = restored): top heads {tops}{every}."
        )
    elif f.get("top_patching") == [] and s.get("n_pairs"):  # patched, but nothing to rank
        lines.append(
            f"  - Patching phase {cp[0]} into phase {cp[1]} ({s['n_pairs']} pairs): the clean "
            "phase's logit difference is not above the corrupted one's, so no effect is "
            "normalised and no head is ranked."
        )
    dep = f.get("phase_dependent_heads")
    if dep is None:  # a run without the ablation step cannot count for or against the claim
        lines.append("  - Zero ablation: not run in this setting.")
        return lines, None
    best = ", ".join(f"L{h['layer']}H{h['unit']} serves phase {h['served_phase']}"
                     for h in dep[:5])  # fmt: skip
    floor, m, n_perm = head_test_floor(s)
    family = (
        f"{m}/{n_perm + 1} = {floor:.3g} ({m} tests: {f['n_heads_tested']} heads x "
        f"{' and '.join(HEAD_TEST_FORMS)} ablation, {n_perm} permutations each)"
        if m is not None
        else f"{floor:.3g} (recorded)"
    )
    can = "below" if floor < ALPHA else "not below"
    lines.append(
        f"  - Zero ablation: {len(dep)} of {f['n_heads_tested']} heads phase-dependent"
        + (f" ({best})" if best else "")
        + f"; the smallest Holm p this test can reach is {family}, {can} {ALPHA}."
    )
    return lines, len(dep)


def head_test_floor(s: dict) -> tuple[float, int | None, int]:
    """The smallest Holm p one recorded explain run's head test can reach, its family size
    (None where the run records the floor itself) and its permutations: the run's
    ``p_holm_floor`` (explain's findings) where it states one, else (heads tested x
    :data:`HEAD_TEST_FORMS`) / (n_perm + 1)."""
    f = s.get("findings", {})
    # the run's permutations; a recording without them ran at the config's default
    n_perm = int(f.get("n_perm", s["config"].get("n_perm", ExplainConfig.n_perm)))
    if f.get("p_holm_floor") is not None:
        return float(f["p_holm_floor"]), f.get("n_tests"), n_perm
    m = int(f.get("n_tests") or f["n_heads_tested"] * len(HEAD_TEST_FORMS))
    return holm_floor(m, n_perm), m, n_perm


def run_reading(n_dependent: int | None, floor: float) -> str:
    """What one run's post-hoc head test can say: ``not run``, ``supported`` (a head found),
    ``not testable`` (its smallest attainable Holm p is not below ALPHA), ``not supported``."""
    if n_dependent is None:
        return "not run"
    if n_dependent:
        return "supported"
    return "not testable" if floor >= ALPHA else "not supported"


def real_model_verdict(model: str, runs: list[tuple[str, str, float]]) -> str:
    """The real-model verdict from each run's ``(setting (regime), reading, floor)``
    (:func:`run_reading`), by the module's rule."""
    lead = (
        f"**Not testable post hoc**: no head of {model} was trained under the compression, so "
        "a head test of the model compressed post hoc cannot speak for a model trained with it"
    )
    tested = [r for r in runs if r[1] != "not run"]
    if not tested:
        return f"{lead}; and no recorded setting ablated heads"
    parts = []
    for reading, words in (
        ("supported", "**supported post hoc** (no dense control ablated, so it may be the base "
                      "model's) in"),
        ("not supported", "**not supported** post hoc (the test could reject and found no head) "
                          "in"),
        ("not testable", "**not testable with this test** (its smallest attainable Holm p is "
                         f"not below {ALPHA}, so no head could reach significance) in"),
    ):  # fmt: skip
        hits = [r for r in tested if r[1] == reading]
        if hits:
            where = ", ".join(f"{name} (floor {floor:.3g})" for name, _, floor in hits)
            parts.append(f"{words} {len(hits)} of the {len(tested)} settings that ablated every "
                         f"head (of {len(runs)} recorded): {where}")  # fmt: skip
    return f"{lead}. What the post-hoc head test says: " + "; ".join(parts)


def real_model_lines(results: Path) -> tuple[list[str], str]:
    """The section's real-model lines and verdict sentence."""
    runs = explain_runs(results)
    if not runs:
        cmd = "phasemech explain --design route --top-k 1 --layers 2-29 -o DIR"
        return (
            [
                f"- On a real model: *not measured yet*: no `analyses/results/explain_*.json`; "
                f"run `{cmd}` and copy its `summary.json`."
            ],  # fmt: skip
            "On a real model: **Open**.",
        )
    lines = ["On a real model (`phasemech explain`, the audit's paired prompts):", ""]
    readings = []
    for stem, s in runs:
        more, n = explain_run_lines(stem, s)
        lines += more
        floor = head_test_floor(s)[0] if n is not None else 1.0
        name = f"`{s['config']['setting']}` ({s['config']['regime']})"
        readings.append((name, run_reading(n, floor), floor))
    rule = (
        f"{RULE}; a head of a model compressed post hoc cannot stand for one trained under the "
        f"compression; a test whose smallest attainable Holm p is not below {ALPHA} cannot reject"
    )
    verdict = real_model_verdict(runs[0][1]["model"], readings)
    return lines, f"On a real model (rule: {rule}): {verdict}."


# interventions.py's converged profiles (the converged sweeps' models, d = 4 and d = 8 at
# d_model 64 and 128)
INTERVENTION_PROFILES = ("converged", "converged_d8", "converged_d8_wide")


def converged_interventions(src: Sources) -> tuple[str, list[str], str] | None:
    """The header, lines and verdict of the specialisation claim over every recorded
    converged interventions run (None where none is recorded)."""
    found = [
        (n, s)
        for n in INTERVENTION_PROFILES
        if (s := load_json(src.results / f"interventions_{n}.json")) is not None
    ]
    if not found:
        return None
    files = ", ".join(
        f"`analyses/results/interventions_{n}.json` (`phasemech run interventions --profile {n}`)"
        for n, _ in found
    )
    at = found[0][1]["profile"]["pool_min_accuracy"]
    # each model with its run's width (recordings made before they stated one: the default)
    merged = {
        "models": [
            {"d_model": s["profile"].get("d_model", D_MODEL), **m}
            for _, s in found
            for m in s.get("models", [])
        ]
    }
    lines, verdict = interventions_claim_lines(merged, files)
    header = (
        f"On the converged phase sweeps' models (the first seed of each setting with held-out "
        f"accuracy >= {at}; {files}; the verdict reads these):"
    )
    return header, lines, verdict


def _panel_lines(src: Sources) -> tuple[list[str], int]:
    """The ``make figures`` run's compressed models: each one's most phase-dependent head, and
    how many have one with Holm p < 0.05."""
    out: list[str] = []
    sig = 0
    if src.panels is None:
        out.append(
            "- The `make figures` run's model panels are not listed. " + figures_run_note(src)
        )
    for p in src.panels or []:
        comp = [h for h in p["heads"] if h["compressed"]]
        if not comp:
            continue
        best = max(
            comp,
            key=lambda h: (
                h.get("p_holm") is not None and h["p_holm"] < 0.05,
                h.get("effect_range") or 0.0,
            ),
        )
        ok = best.get("p_holm") is not None and best["p_holm"] < 0.05
        sig += ok
        eff = " / ".join(f3(x) for x in best["effect"])
        out.append(
            f"- {p['name']}: head {best['label']} zero-ablation effect on accuracy by phase "
            f"{eff}; specialisation index {f3(best['si'])}, Holm p {best['p_holm']}"
            + (
                f", serves phase {best['served_phase']}"
                if best.get("served_phase") is not None
                else ""
            )
            + "."
        )
    if src.panels is not None:
        out.append(f"  (`{src.command}`: model panels.) {figures_run_note(src)}")
    return out, sig


def claim_specialisation(src: Sources) -> str:
    out = ["## 3. Phase specialisation under interventions", ""]
    out.append(
        "*Paper*: activation patching and ablation show different components handle different "
        "source phases."
    )
    out.append("")
    panel, sig = _panel_lines(src)
    out += panel
    name, tt = (theory_runs(src.results) or [(None, None)])[0]
    learned = [m for m in tt["models"] if model_learned(m)] if tt else []
    if learned:
        spec = sum(m["specialised_heads"] for m in learned)
        heads = sum(m["heads"] for m in learned)
        served = ", ".join(f"{m['served_phases']}" for m in learned)
        out.append(
            f"- Gated models of the theory comparison ({len(learned)} of {len(tt['models'])} "
            f"learned, accuracy >= {tt.get('learned_at', tt['plateau_exit'])}): {spec} of "
            f"their {heads} heads put at least half of their pooled entry on targets of one "
            f"phase; distinct phases served per model: {served} "
            f"(`analyses/results/theory_trained_{name}.md`)."
        )
    n = sum(1 for p in src.panels or [] if any(h["compressed"] for h in p["heads"]))
    verdict = (
        f"**Supported**: {sig} of {n} compressed models have a head whose ablation effect "
        "depends on the phase (Holm-corrected p < 0.05)"
        if sig
        else f"**Not supported** in this run: none of {n} compressed models has a head with "
        "Holm-corrected p < 0.05"
    )
    rule = "some compressed head's ablation effect differs across phases, Holm p < 0.05"
    conv = converged_interventions(src)
    if conv is not None:
        header, lines, verdict = conv
        out += ["", header, "", *lines]
        rule = (
            "at a given d, a larger share of converged compressed models than of that d's "
            "dense controls has a head whose zero-ablation effect differs across phases "
            "(Holm p < 0.05, range >= 10 points)"
        )
    else:
        cmd = "phasemech run interventions --profile converged"
        out.append("- " + not_measured("analyses/results/interventions_converged.json", cmd))
    real, real_verdict = real_model_lines(src.results)
    out += [
        "",
        f"Verdict (rule: {rule}): " + verdict + ".",
        "",
        *real,
        "",
        real_verdict,
        "",
        figure_line(
            src, "ablation_effects", "patching_grid", "specialization", "head_phase_attention"
        ),
    ]
    return "\n".join(out)


__all__ = [
    "INTERVENTION_PROFILES",
    "RULE",
    "claim_specialisation",
    "converged_interventions",
    "explain_run_lines",
    "HEAD_TEST_FORMS",
    "explain_runs",
    "head_test_floor",
    "real_model_lines",
    "real_model_verdict",
    "run_reading",
]
