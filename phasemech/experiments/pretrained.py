"""The post-hoc sweep of the bundled pretrained model as an experiment: profiles of settings,
their tables, figures and summary under ``RUNS/pretrained_<profile>/``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from phasemech.core.config import CompressionConfig
from phasemech.data.passkey import PasskeyTask
from phasemech.measure.pretrained import Setting, SweepConfig, report, run_sweep

_LATE = tuple(range(2, 30))  # SmolLM2-135M: 30 layers; the first two left dense


def _setting(design: str, d: int, w: int, first: int, k: int | None = None) -> Setting:
    name = f"{design}_d{d}_w{w}" + (f"_k{k}" if k is not None else "") + f"_L{first}"
    return Setting(
        name, CompressionConfig(design, stride=d, window=w, top_k=k, layers=tuple(range(first, 30)))
    )


def _profile_settings(name: str) -> list[Setting]:
    null = Setting("null")
    if name in ("tiny", "default"):
        return [null, _setting("route", 4, 32, 2, k=2)]
    if name == "map":  # a quick map: one knob at a time around the default setting
        return [
            null,
            _setting("mean", 4, 32, 2),
            _setting("mean", 4, 32, 16),
            _setting("route", 4, 32, 2, k=1),
            _setting("route", 4, 32, 2, k=4),
            _setting("route", 8, 32, 2, k=2),
            _setting("evict", 4, 32, 2, k=2),
            _setting("evict", 4, 32, 16, k=2),
        ]
    out = [null]
    for first in (2, 16):
        for d in (4, 8):
            out.append(_setting("mean", d, 32, first))
            for design in ("route", "evict"):
                for k in (1, 4):
                    out.append(_setting(design, d, 32, first, k=k))
    return out


PROFILES = {
    "tiny": SweepConfig(contents=2, n_boot=50, n_perm=50, attention_prompts=4),
    "default": SweepConfig(contents=200),
    # stride-8 prompts (balanced for d=4 too), 25 contents x 8 phases per setting
    "map": SweepConfig(task=PasskeyTask(stride=8), contents=25),
    "full": SweepConfig(task=PasskeyTask(stride=8), contents=200),
}


def run_profile(profile: str, runs, workers: int | None = None) -> str:
    """Run a profile, write its tables and ``summary.md`` under ``RUNS/pretrained_<profile>/``;
    returns the summary text."""
    import json
    from pathlib import Path

    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is invalid: expected one of {sorted(PROFILES)}")
    cfg, settings = PROFILES[profile], _profile_settings(profile)
    out = Path(runs) / f"pretrained_{profile}"
    out.mkdir(parents=True, exist_ok=True)
    targets, attention, seconds = run_sweep(settings, cfg, workers)
    stride = cfg.task.stride
    summary, per_phase = report(targets, settings, stride, cfg.n_boot, cfg.n_perm, cfg.seed)
    targets.to_parquet(out / "targets.parquet")
    attention.to_parquet(out / "attention.parquet")
    summary.to_parquet(out / "summary.parquet")
    per_phase.to_parquet(out / "per_phase.parquet")
    write_figures(per_phase, attention, settings, stride, out)
    text = summary_markdown(summary, attention, cfg, seconds, profile)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(
        json.dumps(
            {
                "profile": profile,
                "settings": len(settings),
                "prompts": len(targets),
                "wall_seconds": seconds,
                "workers": workers,
            },
            indent=2,
        )
    )
    return text


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
    summary: pd.DataFrame, attention: pd.DataFrame, cfg: SweepConfig, seconds: float, profile: str
) -> str:
    t = cfg.task
    lines = [
        f"# Passkey phase sweep on {cfg.model} (profile {profile})",
        "",
        f"Wall time {seconds / 60:.1f} min. {cfg.contents} contents x {t.stride} phases per "
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
