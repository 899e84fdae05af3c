"""Head-by-source-phase attention of a small compressed model trained on a copy task, as an
experiment (it replaces the standalone script ``analyses/head_phase_attention.py``).

The model: a 2-layer attention-only ``PhaseTransformer`` whose layers both use ``gated``
compression (stride d = 4, raw window 2d = 8, 4 heads), trained on a repeated-random-sequence
task: tokens ``x_0..x_{P-1}`` followed by the same ``P`` tokens. Predicting the second copy
needs the token after the previous occurrence, ``P`` positions back: far outside the raw window,
so it must be read through compressed blocks.

One stage: a :class:`CopyTaskJob` per seed trains the model in its own folder (resumable: a
checkpoint holds the weights, the optimizer, the schedule and the batch generator, so a resumed
run ends with the weights an uninterrupted one would have), then measures the attention mass per
(layer, head, source phase), averaged over the second copy's queries and from each answer
position onto its needle (the source token, ``P - 1`` back), and the copy accuracy by needle
phase. The finish writes ``phase_attention_mean.parquet``, ``phase_attention_needle.parquet``,
``copy_accuracy.parquet``, ``train_loss.parquet``, ``summary.json``, ``summary.md`` and the two
heatmaps ``head_phase_attention.html`` (query mean) and ``head_phase_needle.html`` (answer ->
needle) into the experiment folder.

Axes: ``layer, head, phase`` (source or needle phase on the model's grid); ``seed`` rows.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic, write_text_atomic
from phasemech.experiments.experiment import Done, Experiment, Profile
from phasemech.experiments.jobs import Job, job_device, payload, report_progress

# torch and the model are imported inside the functions that use them: the CLI imports every
# experiment just to list them, and importing torch costs seconds

# one model for every profile (the old script's); the profiles differ in training and
# evaluation sizes only. `half` is P, the length of the random sequence that is then repeated.
_MODEL = dict(designs=("gated",), strides=(4,), heads=(4,), d_model=64)
PROFILES = {
    # seconds; the end-to-end test
    "tiny": Profile(
        steps=20, test_sequences=32, checkpoint_every=None,
        extra=(("batch", 16), ("half", 16)), **_MODEL,
    ),
    # 128 s of training on one thread of a shared 2-core machine (146 s in all)
    "default": Profile(
        steps=1200, test_sequences=256, checkpoint_every=400,
        extra=(("batch", 32), ("half", 32)), **_MODEL,
    ),
    "full": Profile(
        steps=4000, test_sequences=2048, checkpoint_every=1000,
        extra=(("batch", 64), ("half", 32)), **_MODEL,
    ),
}  # fmt: skip

VOCAB = 64
MODEL_DIR = "model"  # the trained model (PhaseTransformer.save), read by phasemech's CLI
STATE_FILE = "train_state.pt"  # the latest checkpoint of an unfinished training
LOSS_FILE = "train_loss.json"
#: the result's tables, each written as ``<name>.parquet`` with a ``seed`` column
TABLES = ("phase_attention_mean", "phase_attention_needle", "copy_accuracy", "train_loss")


@dataclass(frozen=True)
class CopyTaskJob(Job):
    """Train the copy-task model (``workdir/model``), then measure it: attention by source
    phase (query mean and answer -> needle), copy accuracy by needle phase, the loss curve."""

    kind: ClassVar[str] = "copy_task_attention"
    steps: int
    batch: int
    half: int
    eval_sequences: int
    seed: int = 0
    stride: int = 4
    heads: int = 4
    d_model: int = 64
    vocab: int = VOCAB
    # a resumed run ends as an uninterrupted one: how often it checkpoints is not in the key
    checkpoint_every: int | None = payload(default=None)

    @property
    def label(self) -> str:
        return f"copy gated d={self.stride} s{self.seed}"

    def run(self, workdir: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        model, losses = train_copy_model(self, workdir)
        seconds = time.perf_counter() - t0
        tables = measure(model, self)
        curve = {"step": list(range(1, len(losses) + 1)), "loss": losses}
        return json_safe({**tables, "train_loss": curve, "train_seconds": seconds})


# ------------------------------------------------------------------------------ train


def copy_batch(gen, batch: int, half: int, vocab: int = VOCAB):
    """``[batch, 2*half]``: random tokens, then the same tokens again."""
    import torch

    first = torch.randint(0, vocab, (batch, half), generator=gen)
    return torch.cat([first, first], dim=1)


def build_model(job: CopyTaskJob):
    from phasemech.core.config import CompressionConfig, PhaseTransformerConfig
    from phasemech.model.transformer import PhaseTransformer

    cfg = PhaseTransformerConfig(
        n_layers=2,
        d_model=job.d_model,
        n_heads=job.heads,
        d_head=job.d_model // job.heads,
        n_ctx=2 * job.half,
        d_vocab=job.vocab,
        attn_only=True,
        act_fn=None,
        normalization_type="LN",
        seed=job.seed,
        compression=CompressionConfig("gated", stride=job.stride, window=2 * job.stride),
        device="cpu",  # initialised on the CPU everywhere; the job moves it to its device
    )
    return PhaseTransformer(cfg)


def copy_loss(model, tokens, half: int, vocab: int = VOCAB):
    """Next-token loss on the predictable part (second copy) only."""
    import torch

    logits = model(tokens)
    pred = logits[:, half - 1 : -1]
    return torch.nn.functional.cross_entropy(pred.reshape(-1, vocab), tokens[:, half:].reshape(-1))


def train_copy_model(job: CopyTaskJob, workdir: Path):
    """``(model, losses)``: the trained model of ``workdir/model`` if it is there, else trained
    (from the last checkpoint in ``workdir`` if any) and saved there."""
    import torch

    from phasemech.core.device import move
    from phasemech.model.transformer import PhaseTransformer

    dev = job_device()
    final = workdir / MODEL_DIR
    if (final / "model.safetensors").is_file() and (workdir / LOSS_FILE).is_file():
        losses = json.loads((workdir / LOSS_FILE).read_text())
        return move(PhaseTransformer.load(final), dev).eval(), losses
    torch.manual_seed(job.seed)
    model = move(build_model(job), dev)
    gen = torch.Generator().manual_seed(job.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=1e-3, total_steps=job.steps, pct_start=0.1
    )
    workdir.mkdir(parents=True, exist_ok=True)  # the launcher makes it; a direct call may not
    state = workdir / STATE_FILE
    losses = _restore(state, model, opt, sched, gen)
    model.train()
    for step in range(len(losses), job.steps):
        # drawn on the CPU generator: the same batches on any device
        tokens = copy_batch(gen, job.batch, job.half, job.vocab).to(dev)
        loss = copy_loss(model, tokens, job.half, job.vocab)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        report_progress(step + 1, job.steps)
        every = job.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < job.steps:
            _checkpoint(state, model, opt, sched, gen, losses)
    model.eval()
    # the losses first: a folder with the model but no losses is trained again, never half-read
    write_json_atomic(workdir / LOSS_FILE, losses)
    model.save(final)
    state.unlink(missing_ok=True)
    return model, losses


def _checkpoint(path: Path, model, opt, sched, gen, losses: list[float]) -> None:
    """Everything a resumed run needs to continue as if never stopped: the batch generator and
    torch's global RNG included (the next batches must be the ones the old loop would draw)."""
    import torch

    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "generator": gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "losses": list(losses),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def _restore(path: Path, model, opt, sched, gen) -> list[float]:
    """The losses so far (empty without a checkpoint); the state restored in place."""
    import torch

    if not path.is_file():
        return []
    state = torch.load(path, weights_only=True, map_location="cpu")  # copied onto the model
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    gen.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    return list(state["losses"])


