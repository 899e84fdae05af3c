"""The head-attention experiment's job: a
:class:`CopyTaskJob` per seed trains the copy-task model in its own folder (resumable, ending
with the weights an uninterrupted run would have), then measures attention by source phase
(query mean and answer -> needle) and copy accuracy by needle phase.

Axes: ``layer, head, phase`` (source or needle phase on the model's grid).
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from phasemech.core.io import atomic_write, json_safe, write_json_atomic
from phasemech.experiments.experiment import Done, Profile
from phasemech.experiments.head_attention.profiles import LOSS_FILE, MODEL_DIR, STATE_FILE, VOCAB
from phasemech.experiments.jobs import Job, job_device, payload, report_progress

# torch and the model are imported inside the functions that use them: the CLI imports every
# experiment just to list them, and importing torch costs seconds


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


__all__ = [
    "CopyTaskJob",
    "build_model",
    "copy_batch",
    "copy_jobs",
    "copy_loss",
    "measure",
    "train_copy_model",
]
