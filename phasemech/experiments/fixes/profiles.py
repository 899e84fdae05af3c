"""The fixes experiment's variants, profiles and the model each
(fix, seed) trains; the goal a fix must meet (:data:`GOAL_REDUCTION`, :data:`NONINFERIORITY`,
shared with the audit's fixes on a real model).

Axes: rows are (fix, seed) runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from phasemech.core.config import CompressionConfig
from phasemech.data.tasks import MQARTask
from phasemech.experiments.experiment import Profile
from phasemech.experiments.sweep.profiles import SYSTEM_TRAINING, system_geometry
from phasemech.training.config import ModelSpec, TrainConfig

GOAL_REDUCTION = 0.70
NONINFERIORITY = 0.01


@dataclass(frozen=True)
class Variant:
    """One way to train a model; ``baseline`` names the variant it is compared with."""

    offsets: str = "aligned"
    jitter: bool = False
    n_layers: int = 2
    layers: tuple[int, ...] = (1,)
    baseline: str | None = "aligned"


# Layer 2 (the retrieval layer of the induction circuit) is compressed, as in the phase sweep.
# Per-layer staggering needs two compressed layers: its own matched 3-layer pair. (A pilot with
# both layers of a 2-layer model compressed left aligned and per-head models on the plateau.)
VARIANTS = {
    "aligned": Variant(baseline=None),
    "staggered_head": Variant(offsets="per_head"),
    "random_offset": Variant(offsets="random"),
    "jittered_data": Variant(jitter=True),
    "aligned_3layer": Variant(n_layers=3, layers=(1, 2), baseline=None),
    "staggered_layer": Variant(
        offsets="per_layer", n_layers=3, layers=(1, 2), baseline="aligned_3layer"
    ),
}
FIXES = tuple(VARIANTS)


def _profile(steps: int, seeds, **kw) -> Profile:
    fixes = kw.pop("fixes", FIXES)
    jitter = kw.pop("jitter", 2)
    more = kw.pop("extra_items", ())
    target = kw.pop("target_accuracy", None)
    designs = kw.pop("designs", ("mean",))
    return Profile(
        steps=steps, seeds=seeds, designs=designs, checkpoint_every=None,
        target_accuracy=target, extra=(("fixes", fixes), ("jitter", jitter), *more), **kw,
    )  # fmt: skip


PROFILES = {
    # one seed: the smoke test of every fix and comparison, as fast as the test suite needs
    "tiny": _profile(20, (0,), strides=(4,), heads=(2,), seq_lens=(32,), n_pairs=4, jitter=1,
                     test_sequences=64, n_boot=50, n_perm=50, eval_every=10),
    # the largest gap of the default phase sweep: mean pooling, d = 8, 2 heads, T = 64
    "default": _profile(2000, (0, 1, 2), strides=(8,), heads=(2,)),
    # the budget axis: the 2-layer variants again with twice the steps
    "long": _profile(4000, (0, 1, 2), strides=(8,), heads=(2,),
                     fixes=("aligned", "staggered_head", "random_offset", "jittered_data")),
    # every fix and its baseline trained to convergence (the recipe's 8000 steps, early stop
    # at 0.99): a fix counts only if all its seeds reach 0.95 test accuracy; compared at
    # equal accuracy (final) and along training at equal budget (budget.parquet)
    "converged": _profile(8000, (0, 1, 2), strides=(4,), heads=(2,), test_sequences=2048,
                          target_accuracy=0.99, extra_items=(("min_accuracy", 0.95),)),
    # the offset fixes on the real systems (phase_sweep --profile systems): the 2-layer grid
    # fixes, at that profile's recipe, one profile per system ("systems_nsa", ...)
    **{f"systems_{design}{suffix}": _profile(
           4000, (0, 1, 2), strides=(16,) if design == "hca" else (4,), heads=(2,),
           seq_lens=(seq_len,), test_sequences=2048, target_accuracy=0.99,
           fixes=("aligned", "staggered_head", "random_offset"), designs=(design,),
           extra_items=(("min_accuracy", 0.95),))
       for design in ("nsa", "dsa", "csa", "hca", "partition")
       # the same at T = 128 (phase_sweep --profile systems_T128): "systems_partition_T128"
       for suffix, seq_len in (("", 64), ("_T128", 128))},
}  # fmt: skip


def test_task(p: Profile) -> MQARTask:
    """The one test task every fix is scored on (never jittered)."""
    return MQARTask(vocab_size=64, seq_len=p.seq_lens[0], n_pairs=p.n_pairs, stride=p.strides[0])


def train_config(fix: str, seed: int, p: Profile) -> TrainConfig:
    if fix not in VARIANTS:
        raise ValueError(f"fix={fix!r} is invalid: allowed {FIXES}")
    v, d = VARIANTS[fix], p.strides[0]
    jitter = p.get("jitter") if v.jitter else 0
    task = MQARTask(64, p.seq_lens[0], p.n_pairs, stride=d, jitter=jitter)
    comp = CompressionConfig(
        p.designs[0], stride=d, window=2 * d, offsets=v.offsets, layers=v.layers,
        **system_geometry(p.designs[0], d),
    )  # fmt: skip
    return TrainConfig(
        task=task,
        model=ModelSpec(n_layers=v.n_layers, d_model=p.d_model, n_heads=p.heads[0]),
        compression=comp,
        steps=p.steps,
        eval_every=p.eval_every,
        checkpoint_every=None,
        eval_sequences=512 if p.test_sequences >= 512 else 64,
        # the profile decides early stopping (the budget profiles train every step)
        target_accuracy=p.target_accuracy,
        seed=seed,
        **SYSTEM_TRAINING.get(p.designs[0], {}),
    )


__all__ = [
    "FIXES",
    "GOAL_REDUCTION",
    "NONINFERIORITY",
    "PROFILES",
    "VARIANTS",
    "Variant",
    "test_task",
    "train_config",
]