# ------------------------------------------------------------------------------ measure


def measure(model, job: CopyTaskJob) -> dict[str, Any]:
    """Attention mass by source phase (query mean, answer -> needle) and copy accuracy by
    needle phase on ``eval_sequences`` fresh copy sequences, as column dicts."""
    import torch

    from phasemech.core.device import model_device
    from phasemech.core.grid import phase_of
    from phasemech.model.phase import phase_attention

    half, stride = job.half, job.stride
    gen = torch.Generator().manual_seed(10_000 + job.seed)  # disjoint from the training seed
    tokens = copy_batch(gen, job.eval_sequences, half, job.vocab)
    # queries of the second copy only: early queries see few tokens and favour phase 0
    mean_pa = phase_attention(model, tokens, query_pos=list(range(half, 2 * half)))
    # answer -> needle: query at P + i predicts token i + 1, which sits at source i + 1
    i = torch.arange(0, half - 1)
    query = (half + i).expand(len(tokens), -1)
    needle = (i + 1).expand(len(tokens), -1)
    pair_pa = phase_attention(model, tokens, query_pos=query, key_pos=needle)
    with torch.no_grad():
        logits = model(tokens.to(model_device(model))).cpu()
    correct = logits[:, half + i].argmax(-1) == tokens[:, i + 1]
    phases = phase_of(i + 1, stride)
    rows = [
        {
            "phase": p,
            "accuracy": float(correct[:, phases == p].float().mean()),
            "correct": int(correct[:, phases == p].sum()),
            "n": int(correct[:, phases == p].numel()),
        }
        for p in range(stride)
    ]
    return {
        "phase_attention_mean": mean_pa.frame.to_dict(orient="list"),
        "phase_attention_needle": pair_pa.frame.to_dict(orient="list"),
        "copy_accuracy": pd.DataFrame(rows).to_dict(orient="list"),
        "copy_accuracy_all": float(correct.float().mean()),
    }


# ------------------------------------------------------------------------------ experiment


def copy_jobs(p: Profile, done: Done | None = None) -> list[CopyTaskJob]:
    return [
        CopyTaskJob(
            steps=p.steps,
            batch=p.get("batch"),
            half=p.get("half"),
            eval_sequences=p.test_sequences,
            seed=s,
            stride=p.strides[0],
            heads=p.heads[0],
            d_model=p.d_model,
            checkpoint_every=p.checkpoint_every,
        )
        for s in p.seeds
    ]


