"""Experiments as data: each is a function ``profile -> list[Job]``, registered by name.

``phasemech run EXPERIMENT --profile P`` launches one of them (``phasemech.experiments.launch``
from Python). Profiles are small frozen dataclasses; ``tiny`` is the seconds-long smoke
version that the tests run on a two-node Ray cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from phasemech.core.config import CompressionConfig
from phasemech.data.tasks import MQARTask
from phasemech.experiments.jobs import Job, TrainJob
from phasemech.training.config import ModelSpec, TrainConfig


@dataclass(frozen=True)
class SweepProfile:
    """The from-scratch phase sweep: 2-layer attention-only models on phase-uniform MQAR,
    layer 2 compressed with a raw window of 2d; the dense model runs at the largest stride."""

    designs: tuple[str, ...]
    strides: tuple[int, ...]
    heads: tuple[int, ...]
    seeds: tuple[int, ...]
    seq_len: int = 64
    n_pairs: int = 8
    d_model: int = 64
    steps: int = 2000
    eval_every: int = 100
    target_accuracy: float | None = 0.995
    test_sequences: int = 4096


SWEEP_PROFILES = {
    "tiny": SweepProfile(
        designs=("none", "mean", "gated"),
        strides=(4,),
        heads=(2,),
        seeds=(0,),
        seq_len=32,
        n_pairs=4,
        d_model=32,
        steps=8,
        eval_every=4,
        target_accuracy=None,
        test_sequences=32,
    ),
    "default": SweepProfile(
        designs=("none", "mean", "gated", "mlp", "route", "evict"),
        strides=(4, 8),
        heads=(2, 4),
        seeds=(0, 1, 2),
    ),
}


def _train_job(p: SweepProfile, design: str, stride: int, heads: int, seed: int) -> TrainJob:
    # one task stride for every run: the same data stream and test set for every design
    task = MQARTask(vocab_size=64, seq_len=p.seq_len, n_pairs=p.n_pairs, stride=max(p.strides))
    if design == "none":
        comp = CompressionConfig("none", stride=stride)
    else:
        comp = CompressionConfig(design, stride=stride, window=2 * stride, layers=(1,))
    cfg = TrainConfig(
        task=task,
        model=ModelSpec(n_layers=2, d_model=p.d_model, n_heads=heads),
        compression=comp,
        steps=p.steps,
        eval_every=p.eval_every,
        eval_sequences=min(512, p.test_sequences),
        target_accuracy=p.target_accuracy,
        seed=seed,
    )
    name = f"{design}_d{stride}_h{heads}_T{p.seq_len}_s{seed}"
    return TrainJob(cfg, name=name, test_sequences=p.test_sequences)


def phase_sweep(profile: str = "tiny") -> list[Job]:
    """Every (design, stride, heads, seed) of the profile, trained and scored."""
    p = SWEEP_PROFILES[profile]
    jobs = []
    for design in p.designs:
        strides = (max(p.strides),) if design == "none" else p.strides
        for d in strides:
            for h in p.heads:
                for s in p.seeds:
                    jobs.append(_train_job(p, design, d, h, s))
    return jobs


EXPERIMENTS: dict[str, tuple[Callable[[str], list[Job]], tuple[str, ...]]] = {
    "phase_sweep": (phase_sweep, tuple(SWEEP_PROFILES)),
}


def experiment(name: str, profile: str) -> list[Job]:
    """The jobs of experiment ``name`` under ``profile``; a one-line error names what exists."""
    if name not in EXPERIMENTS:
        raise ValueError(f"experiment {name!r} is unknown: allowed {sorted(EXPERIMENTS)}")
    build, profiles = EXPERIMENTS[name]
    if profile not in profiles:
        raise ValueError(f"profile {profile!r} of {name!r} is unknown: allowed {list(profiles)}")
    return build(profile)


__all__ = ["EXPERIMENTS", "SWEEP_PROFILES", "SweepProfile", "experiment", "phase_sweep"]
