"""The pretrained sweep's ``summary.md`` and figures
(``accuracy_by_phase.html`` and ``attention_<setting>.html``).

Axes: ``phase`` columns; rows are settings (and heads).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from phasemech.measure.pretrained import Setting, SweepConfig


def write_figures(
    per_phase: pd.DataFrame,
    attention: pd.DataFrame,
    settings: Sequence[Setting],
    stride: int,
    out,
) -> None:
    """``accuracy_by_phase.html`` (one line per setting, 95% bands) and, per setting,
    ``attention_<setting>.html`` (answer step -> needle, head x phase per layer)."""
    from phasemech.viz import head_phase_heatmap, per_phase_accuracy

    series = {s.name: per_phase[per_phase.setting == s.name] for s in settings}
    fig = per_phase_accuracy(series, stride, title="Passkey accuracy by needle phase")
    fig.write_html(out / "accuracy_by_phase.html", include_plotlyjs="directory")
    for s in settings:
        a = attention[attention.setting == s.name]
        if len(a):
            fig = head_phase_heatmap(a, title=f"Answer -> needle attention ({s.name})")
            fig.write_html(out / f"attention_{s.name}.html", include_plotlyjs="directory")


def _f(x, spec: str = ".3f") -> str:
    return "" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def _p(x) -> str:
    return _f(x, ".2g")


def summary_markdown(
    summary: pd.DataFrame, attention: pd.DataFrame, cfg: SweepConfig, profile: str
) -> str:
    """The sweep's ``summary.md``: per setting the statistics, then the heads that attend most
    to the needle from the answer step."""
    t = cfg.task
    lines = [
        f"# Passkey phase sweep on {cfg.model} (profile {profile})",
        "",
        f"{cfg.contents} contents x {t.stride} phases per "
        f"setting (the needle's first digit shifted one token at a time: paired prompts); "
        f"filler {t.context} tokens, depths {list(t.depths)}, {t.digits}-digit codes; scored "
        "teacher-forced (correct = every code token is the argmax). CIs: cluster bootstrap over "
        "contents; p (paired): Cochran's Q; McNemar: smallest Holm-corrected exact p over pairs "
        "of phases.",
        "",
        "| setting | acc | acc by phase [95% CI] | raw gap | debiased gap [95% CI] | p (perm) "
        "| p (logistic) | p (Cochran) | McNemar min p_Holm (pair) | positions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary.itertuples():
        by = " ".join(
            f"{a:.3f} [{lo:.2f}, {hi:.2f}]"
            for a, lo, hi in zip(r.acc_by_phase, r.ci_lo, r.ci_hi, strict=True)
        )
        lines.append(
            f"| {r.setting}: {r.description} | {r.accuracy:.3f} | {by} | {_f(r.raw_gap)} | "
            f"{_f(r.debiased_gap)} [{_f(r.gap_lo)}, {_f(r.gap_hi)}] | {_p(r.p_perm)} | "
            f"{_p(r.p_logistic)} | {_p(r.p_cochran)} | {_p(r.mcnemar_min_p_holm)} "
            f"({r.mcnemar_pair}) | {r.min_pos}-{r.max_pos} |"
        )
    if len(attention):
        lines += [
            "",
            "## Answer-step attention onto the needle, by needle phase",
            "",
            f"Mean over the first {cfg.attention_prompts} prompts of each setting; the five "
            "heads with the largest mean attention, and their range across phases.",
            "",
            "| setting | head | mean | by phase | range |",
            "|---|---|---|---|---|",
        ]
        for s, g in attention.groupby("setting", sort=False):
            wide = g.pivot_table(index=["layer", "head"], columns="phase", values="mass")
            top = wide.mean(axis=1).sort_values(ascending=False).head(5)
            for (layer, head), m in top.items():
                row = wide.loc[(layer, head)]
                lines.append(
                    f"| {s} | L{layer}H{head} | {m:.3f} | "
                    + " ".join(f"{v:.3f}" for v in row)
                    + f" | {row.max() - row.min():.3f} |"
                )
    return "\n".join(lines) + "\n"


__all__ = ["summary_markdown", "write_figures"]
