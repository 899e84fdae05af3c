"""Training from scratch on a retrieval task, with resumable atomic checkpoints.

A run is a folder::

    RUN/train_config.json            the TrainConfig (a resumed run must match it)
    RUN/metrics.jsonl                one JSON line per evaluation (and the final summary)
    RUN/checkpoints/step_000200/     config.json + model.safetensors (PhaseTransformer.save),
                                     trainer.pt (optimizer, scheduler, torch RNG), trainer.json

A checkpoint folder is written under a temporary name and renamed into place, so a folder named
``step_*`` is always complete. Training data is a pure function of ``(seed, step)``
(:func:`phasemech.tasks.training_batch`) and the learning rate a pure function of the step, so
a run interrupted anywhere and resumed from its last checkpoint ends with the same weights as
one that never stopped.

Loss and accuracy are taken only at answer positions (Zoology's MQAR convention). The held-out
set is phase-balanced and seeded independently of the model (``eval_seed``), so every model of a
sweep is scored on the same sequences.

Axis names: ``batch`` (sequences), ``pos`` (token positions), ``target`` (answers per sequence,
see :mod:`phasemech.tasks`), ``vocab``, ``phase``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Int
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from torch import Tensor

from phasemech.config import CompressionConfig, PhaseTransformerConfig, is_int
from phasemech.grid import phase_of, reference_grid  # reference_grid: re-exported
from phasemech.io import write_json_atomic, write_text_atomic
from phasemech.model import PhaseTransformer
from phasemech.readout import answer_logits  # re-exported: phasemech.train.answer_logits
from phasemech.tasks import (
    MQARTask,
    NeedleTask,
    Task,
    generate,
    task_from_dict,
    task_to_dict,
    to_tensors,
)
from phasemech.tasks import training_batch as task_batch

CONFIG_NAME = "train_config.json"
DEFAULT_EVAL_SEQUENCES = 512
TMP_CKPT_PREFIX = ".tmp-step_"  # + step + "-" + pid: a checkpoint being written
METRICS_NAME = "metrics.jsonl"
CKPT_DIR = "checkpoints"
STATE_FILE = "trainer.pt"
INFO_FILE = "trainer.json"


@dataclass(frozen=True)
class ModelSpec:
    """Size of a from-scratch model (attention-only by default, as in the paper's toy runs)."""

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    d_head: int | None = None  # None: d_model // n_heads
    attn_only: bool = True
    d_mlp: int | None = None  # None: 4 * d_model when attn_only is False
    normalization_type: str | None = "LN"
    positional_embedding_type: str = "standard"

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"model {name}={value!r} is invalid: need an int >= 1")
        if self.d_head is None and self.d_model % self.n_heads:
            raise ValueError(
                f"model d_model={self.d_model} is not divisible by n_heads={self.n_heads}: "
                "give d_head explicitly or pick a divisor"
            )
        for name in ("d_head", "d_mlp"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"model {name}={value!r} is invalid: need None or an int >= 1")
        norms = (None, "LN", "LNPre", "RMS", "RMSPre")
        if self.normalization_type not in norms:
            raise ValueError(
                f"model normalization_type={self.normalization_type!r} is invalid: allowed {norms}"
            )
        pos = ("standard", "rotary", "shortformer")
        if self.positional_embedding_type not in pos:
            raise ValueError(
                f"model positional_embedding_type={self.positional_embedding_type!r} is "
                f"invalid: allowed {pos}"
            )

    def hooked_config(self, task: Task, compression: CompressionConfig, seed: int):
        d_head = self.d_head or self.d_model // self.n_heads
        extra: dict[str, Any] = {}
        if not self.attn_only:
            extra = {"d_mlp": self.d_mlp or 4 * self.d_model, "act_fn": "gelu"}
        return PhaseTransformerConfig(
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_head=d_head,
            n_ctx=task.seq_len,
            d_vocab=task.vocab_size,
            attn_only=self.attn_only,
            normalization_type=self.normalization_type,
            positional_embedding_type=self.positional_embedding_type,
            seed=seed,
            compression=compression,
            **extra,
        )


