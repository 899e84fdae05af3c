"""The pretrained sweep's profiles: the post-hoc compression
settings each scores SmolLM2-135M under (``default``, ``map``, ``full``, ``tiny``).

Axes: rows are settings.
"""

from __future__ import annotations

from phasemech.core.config import CompressionConfig
from phasemech.data.passkey import PasskeyTask
from phasemech.experiments.experiment import Profile
from phasemech.measure.pretrained import Setting, SweepConfig


def _setting(design: str, d: int, w: int, first: int, k: int | None = None) -> Setting:
    name = f"{design}_d{d}_w{w}" + (f"_k{k}" if k is not None else "") + f"_L{first}"
    return Setting(
        name, CompressionConfig(design, stride=d, window=w, top_k=k, layers=tuple(range(first, 30)))
    )


def profile_settings(name: str) -> list[Setting]:
    """The settings a profile's ``settings`` name stands for, the null (uncompressed) first."""
    null = Setting("null")
    if name in ("tiny", "default"):
        return [null, _setting("route", 4, 32, 2, k=2)]
    if name == "map":  # a quick map: one knob at a time around the default setting
        return [
            null,
            _setting("mean", 4, 32, 2),
            _setting("mean", 4, 32, 16),
            _setting("route", 4, 32, 2, k=1),
            _setting("route", 4, 32, 2, k=4),
            _setting("route", 8, 32, 2, k=2),
            _setting("evict", 4, 32, 2, k=2),
            _setting("evict", 4, 32, 16, k=2),
        ]
    out = [null]
    for first in (2, 16):
        for d in (4, 8):
            out.append(_setting("mean", d, 32, first))
            for design in ("route", "evict"):
                for k in (1, 4):
                    out.append(_setting(design, d, 32, first, k=k))
    return out


def _profile(cfg: SweepConfig, settings: str) -> Profile:
    # post-hoc: no training (steps 0); the sweep's own config and its settings travel in extra
    return Profile(steps=0, extra=(("sweep", cfg), ("settings", settings)))


PROFILES = {
    # seconds: short prompts (48 filler tokens), 2 contents; the smoke test
    "tiny": _profile(
        SweepConfig(
            task=PasskeyTask(context=48), contents=2, n_boot=50, n_perm=50, attention_prompts=4
        ),
        "tiny",
    ),
    "default": _profile(SweepConfig(contents=200), "default"),
    # stride-8 prompts (balanced for d=4 too), 25 contents x 8 phases per setting
    "map": _profile(SweepConfig(task=PasskeyTask(stride=8), contents=25), "map"),
    "full": _profile(SweepConfig(task=PasskeyTask(stride=8), contents=200), "full"),
}


__all__ = ["PROFILES", "profile_settings"]
