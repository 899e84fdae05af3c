"""What an audit is: one :class:`AuditConfig`, a probe (:class:`~phasemech.experiments.probe.
config.ProbeConfig`: the model, designs, grid, regime, task, contexts and prompts) and what the
audit adds to it: the per-head attention groups, the statistics' sizes and the fix variants.

Axes: ``setting`` (``null``: the uncompressed model; then one per design and variant).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

from phasemech.core.config import CompressionConfig
from phasemech.core.validation import is_int
from phasemech.experiments.audit.fixes import apply_variant, check_variants
from phasemech.experiments.probe.config import (
    HOSTS,
    PROBE_DESIGNS,
    PROBE_OFFSETS,
    ProbeConfig,
    kv_budget,
    setting_name,
)

#: the designs an audit takes (the probe's) and its offsets, under the names of before
AUDIT_DESIGNS = PROBE_DESIGNS
AUDIT_OFFSETS = PROBE_OFFSETS


@dataclass(frozen=True)
class AuditConfig:
    """What to audit: ``probe`` (every design on one grid, the prompts) and
    ``attention_groups`` (the first contents, consecutive contents cycling through the depths,
    whose prompts at every phase also give per-head attention onto the needle), the
    statistics' sizes and ``variants``: ``aligned`` (the probe's grid) and the fixes to compare
    with it, each applied to every design that can take it
    (:mod:`phasemech.experiments.audit.fixes`). ``AuditConfig.of(**fields)`` takes the probe's
    fields and the audit's in one call."""

    probe: ProbeConfig = field(default_factory=ProbeConfig)
    attention_groups: int = 5
    n_boot: int = 1000
    n_perm: int = 1000
    variants: tuple[str, ...] = ("aligned",)

    @classmethod
    def of(cls, **kw: Any) -> AuditConfig:
        """An audit from the probe's fields and the audit's, by name."""
        own = {f.name for f in dataclasses.fields(cls)} - {"probe"}
        return cls(ProbeConfig(**{k: v for k, v in kw.items() if k not in own}),
                   **{k: v for k, v in kw.items() if k in own})  # fmt: skip

    def __post_init__(self) -> None:
        if isinstance(self.variants, list):
            object.__setattr__(self, "variants", tuple(self.variants))
        check_variants(self.variants)
        if not is_int(self.attention_groups) or self.attention_groups < 1:
            raise ValueError(
                f"AuditConfig: attention_groups={self.attention_groups!r} is invalid: expected "
                "an int >= 1"
            )
        if len(self.variants) > 1 and self.probe.offsets != "aligned":
            raise ValueError(
                f"AuditConfig: offsets={self.probe.offsets!r} is invalid with fixes: a fix is "
                "compared with the aligned grid; allowed offsets='aligned' (the offset fixes are "
                "--fix per_head, per_layer, per_layer_head, random)"
            )
        designs = self.probe.designs
        unused = [v for v in self.variants if not any(self._takes(d, v) for d in designs)]
        if unused:
            raise ValueError(
                f"AuditConfig: variants {unused} apply to none of designs {list(designs)}: "
                f"{'; '.join(self.skipped())}"
            )

    @functools.cached_property
    def _grids(self) -> dict[tuple[str, str], CompressionConfig | str]:
        """Each (design, variant): its compression, or why the design cannot take it."""
        out: dict[tuple[str, str], CompressionConfig | str] = {}
        for design, variant in itertools.product(self.probe.designs, self.variants):
            try:
                out[design, variant] = apply_variant(self.probe.compression(design), variant)
            except ValueError as err:
                out[design, variant] = str(err).splitlines()[0]
        return out

    def compression(self, design: str, variant: str = "aligned") -> CompressionConfig:
        """The design's compression under ``variant`` (a ``ValueError`` if it cannot take it)."""
        grid = self._grids[design, variant]
        if isinstance(grid, str):
            raise ValueError(grid)
        return grid

    def _takes(self, design: str, variant: str) -> bool:
        return not isinstance(self._grids[design, variant], str)

    def skipped(self) -> list[str]:
        """``design/variant: why`` for each pair the design cannot take."""
        return [f"{d}/{v}: {why}" for (d, v), why in self._grids.items() if isinstance(why, str)]

    def settings(self) -> list[tuple[str, CompressionConfig | None]]:
        """``(name, compression)``: the null first, then each design under each variant it
        can take (the aligned baseline first)."""
        return [("null", None)] + [
            (self.setting_name(d, v), self.compression(d, v))
            for d, v in itertools.product(self.probe.designs, self.variants)
            if self._takes(d, v)
        ]

    def setting_name(self, design: str, variant: str = "aligned") -> str:
        return setting_name(self.compression(design, variant), variant)

    def setting_meta(self, n_heads: int = 0) -> dict[str, dict[str, Any]]:
        """Per setting name: its design, variant and KV budget per context (``n_heads``: the
        model's query heads, for ``partition``'s share)."""
        ctx = self.probe.contexts
        out = {"null": dict(design="null", variant="aligned",
                            budget={c: kv_budget(None, c) for c in ctx})}  # fmt: skip
        for (d, v), comp in self._grids.items():
            if not isinstance(comp, str):
                budget = {c: kv_budget(comp, c, n_heads) for c in ctx}
                out[self.setting_name(d, v)] = dict(design=d, variant=v, budget=budget)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The cache key's and ``summary.json``'s form: the probe's fields beside the audit's,
        in one flat mapping (the keys of audits recorded before the probe existed)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return self.probe.to_dict() | {k: v for k, v in own.items() if k != "probe"}


__all__ = ["AUDIT_DESIGNS", "AUDIT_OFFSETS", "AuditConfig", "HOSTS"]
