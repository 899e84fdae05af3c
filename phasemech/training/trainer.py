"""Training from scratch on a retrieval task, with resumable atomic checkpoints.

A run folder's layout and its checkpoints: :mod:`phasemech.training.checkpoints`. Training data is a
pure function of ``(seed, step)`` (:func:`phasemech.data.tasks.training_batch`; the prefix
curriculum's spread is itself a function of the step) and the learning
rate a pure function of the step, so a run interrupted anywhere and resumed from its last checkpoint
ends with the same weights as one that never stopped.

Loss and accuracy are taken only at answer positions (Zoology's MQAR convention). The held-out
set is phase-balanced and seeded independently of the model (``eval_seed``), so every model of a
sweep is scored on the same sequences.

Axis names: ``batch`` (sequences), ``pos`` (token positions), ``target`` (answers per sequence,
see :mod:`phasemech.data.tasks`), ``vocab``, ``phase``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Int
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch import Tensor

from phasemech.core.device import model_device, move, resolve_device
from phasemech.core.grid import (
    phase_of,
    reference_grid,  # reference_grid: re-exported
)
from phasemech.core.io import write_json_atomic, write_text_atomic
from phasemech.data.tasks import generate, to_tensors
from phasemech.data.tasks import training_batch as task_batch
from phasemech.measure.readout import (
    answer_logits,  # re-exported: phasemech.training.trainer.answer_logits
)
from phasemech.model.transformer import PhaseTransformer
from phasemech.training.checkpoints import (
    CKPT_DIR,
    CONFIG_NAME,
    INFO_FILE,
    METRICS_NAME,
    checkpoint_dirs,
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
)
from phasemech.training.config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then a constant rate, or (``schedule="cosine"``) a cosine decay to
    ``min_lr_ratio`` at ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------- held-out eval


@dataclass(frozen=True)
class HeldOut:
    tokens: Int[Tensor, "batch pos"]
    query_pos: Int[Tensor, "batch target"]
    answer: Int[Tensor, "batch target"]
    phase: np.ndarray  # [batch, target] on the model's reference grid


def held_out_set(cfg: TrainConfig) -> HeldOut:
    ds = generate(cfg.task, cfg.eval_sequences, cfg.eval_seed, balanced=True)
    tokens, qp, ans = to_tensors(ds)
    source = np.asarray(ds["source_pos"])
    stride, offset = reference_grid(cfg.compression)
    return HeldOut(tokens, qp, ans, phase_of(source, stride, offset))


@torch.no_grad()
def held_out_accuracy(model: PhaseTransformer, data: HeldOut, stride: int, batch: int = 256):
    """``(accuracy, accuracy per phase [stride], mean loss)`` on the held-out set."""
    was_training = model.training
    model.eval()
    correct, losses = [], []
    dev = model_device(model)
    for i in range(0, len(data.tokens), batch):
        tokens, qp = data.tokens[i : i + batch].to(dev), data.query_pos[i : i + batch].to(dev)
        logits = answer_logits(model, tokens, qp)
        ans = data.answer[i : i + batch].to(dev)
        correct.append((logits.argmax(-1) == ans).cpu().numpy())
        loss = F.cross_entropy(logits.flatten(0, 1), ans.flatten(), reduction="sum")
        losses.append(loss.cpu())  # summed as tensors, as before the device move
    model.train(was_training)
    ok = np.concatenate(correct).ravel()
    phase = data.phase.ravel()
    by_phase = [
        float(ok[phase == p].mean()) if (phase == p).any() else math.nan for p in range(stride)
    ]
    return float(ok.mean()), by_phase, float(sum(losses)) / ok.size


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} (saved) != {vb!r} (given)")
    return out


# -------------------------------------------------------------------------------------- train


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    step: int
    accuracy: float
    accuracy_by_phase: list[float]
    stopped_early: bool
    seconds: float

    @property
    def checkpoint(self) -> Path:
        return self.run_dir / CKPT_DIR / f"step_{self.step:06d}"


def train(
    cfg: TrainConfig,
    run_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    on_step: Callable[[int, float], None] | None = None,
    device: str | torch.device = "cpu",
) -> TrainResult:
    """Train ``cfg`` into ``run_dir``; with ``resume`` continue from its last checkpoint.

    A folder that already holds a run is refused without ``resume`` (nothing is overwritten).
    ``on_step(step, loss)`` runs after every optimizer step (tests use it to interrupt a run).
    ``device``: ``auto``, ``cpu`` (the default) or ``cuda``; the weights are initialised and the
    data drawn on the CPU either way, and checkpoints hold CPU tensors, so a run may resume on
    another device.
    """
    dev = resolve_device(device)
    run_dir = Path(run_dir)
    cfg_file = run_dir / CONFIG_NAME
    _check_run_folder(run_dir)
    if cfg_file.exists() and not resume:
        raise FileExistsError(f"{run_dir} already holds a run: pass resume=True (--resume)")
    if resume and cfg_file.exists():
        saved = TrainConfig.load(cfg_file)
        diffs = _diff(
            json.loads(json.dumps(saved.to_dict())), json.loads(json.dumps(cfg.to_dict()))
        )
        if diffs:
            raise ValueError(f"{run_dir} was trained with another config: " + "; ".join(diffs))
    model = move(cfg.build_model(), dev)  # a config that cannot build fails here, before any write
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(run_dir)
        if not cfg_file.exists():  # a resumed run's config was checked equal above
            write_json_atomic(cfg_file, cfg.to_dict())
        return _train(cfg, model, run_dir, resume, progress, on_step)
    except OSError as err:
        if err.errno is None:  # ours: already names the file or folder
            raise
        # a full or read-only disk: one line naming the run folder and the OS error (same
        # exception type, so callers catching PermissionError and the like still do)
        where = f" ({err.filename})" if err.filename else ""
        raise type(err)(f"{run_dir}: {err.strerror or err}{where}") from err
    finally:
        torch.set_num_threads(prev_threads)


def _check_run_folder(run_dir: Path) -> None:
    """A run goes into a new folder, an empty one, or one that holds a run: never into a file
    or a folder of someone else's files (a run replaces its ``metrics.jsonl``)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"{run_dir} is a file: a run needs a new or empty folder")
    if not run_dir.is_dir() or (run_dir / CONFIG_NAME).is_file():
        return
    # hidden files are not someone's work: OS litter (.DS_Store, .gitkeep) or the leftover of
    # an atomic write of the config itself (a run killed at its first write)
    foreign = [p.name for p in run_dir.iterdir() if not p.name.startswith(".")]
    if foreign:
        shown = ", ".join(sorted(foreign)[:3]) + (", ..." if len(foreign) > 3 else "")
        raise FileExistsError(
            f"{run_dir} is not empty ({shown}) and holds no {CONFIG_NAME}: not a phasemech run; "
            "use a new or empty folder"
        )


