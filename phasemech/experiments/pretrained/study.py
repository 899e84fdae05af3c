"""The pretrained sweep as an
:class:`~phasemech.experiments.experiment.Experiment`: one stage of :class:`PasskeyJob`, then
the finish: per setting the statistics template, Cochran's Q and Holm-corrected McNemar tests
over the paired prompts (:func:`phasemech.measure.pretrained.report`) and the per-head
attention onto the needle by phase, written under ``RUNS/pretrained_<profile>/``.

Axes: ``layer, head, phase``; prompts are rows of tidy frames.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.pretrained.jobs import PasskeyJob, passkey_jobs
from phasemech.experiments.pretrained.profiles import PROFILES, profile_settings
from phasemech.experiments.pretrained.summary import summary_markdown, write_figures
from phasemech.measure.pretrained import report


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    """Tables, figures and summary of the sweep under ``out``."""
    cfg, settings = p.get("sweep"), profile_settings(p.get("settings"))
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


PRETRAINED = Experiment(
    name="pretrained",
    profiles=PROFILES,
    stages=(passkey_jobs,),
    finish=finish,
    about="SmolLM2-135M passkey retrieval by needle phase, post-hoc compressed",
)


__all__ = ["PRETRAINED", "finish"]
