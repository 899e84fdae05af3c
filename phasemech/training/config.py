"""A training run's configuration: the model's size (:class:`ModelSpec`) and everything that
decides a run's result (:class:`TrainConfig`), with its JSON form.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from phasemech.core.config import CompressionConfig, PhaseTransformerConfig, is_int
from phasemech.data.tasks import (
    MQARTask,
    NeedleTask,
    Task,
    task_from_dict,
    task_to_dict,
)
from phasemech.model.transformer import PhaseTransformer

DEFAULT_EVAL_SEQUENCES = 512
SCHEDULES = ("constant", "cosine")


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
            # built on the CPU everywhere (the same initial weights on any machine); train()
            # moves the model to its device
            device="cpu",
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
    """Everything that decides a run's result. Defaults: the paper-scale toy of the sweep, with
    the recipe that lets it leave the loss plateau (``docs/training.md``): AdamW at 3e-3 with
    weight decay 0.1, a short warm-up, then a constant rate (a cosine decay tied to the step
    budget lowers the rate while a model still sits on the plateau), up to 8000 steps with an
    early stop at 0.99 held-out accuracy."""

    task: Task = field(default_factory=MQARTask)
    model: ModelSpec = field(default_factory=ModelSpec)
    compression: CompressionConfig = field(default_factory=lambda: CompressionConfig("none"))
    steps: int = 8000
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 100
    schedule: str = "constant"  # after warm-up: "constant", or "cosine" to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    checkpoint_every: int | None = None  # None: at every evaluation
    # phase-balanced held-out set; None: 512 rounded up to a multiple of the task's stride
    eval_sequences: int | None = None
    eval_seed: int = 12345
    target_accuracy: float | None = 0.99  # early stop once held-out accuracy reaches it
    seed: int = 0
    threads: int = 1
    # a curriculum on the data's random prefix: over the first prefix_warmup steps the spread
    # widens from 1 position to the task's stride (0: the full spread from the first step). The
    # held-out set is always phase-balanced at the full spread.
    prefix_warmup: int = 0
    # DSA's dense warm-up: over the first selection_warmup steps the selecting layers keep every
    # candidate block (dense over the candidates), so a learned selector (dsa's indexer) learns
    # from a main attention that already retrieves; evaluation is always sparse
    selection_warmup: int = 0

    def __post_init__(self) -> None:
        def need(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {allowed}")

        if self.eval_sequences is None:
            stride = getattr(self.task, "stride", 1)
            object.__setattr__(self, "eval_sequences", default_eval_sequences(stride))

        for name in ("steps", "batch_size", "eval_every", "eval_sequences", "threads"):
            need(name, is_int(getattr(self, name)) and getattr(self, name) >= 1, "need int >= 1")
        for name in ("warmup_steps", "prefix_warmup", "selection_warmup"):
            need(name, is_int(getattr(self, name)) and getattr(self, name) >= 0, "need int >= 0")
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
        need("schedule", self.schedule in SCHEDULES, f"allowed {SCHEDULES}")
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

    def prefix_spread(self, step: int) -> int | None:
        """The training prefix's spread at ``step`` (None: the task's full stride): 1 at step 0,
        one more position every ``prefix_warmup / (stride - 1)`` steps."""
        if step >= self.prefix_warmup:
            return None
        return 1 + (self.task.stride - 1) * step // self.prefix_warmup

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("prefix_warmup", "selection_warmup"):
            if not out[name]:
                # fields added with a default that changes nothing stay out of the dict, so the
                # cache keys and saved configs of runs made before them still match
                del out[name]
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
