"""The real-model part of the claims report's section 3 (different components handle different
phases), from the recorded explanations.

Axes: ``phase``, ``layer``, ``head``; each recorded run is one ``phasemech explain`` summary
(``analyses/results/explain_*.json``: a copy of the run's ``summary.json``).

Per run it states the setting (model, design, grid, regime, context, prompt count), the
design's accuracy by phase beside the null, where the selection loses the needle (recall by
layer band), whether forcing the needle's block restores the weak phase (the oracle: then the
weak spot is the selection), what patching from the strong phase restores, and the heads whose
zero ablation depends on the phase. The verdict's rule is the lab's: a head whose
zero-ablation effect on accuracy differs across phases (Holm p < 0.05, range >= 10 points).
The real model has no ablated dense control, which the verdict says. The oracle's reading
(where the unforced range exceeds 5 points): forcing that leaves a per-phase range of at most 5
points means the weak spot is the selection; at most half the unforced range, most of it;
more, not the selection alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phasemech.experiments.explain_report import _fmt as _f
from phasemech.experiments.explain_report import layer_span

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
        f"answer rows, same budget): {_f(o['accuracy'])} (unforced {_f(o['unforced'])}){share}; "
        f"the per-phase range goes from {before:.2f} to {after:.2f}: {reading}"
    )


def _range(acc: list[float]) -> float:
    return float(max(acc) - min(acc))


def _run_lines(stem: str, s: dict) -> tuple[list[str], int | None]:
    c, f = s["config"], s.get("findings", {})
    head = (
        f"- {s['model']}, `{c['setting']}`, {c['regime']} regime, T = {c['context']}, "
        f"compressed layers {layer_span(c.get('layers'))}, {c['contents']} contents x "
        f"{c['stride']} phases = {s['n_prompts']} prompts "
        f"(`analyses/results/{stem}.json`): accuracy by phase {_f(s['accuracy_by_phase'])} "
        f"(null {_f(s['null_by_phase'])})."
    )
    lines = [head]
    bands = f.get("selection_bands")
    if bands:
        txt = "; ".join(f"layers {b['layers']}: {_f(b['recall_by_phase'])}" for b in bands)
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
    lines.append(
        f"  - Zero ablation: {len(dep)} of {f['n_heads_tested']} heads phase-dependent"
        + (f" ({best})" if best else "")
        + "."
    )
    return lines, len(dep)


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
    hits, tested = [], 0
    for stem, s in runs:
        more, n = _run_lines(stem, s)
        lines += more
        tested += n is not None
        if n:
            hits.append(f"`{s['config']['setting']}` ({s['config']['regime']}, {n} heads)")
    if hits:
        verdict = (
            f"On a real model (rule: {RULE}): **Supported** in {', '.join(hits)}; no dense "
            "control was ablated, so a head's phase dependence may be the base model's."
        )
    elif tested:
        verdict = (
            f"On a real model (rule: {RULE}): **Not supported**: no such head in the {tested} "
            f"of {len(runs)} recorded settings that ablated every head."
        )
    else:
        verdict = f"On a real model (rule: {RULE}): **Open**: no recorded setting ablated heads."
    return lines, verdict


__all__ = ["RULE", "explain_runs", "real_model_lines"]