def default_eval_sequences(task_stride: int) -> int:
    """The default held-out size: the smallest phase-balanced set (a multiple of the task's
    stride) of at least 512 sequences."""
    return _round_up(DEFAULT_EVAL_SEQUENCES, task_stride)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a run's result. Defaults: the paper-scale toy of the sweep."""

    task: Task = field(default_factory=MQARTask)
    model: ModelSpec = field(default_factory=ModelSpec)
    compression: CompressionConfig = field(default_factory=lambda: CompressionConfig("none"))
    steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0
    eval_every: int = 100
    checkpoint_every: int | None = None  # None: at every evaluation
    # phase-balanced held-out set; None: 512 rounded up to a multiple of the task's stride
    eval_sequences: int | None = None
    eval_seed: int = 12345
    target_accuracy: float | None = None  # early stop once held-out accuracy reaches it
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        def need(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {allowed}")

        if self.eval_sequences is None:
            stride = getattr(self.task, "stride", 1)
            object.__setattr__(self, "eval_sequences", default_eval_sequences(stride))

        for name in ("steps", "batch_size", "eval_every", "eval_sequences", "threads"):
            need(name, is_int(getattr(self, name)) and getattr(self, name) >= 1, "need int >= 1")
        need("warmup_steps", is_int(self.warmup_steps) and self.warmup_steps >= 0, "need >= 0")
        ce = self.checkpoint_every
        # checkpoints at evaluation steps: a resumed run then restarts with a fresh loss window
        # and the accuracy of its checkpoint, exactly as the uninterrupted run had them
        need(
            "checkpoint_every",
            ce is None or (is_int(ce) and ce >= 1 and ce % self.eval_every == 0),
            f"need None or a multiple of eval_every={self.eval_every}",
        )
        for name, low in (("lr", 0.0), ("weight_decay", None), ("grad_clip", 0.0)):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            ok = ok and (value > low if low is not None else value >= 0)
            need(name, ok, "need a number > 0" if low is not None else "need a number >= 0")
        r = self.min_lr_ratio
        need("min_lr_ratio", isinstance(r, int | float) and 0 <= r <= 1, "need in [0, 1]")
        ta = self.target_accuracy
        ok = ta is None or (isinstance(ta, int | float) and 0 < ta <= 1)
        need("target_accuracy", ok, "need None or in (0, 1]")
        for name, cls in (
            ("task", (MQARTask, NeedleTask)),
            ("model", ModelSpec),
            ("compression", CompressionConfig),
        ):
            need(name, isinstance(getattr(self, name), cls), f"need a {cls}")
        if self.task.stride % self.compression.stride:
            # phases are balanced and independent of depth only on grids dividing the task's
            raise ValueError(
                f"compression stride={self.compression.stride} does not divide the task's "
                f"stride={self.task.stride}: target phases would be tied to depth; use a task "
                "stride that is a multiple of the compression stride"
            )
        need(
            "eval_sequences",
            self.eval_sequences % self.task.stride == 0,
            f"need a multiple of the task stride {self.task.stride} (phase-balanced set), e.g. "
            f"{_round_up(self.eval_sequences, self.task.stride)}",
        )
        need("seed", is_int(self.seed), "need an int")

    @property
    def ckpt_every(self) -> int:
        return self.checkpoint_every or self.eval_every

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["task"] = task_to_dict(self.task)
        out["model"] = dataclasses.asdict(self.model)
        out["compression"] = self.compression.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"train config fields {unknown} are unknown: allowed {sorted(known)}")
        if "task" in d:
            d["task"] = task_from_dict(d["task"])
        if "model" in d:
            mk = {f.name for f in dataclasses.fields(ModelSpec)}
            bad = sorted(set(d["model"]) - mk)
            if bad:
                raise ValueError(f"model fields {bad} are unknown: allowed {sorted(mk)}")
            d["model"] = ModelSpec(**d["model"])
        if "compression" in d:
            d["compression"] = CompressionConfig.from_dict(d["compression"])
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        """Read a ``train_config.json``; every error names the file."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except OSError as err:
            raise ValueError(f"{path} could not be read: {err.strerror or err}") from err
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path} holds an invalid train config: {err}") from err

    def build_model(self) -> PhaseTransformer:
        torch.manual_seed(self.seed)
        return PhaseTransformer(self.model.hooked_config(self.task, self.compression, self.seed))


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
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
    for i in range(0, len(data.tokens), batch):
        logits = answer_logits(model, data.tokens[i : i + batch], data.query_pos[i : i + batch])
        ans = data.answer[i : i + batch]
        correct.append((logits.argmax(-1) == ans).numpy())
        losses.append(F.cross_entropy(logits.flatten(0, 1), ans.flatten(), reduction="sum"))
    model.train(was_training)
    ok = np.concatenate(correct).ravel()
    phase = data.phase.ravel()
    by_phase = [
        float(ok[phase == p].mean()) if (phase == p).any() else math.nan for p in range(stride)
    ]
    return float(ok.mean()), by_phase, float(sum(losses)) / ok.size


# ---------------------------------------------------------------------------------- checkpoints


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def save_checkpoint(
    run_dir: Path, step: int, model: PhaseTransformer, opt, sched, info: dict[str, Any]
) -> Path:
    """Write checkpoint ``step`` under a temporary name, then rename it into place. A write that
    fails (full or read-only disk) removes its temporary folder and raises one ``OSError`` that
    names the checkpoints folder and the operating system's error."""
    root = run_dir / CKPT_DIR
    final = root / f"step_{step:06d}"
    tmp = root / f"{TMP_CKPT_PREFIX}{step:06d}-{os.getpid()}"
    state = {
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "step": step,
    }
    # serialised in memory, written with plain file writes: a full disk then surfaces as the OS
    # error it is, not as torch's "unexpected pos" from inside its zip writer
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        model.save(tmp)
        (tmp / STATE_FILE).write_bytes(buffer.getvalue())
        (tmp / INFO_FILE).write_text(json.dumps({"step": step, **info}, indent=2))
        if final.exists():  # re-saving the same step (e.g. early stop at a checkpoint step)
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic: readers see no folder or a complete one
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(
            f"{root}: could not write checkpoint {final.name} ({err.strerror or err})"
        ) from err
    return final


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Remove the temporary folders of checkpoint writes that were killed (``kill -9``, power
    loss): ``.tmp-step_<step>-<pid>`` whose process is gone, or is this very process (a PID
    reused after a restart; this process writes none before it trains). A folder of another
    live process is kept: it may be writing it now. Returns the removed folders."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    removed = []
    for path in root.glob(f"{TMP_CKPT_PREFIX}*"):
        pid = path.name.rsplit("-", 1)[-1]
        if path.is_dir() and pid.isdigit() and not _other_live_process(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _other_live_process(pid: int) -> bool:
    if pid == os.getpid():
        return False
    if os.name != "posix":  # os.kill(pid, 0) would send a signal there: keep the folder
        return True
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except (ProcessLookupError, OverflowError):  # gone, or no valid PID at all
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def load_checkpoint(ckpt: Path, model: PhaseTransformer, opt, sched) -> int:
    """Restore weights, optimizer, scheduler and RNG from ``ckpt``; return its step."""
    loaded = PhaseTransformer.load(ckpt)
    try:
        model.load_state_dict(loaded.state_dict(), strict=True)
    except RuntimeError as err:
        raise ValueError(f"{ckpt} does not match this run's model: {err}") from err
    state_file = ckpt / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{state_file} is missing: not a phasemech training checkpoint")
    try:
        state = torch.load(state_file, weights_only=True)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["step"])
    except Exception as err:  # pickle/zip errors, missing keys, shape mismatches
        raise ValueError(f"{state_file} could not be restored: {err}") from err


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
) -> TrainResult:
    """Train ``cfg`` into ``run_dir``; with ``resume`` continue from its last checkpoint.

    A folder that already holds a run is refused without ``resume`` (nothing is overwritten).
    ``on_step(step, loss)`` runs after every optimizer step (tests use it to interrupt a run).
    """
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
    model = cfg.build_model()  # a config that cannot build fails here, before any write
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
    step, info = 0, {}
    ckpts = checkpoint_dirs(run_dir)
    metrics_file = run_dir / METRICS_NAME
    if resume and ckpts:
        step = load_checkpoint(ckpts[-1], model, opt, sched)
        info_file = ckpts[-1] / INFO_FILE
        try:
            info = json.loads(info_file.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{info_file} could not be read: {err}") from err
        if info.get("finished"):
            return TrainResult(
                run_dir,
                step,
                info["accuracy"],
                info["accuracy_by_phase"],
                info["stopped_early"],
                0.0,
            )
        # drop log lines written after the checkpoint by the interrupted process
        if metrics_file.exists():
            rows = [json.loads(ln) for ln in metrics_file.read_text().splitlines() if ln.strip()]
            kept = [r for r in rows if r.get("event") != "done" and r.get("step", 0) <= step]
            write_text_atomic(metrics_file, "".join(json.dumps(r) + "\n" for r in kept))
    elif metrics_file.exists():
        metrics_file.unlink()

    data = held_out_set(cfg)
    stride, _ = reference_grid(cfg.compression)
    # a resumed run carries its checkpoint's accuracy (checkpoints sit on evaluation steps)
    acc = info.get("accuracy", math.nan)
    by_phase = info.get("accuracy_by_phase", [math.nan] * stride)
    stopped_early = False
    model.train()
    recent: list[float] = []
    bar = Progress(
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
    with bar, metrics_file.open("a") as log:
        name = f"{cfg.compression.design} d={cfg.compression.stride} h={cfg.model.n_heads}"
        task_id = bar.add_task(
            name, total=cfg.steps, completed=step, loss=math.nan, acc="-", phases="-"
        )
        while step < cfg.steps:
            tokens, qp, ans = task_batch(cfg.task, cfg.batch_size, cfg.seed, step)
            logits = answer_logits(model, tokens, qp)
            loss = F.cross_entropy(logits.flatten(0, 1), ans.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            recent.append(loss.item())
            bar.update(task_id, completed=step, loss=float(np.mean(recent[-50:])))
            if on_step is not None:
                on_step(step, recent[-1])
            last = step == cfg.steps
            if step % cfg.eval_every == 0 or last:
                acc, by_phase, eval_loss = held_out_accuracy(model, data, stride)
                log.write(
                    json.dumps(
                        {
                            "step": step,
                            "train_loss": float(np.mean(recent)),
                            "eval_loss": eval_loss,
                            "accuracy": acc,
                            "accuracy_by_phase": by_phase,
                            "lr": sched.get_last_lr()[0],
                            "seconds": time.perf_counter() - t0,
                        }
                    )
                    + "\n"
                )
                log.flush()
                recent = []
                bar.update(task_id, acc=f"{acc:.3f}", phases=" ".join(f"{p:.2f}" for p in by_phase))
                stopped_early = cfg.target_accuracy is not None and acc >= cfg.target_accuracy
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
    seconds = time.perf_counter() - t0
    with metrics_file.open("a") as log:
        log.write(
            json.dumps(
                {
                    "event": "done",
                    "step": step,
                    "accuracy": acc,
                    "stopped_early": stopped_early,
                    "seconds": seconds,
                }
            )
            + "\n"
        )
    return TrainResult(run_dir, step, acc, by_phase, stopped_early, seconds)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluation lines of a run's ``metrics.jsonl``."""
    path = Path(run_dir) / METRICS_NAME
    if not path.is_file():
        return []
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [r for r in rows if r.get("event") != "done"]


__all__ = [
    "ModelSpec",
    "TrainConfig",
    "TrainResult",
    "answer_logits",
    "checkpoint_dirs",
    "lr_factor",
    "read_metrics",
    "reference_grid",
    "train",
]
