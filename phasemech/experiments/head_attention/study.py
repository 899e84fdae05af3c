"""The head-attention experiment as an
:class:`~phasemech.experiments.experiment.Experiment`: one stage of copy-task jobs, and the
finish, which writes its tables, ``summary.json``, ``summary.md`` and the heatmaps into the
experiment folder.

Axes: ``layer, head, phase``; ``seed`` rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.head_attention.jobs import CopyTaskJob, copy_jobs
from phasemech.experiments.head_attention.profiles import PROFILES, VOCAB
from phasemech.experiments.head_attention.summary import (
    accuracy_by_phase,
    summary_markdown,
    tables,
    write_figures,
)


def finish(p: Profile, done: Done, out: Path) -> dict[str, Any]:
    t = tables(done)
    for name, frame in t.items():
        atomic_write(out / f"{name}.parquet", lambda tmp, f=frame: f.to_parquet(tmp))
    stride = p.strides[0]
    figures = write_figures(t["phase_attention_mean"], t["phase_attention_needle"], stride, out)
    acc = t["copy_accuracy"]
    models = [
        {
            "seed": j.seed,
            "copy_accuracy": r["copy_accuracy_all"],
            "copy_accuracy_by_needle_phase": accuracy_by_phase(pd.DataFrame(r["copy_accuracy"])),
            "final_loss": float(np.mean(r["train_loss"]["loss"][-20:])),
            "train_seconds": r["train_seconds"],
        }
        for j, r in done.of(CopyTaskJob)
    ]
    profile = {
        "steps": p.steps, "batch": p.get("batch"), "half": p.get("half"),
        "eval_sequences": p.test_sequences, "seeds": list(p.seeds), "stride": stride,
        "window": 2 * stride, "heads": p.heads[0], "d_model": p.d_model, "vocab": VOCAB,
        "checkpoint_every": p.checkpoint_every,
    }  # fmt: skip
    summary = json_safe(
        {
            "profile": profile,
            "copy_accuracy": float(acc["correct"].sum() / acc["n"].sum()),
            "copy_accuracy_by_needle_phase": accuracy_by_phase(acc),
            "eval_sequences": p.test_sequences,
            "models": models,
            "figures": figures,
        }
    )
    write_json_atomic(out / "summary.json", summary)
    write_text_atomic(out / "summary.md", summary_markdown(t, summary))
    return summary


HEAD_ATTENTION = Experiment(
    name="head_attention",
    profiles=PROFILES,
    stages=(copy_jobs,),
    finish=finish,
    about="attention by source phase and copy accuracy by needle phase of a gated copy model",
)


__all__ = ["HEAD_ATTENTION", "finish"]
