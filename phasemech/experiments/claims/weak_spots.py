"""The claims report's section 1: periodic weak spots (the same fact is
easy at one phase and hard at another, up to :data:`CLAIM_GAP_PP` points).

Axes: ``phase``; rows are models and settings.
"""

from __future__ import annotations

from phasemech.experiments.claims.sources import (
    Sources,
    figure_line,
    load_json,
    model_rows,
    not_measured,
    pp,
)

CLAIM_GAP_PP = 40  # the paper: "accuracy swings by up to 40 percentage points across phases"


def claim_weak_spots(src: Sources) -> str:
    out = ["## 1. Periodic weak spots", ""]
    out.append(
        f"*Paper*: the same fact is easy at one phase and hard at another; up to {CLAIM_GAP_PP} "
        "pp across phases in large models; averages and random-offset needle tests hide it."
    )
    out.append("")
    best_gap, where = -1.0, ""
    pre = load_json(src.results / "pretrained_default.json")
    pre_map = load_json(src.results / "pretrained_map.json")
    if pre is not None:
        for r in [r for r in pre["rows"] if r["setting"].startswith("route")]:
            g, lo, hi, by = r["debiased_gap"], r["gap_lo"], r["gap_hi"], r["acc_by_phase"]
            out.append(
                f"- SmolLM2-135M, post-hoc `{r['setting']}` (passkey, paired prompts): mean "
                f"accuracy {r['accuracy']:.3f} (what an averaged or random-offset test "
                f"reports), by phase {' / '.join(f'{x:.3f}' for x in by)}: weakest "
                f"{min(by):.3f}; debiased gap {pp(g)} [{pp(lo)}, {pp(hi)}], Cochran p "
                f"{r['p_cochran']:.2g}. Source `analyses/results/pretrained_default.json` "
                "(`make pretrained`)."
            )
            if g > best_gap:
                best_gap, where = g, f"SmolLM2 {r['setting']}"
    else:
        out.append(
            "- " + not_measured("analyses/results/pretrained_default.json", "make pretrained")
        )
    if pre_map is not None:
        rows = [r for r in pre_map["rows"] if r["setting"] != "null"]
        top = max(rows, key=lambda r: r["debiased_gap"])
        g, lo, hi, by = top["debiased_gap"], top["gap_lo"], top["gap_hi"], top["acc_by_phase"]
        out.append(
            f"- The same model, one compression knob at a time: largest gap with "
            f"`{top['setting']}`: by phase {' / '.join(f'{x:.2f}' for x in by)}, debiased gap "
            f"{pp(g)} [{pp(lo)}, {pp(hi)}] (`analyses/results/pretrained_map.json`, profile "
            "`map` of the pretrained sweep)."
        )
        if g > best_gap:
            best_gap, where = g, f"SmolLM2 {top['setting']}"
    models = model_rows(src)
    top = models.iloc[0]
    out.append(
        f"- From scratch (this `make figures` run): {top['model']} has mean accuracy "
        f"{top['accuracy']:.3f} but {top['weak_accuracy']:.3f} at phase {top['weak_phase']}; "
        f"debiased gap {pp(top['gap'])} [{pp(top['lo'])}, {pp(top['hi'])}]."
    )
    if top["gap"] > best_gap:
        best_gap, where = float(top["gap"]), top["model"]
    verdict = (
        f"**Supported**: the largest measured gap is {pp(best_gap)} ({where}), at least the "
        f"paper's {CLAIM_GAP_PP} pp."
        if 100 * best_gap >= CLAIM_GAP_PP
        else f"**Partly supported**: weak spots are real, but the largest measured gap is "
        f"{pp(best_gap)} ({where}), below the paper's {CLAIM_GAP_PP} pp."
    )
    out += ["", "Verdict (rule: largest debiased gap >= the paper's figure): " + verdict]
    out += ["", figure_line(src, "accuracy_by_phase_d8", "accuracy_by_phase_d4")]
    return "\n".join(out)


__all__ = ["CLAIM_GAP_PP", "claim_weak_spots"]
