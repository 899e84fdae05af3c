"""The interventions experiment's profiles: the phase
sweep's (the same train jobs, so the same cache keys) with the models to analyse and the
analyses' sizes (``sequences``: balanced test-set size; ``pairs``: patching pairs per
contrast).

Axes: rows are models.
"""

from __future__ import annotations

from dataclasses import replace

from phasemech.experiments.experiment import Profile
from phasemech.experiments.sweep.profiles import PROFILES as SWEEP_PROFILES

OUT_DIR = "interventions"

#: the models of the ``default`` profile, with a detailed section each in the summary
DEFAULT_MODELS = (
    "none_d8_h4_T64_s0",  # dense control
    "route_d8_h4_T64_s0",
    "route_d4_h4_T64_s0",
    "gated_d4_h2_T64_s1",  # converged gated
    "gated_d4_h2_T64_s0",
    "mean_d8_h2_T64_s0",  # partly learned, large phase gap
    "mean_d4_h2_T64_s0",
    "mlp_d4_h2_T64_s0",
)


def _on_converged_sweep(name: str, analyse_seeds) -> Profile:
    """The interventions profile of a converged sweep profile: its models, in its folder."""
    return replace(
        SWEEP_PROFILES[name], n_boot=1000, n_perm=1000,
        extra=SWEEP_PROFILES[name].extra + (("sequences", 1024), ("pairs", 256),
                                            ("analyse_seeds", analyse_seeds)),
    )  # fmt: skip


# Only ``models``, ``n_boot``/``n_perm`` and ``extra`` differ from the sweep's profiles: none of
# them enters a train job's config, so the train jobs keep the sweep's keys (and its cache).
# ``sequences``: balanced test-set size; ``pairs``: patching pairs per contrast.
PROFILES = {
    # both tiny sweep models (dense and gated), a few seconds of analysis each
    "tiny": replace(SWEEP_PROFILES["tiny"], extra=(("sequences", 32), ("pairs", 8))),
    "default": replace(
        SWEEP_PROFILES["default"], models=DEFAULT_MODELS, n_boot=1000, n_perm=1000,
        extra=(("sequences", 1024), ("pairs", 256)),
    ),
    # the converged phase sweep's models (its search and seeds stages: the same cache), only
    # those that reached its pooling threshold, seed 0 of each setting
    "converged": _on_converged_sweep("converged", (0,)),
    # the same at d = 8, where some settings converged only in a later seed: the first seed of
    # each setting that reached the threshold; and at d = 8 with d_model 128
    "converged_d8": _on_converged_sweep("converged_d8", "first"),
    "converged_d8_wide": _on_converged_sweep("converged_d8_wide", "first"),
    # the real systems (phase_sweep --profile systems): which head, branch (nsa), slot bias
    # (csa, hca) or indexer choice (dsa: its kept pools) serves which phase
    "systems": _on_converged_sweep("systems", "first"),
    "systems_T128": _on_converged_sweep("systems_T128", "first"),
    # csa / hca pooled before and after RoPE in rotary models: which head serves which phase
    "systems_rotary": _on_converged_sweep("systems_rotary", "first"),
    "systems_rotary_post": _on_converged_sweep("systems_rotary_post", "first"),
    "systems_nsa_mlp_gate": _on_converged_sweep("systems_nsa_mlp_gate", "first"),
}  # fmt: skip


__all__ = ["DEFAULT_MODELS", "OUT_DIR", "PROFILES"]
