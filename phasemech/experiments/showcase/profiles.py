"""The figures experiment's profiles: the phase sweep's models
(the same train jobs, so the same cache keys) with the dashboard panel's sizes.

Axes: rows are models.
"""

from __future__ import annotations

from dataclasses import replace

from phasemech.experiments.experiment import Profile
from phasemech.experiments.showcase.panels import PanelConfig
from phasemech.experiments.sweep.profiles import PROFILES as SWEEP_PROFILES

SHOWCASE_DIR = "showcase"


def _on_converged_sweep(name: str, analyse_seeds) -> Profile:
    """The dashboard profile of a converged sweep profile: its models, in its folder."""
    return replace(
        SWEEP_PROFILES[name],
        extra=SWEEP_PROFILES[name].extra
        + (("panel", PanelConfig(sequences=2048, n_boot=400, n_perm=400)),
           ("analyse_seeds", analyse_seeds)),
    )  # fmt: skip


PROFILES = {
    "tiny": replace(
        SWEEP_PROFILES["tiny"],
        extra=(("panel", PanelConfig(sequences=64, n_boot=50, n_perm=50)), ("patch_pairs", 32),
               ("theory_scale", 0.05)),
    ),
    # one seed of the four design families that the sweep found most telling: the dense
    # control, mean pooling (largest gap), gated (heads split the phases), route (no gap)
    "default": replace(
        SWEEP_PROFILES["default"],
        designs=("none", "mean", "gated", "route"), heads=(2,), seq_lens=(64,), seeds=(0, 1),
        test_sequences=2048,
        # longest first, so that the workers finish together
        models=("mean_d8_h2_T64_s0", "mean_d4_h2_T64_s0", "route_d4_h2_T64_s0",
                "gated_d4_h2_T64_s1", "none_d8_h2_T64_s0"),
        extra=(("panel", PanelConfig(sequences=2048, n_boot=400, n_perm=400)),),
    ),
    # the dashboard panels of the converged phase sweep's models (its search and seeds
    # stages: the same cache), those that reached 0.95, seed 0 of each setting
    "converged": _on_converged_sweep("converged", (0,)),
    # the same at d = 8, the first seed of each setting that reached 0.95 (gated and mlp
    # H = 4 converged only in seed 2), and at d = 8 with d_model 128
    "converged_d8": _on_converged_sweep("converged_d8", "first"),
    "converged_d8_wide": _on_converged_sweep("converged_d8_wide", "first"),
    # every run of the phase sweep's default profile (its train jobs: the same cache keys)
    "full": replace(
        SWEEP_PROFILES["default"],
        extra=(("panel", PanelConfig(sequences=4096, n_boot=1000, n_perm=1000)),),
    ),
}  # fmt: skip


__all__ = ["PROFILES", "SHOWCASE_DIR"]