def _train(
    cfg: TrainConfig, model: PhaseTransformer, run_dir: Path, resume: bool, progress: bool, on_step
) -> TrainResult:
    t0 = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    step, info = _restore(run_dir, model, opt, sched, resume)
    if info.get("finished"):
        return TrainResult(
            run_dir,
            step,
            info["accuracy"],
            info["accuracy_by_phase"],
            info["stopped_early"],
            0.0,
        )
    step, acc, by_phase, stopped_early = _run_steps(
        cfg, model, opt, sched, run_dir, step, info, progress, on_step, t0
    )
    seconds = time.perf_counter() - t0
    with (run_dir / METRICS_NAME).open("a") as log:
        _log(
            log,
            {
                "event": "done",
                "step": step,
                "accuracy": acc,
                "stopped_early": stopped_early,
                "seconds": seconds,
            },
        )
    return TrainResult(run_dir, step, acc, by_phase, stopped_early, seconds)


def _restore(run_dir: Path, model: PhaseTransformer, opt, sched, resume: bool) -> tuple[int, dict]:
    """``(step, info)`` of the last checkpoint, loaded into ``model``, ``opt`` and ``sched``, or
    ``(0, {})`` for a fresh run; the metrics log is cut back to the checkpoint (or removed)."""
    ckpts = checkpoint_dirs(run_dir)
    metrics_file = run_dir / METRICS_NAME
    if not (resume and ckpts):
        if metrics_file.exists():
            metrics_file.unlink()
        return 0, {}
    step = load_checkpoint(ckpts[-1], model, opt, sched)
    info_file = ckpts[-1] / INFO_FILE
    try:
        info = json.loads(info_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{info_file} could not be read: {err}") from err
    if not info.get("finished") and metrics_file.exists():
        # drop log lines written after the checkpoint by the interrupted process
        rows = [json.loads(ln) for ln in metrics_file.read_text().splitlines() if ln.strip()]
        kept = [r for r in rows if r.get("event") != "done" and r.get("step", 0) <= step]
        write_text_atomic(metrics_file, "".join(json.dumps(r) + "\n" for r in kept))
    return step, info


def _run_steps(
    cfg: TrainConfig,
    model: PhaseTransformer,
    opt,
    sched,
    run_dir: Path,
    step: int,
    info: dict,
    progress: bool,
    on_step,
    t0: float,
) -> tuple[int, float, list[float], bool]:
    """Train from ``step`` to the end or the target accuracy, evaluating, logging and saving
    checkpoints on the way; ``(step, accuracy, accuracy_by_phase, stopped_early)``."""
    data = held_out_set(cfg)
    stride, _ = reference_grid(cfg.compression)
    # a resumed run carries its checkpoint's accuracy (checkpoints sit on evaluation steps)
    acc = info.get("accuracy", math.nan)
    by_phase = info.get("accuracy_by_phase", [math.nan] * stride)
    stopped_early = False
    model.train()
    recent: list[float] = []
    bar = _progress_bar(progress)
    with bar, (run_dir / METRICS_NAME).open("a") as log:
        name = f"{cfg.compression.design} d={cfg.compression.stride} h={cfg.model.n_heads}"
        task_id = bar.add_task(
            name, total=cfg.steps, completed=step, loss=math.nan, acc="-", phases="-"
        )
        while step < cfg.steps:
            recent.append(train_step(cfg, model, opt, sched, step))
            step += 1
            bar.update(task_id, completed=step, loss=float(np.mean(recent[-50:])))
            if on_step is not None:
                on_step(step, recent[-1])
            last = step == cfg.steps
            if step % cfg.eval_every == 0 or last:
                acc, by_phase = _evaluate(model, data, stride, log, step, recent, sched, t0)
                recent = []
                bar.update(task_id, acc=f"{acc:.3f}", phases=" ".join(f"{p:.2f}" for p in by_phase))
                # never inside a dense warm-up: the model stops as it is deployed, sparse-trained
                stopped_early = (
                    cfg.target_accuracy is not None
                    and acc >= cfg.target_accuracy
                    and step > cfg.selection_warmup
                )
            done = last or stopped_early
            if step % cfg.ckpt_every == 0 or done:
                info = {
                    "finished": done,
                    "stopped_early": stopped_early,
                    "accuracy": acc,
                    "accuracy_by_phase": by_phase,
                }
                save_checkpoint(run_dir, step, model, opt, sched, info)
            if done:
                break
    return step, acc, by_phase, stopped_early


def _evaluate(
    model: PhaseTransformer,
    data: HeldOut,
    stride: int,
    log,
    step: int,
    recent: list[float],
    sched,
    t0: float,
) -> tuple[float, list[float]]:
    """Score the held-out set and log it with the mean training loss since the last evaluation;
    ``(accuracy, accuracy_by_phase)``."""
    acc, by_phase, eval_loss = held_out_accuracy(model, data, stride)
    _log(
        log,
        {
            "step": step,
            "train_loss": float(np.mean(recent)),
            "eval_loss": eval_loss,
            "accuracy": acc,
            "accuracy_by_phase": by_phase,
            "lr": sched.get_last_lr()[0],
            "seconds": time.perf_counter() - t0,
        },
    )
    return acc, by_phase


def train_step(cfg: TrainConfig, model: PhaseTransformer, opt, sched, step: int) -> float:
    """One optimizer step on the batch of ``step`` (a pure function of the seed and the step,
    which is what makes a resumed run exact); the batch's loss."""
    dev = model_device(model)
    batch = task_batch(cfg.task, cfg.batch_size, cfg.seed, step, cfg.prefix_spread(step))
    tokens, qp, ans = (t.to(dev) for t in batch)
    with model.keep_every_block(step < cfg.selection_warmup):
        logits = answer_logits(model, tokens, qp)
    loss = F.cross_entropy(logits.flatten(0, 1), ans.flatten())
    aux = model.auxiliary_loss()  # a learned selector's own objective (dsa's indexer KL)
    opt.zero_grad(set_to_none=True)
    (loss if aux is None else loss + aux).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    sched.step()
    return loss.item()


def _progress_bar(progress: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn(
            "{task.completed}/{task.total} loss {task.fields[loss]:.3f} "
            "acc {task.fields[acc]} by phase {task.fields[phases]}"
        ),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not progress,
    )


def _log(log, row: dict) -> None:
    """Append one JSON line to the metrics log, flushed: a killed run keeps what it logged."""
    log.write(json.dumps(row) + "\n")
    log.flush()


__all__ = [
    "HeldOut",
    "TrainResult",
    "held_out_accuracy",
    "held_out_set",
    "lr_factor",
    "train",
    "train_step",
]