def tables(done: Done) -> dict[str, pd.DataFrame]:
    """Every table of :data:`TABLES` over the seeds (a ``seed`` column)."""
    runs = done.of(CopyTaskJob)
    return {
        name: pd.concat(
            [pd.DataFrame(r[name]).assign(seed=j.seed) for j, r in runs], ignore_index=True
        )
        for name in TABLES
    }


def over_seeds(frame: pd.DataFrame) -> pd.DataFrame:
    """A phase-attention table averaged over seeds (``n`` summed): one heatmap cell per
    (layer, head, phase), as ``head_phase_heatmap`` expects; one seed is left as it is."""
    keys = ["layer", "head", "phase", "exact", "kind"]
    return frame.groupby(keys, as_index=False).agg(mass=("mass", "mean"), n=("n", "sum"))


def write_figures(mean: pd.DataFrame, needle: pd.DataFrame, stride: int, out: Path) -> list[str]:
    """The old script's two heatmaps, self-contained HTML, into the experiment folder (not
    ``figures/``, where a ``make figures`` figure has the first one's name)."""
    from phasemech.viz import head_phase_heatmap

    names = {layer: f"layer {layer} (gated, d={stride})" for layer in sorted(mean["layer"])}
    figures = {
        "head_phase_attention.html": (mean, "Attention mass by source phase, mean over queries"),
        "head_phase_needle.html": (needle, "Attention from answer to needle, by needle phase"),
    }
    for name, (frame, title) in figures.items():
        fig = head_phase_heatmap(over_seeds(frame), title=title, layer_names=names)
        atomic_write(out / name, lambda tmp, fig=fig: fig.write_html(tmp, include_plotlyjs=True))
    return list(figures)


def _accuracy_by_phase(acc: pd.DataFrame) -> dict[int, float]:
    """Copy accuracy per needle phase, pooled over seeds (correct / n)."""
    pooled = acc.groupby("phase")[["correct", "n"]].sum()
    return {int(p): float(r.correct / r.n) for p, r in pooled.iterrows()}


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
            "copy_accuracy_by_needle_phase": _accuracy_by_phase(pd.DataFrame(r["copy_accuracy"])),
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
            "copy_accuracy_by_needle_phase": _accuracy_by_phase(acc),
            "eval_sequences": p.test_sequences,
            "models": models,
            "figures": figures,
        }
    )
    write_json_atomic(out / "summary.json", summary)
    write_text_atomic(out / "summary.md", summary_markdown(t, summary))
    return summary


def _wide(frame: pd.DataFrame) -> list[str]:
    """A phase-attention table as markdown: rows ``L{layer}H{head}``, columns phases."""
    wide = over_seeds(frame).pivot_table(
        index=["layer", "head"], columns="phase", values="mass", sort=True, dropna=False
    )
    lines = [
        "| head | " + " | ".join(f"phase {c}" for c in wide.columns) + " |",
        "|---|" + "---|" * len(wide.columns),
    ]
    for (layer, head), row in wide.iterrows():
        cells = " | ".join("" if np.isnan(v) else f"{v:.3f}" for v in row)
        lines.append(f"| L{layer}H{head} | {cells} |")
    return lines


def summary_markdown(t: dict[str, pd.DataFrame], summary: dict[str, Any]) -> str:
    """``summary.md``: copy accuracy by needle phase, then both attention tables."""
    pr = summary["profile"]
    by_phase = summary["copy_accuracy_by_needle_phase"]
    lines = [
        f"# Head attention by source phase: copy task, gated d = {pr['stride']}",
        "",
        f"2-layer attention-only model, both layers gated (d = {pr['stride']}, W = "
        f"{pr['window']}, {pr['heads']} heads), trained {pr['steps']} steps (batch "
        f"{pr['batch']}) on a random sequence of P = {pr['half']} tokens repeated once; "
        f"measured on {pr['eval_sequences']} fresh sequences, seeds {pr['seeds']} (tables: "
        "mean over seeds).",
        "",
        f"Copy accuracy {summary['copy_accuracy']:.3f}; by needle phase: "
        + ", ".join(f"{p}: {a:.3f}" for p, a in by_phase.items())
        + "; final training loss (mean of the last 20 steps): "
        + ", ".join(f"seed {m['seed']}: {m['final_loss']:.3f}" for m in summary["models"]),
        "",
        "## Attention mass by source phase, mean over the second copy's queries",
        "",
        "Each row sums to 1; 1/d is no phase preference.",
        "",
        *_wide(t["phase_attention_mean"]),
        "",
        "## Attention from answer to needle, by needle phase",
        "",
        *_wide(t["phase_attention_needle"]),
        "",
        f"Figures: {', '.join(summary['figures'])}.",
    ]
    return "\n".join(lines) + "\n"


HEAD_ATTENTION = Experiment(
    name="head_attention",
    profiles=PROFILES,
    stages=(copy_jobs,),
    finish=finish,
    about="attention by source phase and copy accuracy by needle phase of a gated copy model",
)

__all__ = ["HEAD_ATTENTION", "PROFILES", "CopyTaskJob", "copy_batch", "train_copy_model"]
