"""What an audit is: one :class:`AuditConfig` (a model, one or more
designs, each a post-hoc :class:`~phasemech.core.config.CompressionConfig` on the model's own
weights, a regime, contexts, a retrieval task, fix variants) and what it may take
(:data:`AUDIT_DESIGNS`, :data:`AUDIT_OFFSETS`, :data:`HOSTS`).

Axes: ``setting`` (``null``: the uncompressed model; then one per design and variant).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Any

from phasemech.core.config import SINK_DESIGNS, TOP_K_DESIGNS, CompressionConfig
from phasemech.core.validation import is_int
from phasemech.data.retrieval import TASK_KINDS, RetrievalTask
from phasemech.experiments.audit.fixes import apply_variant, check_variants, kv_budget
from phasemech.model.decode import REGIMES

#: position encodings a compressed layer can host (keys carry their positions)
HOSTS = ("standard", "shortformer", "rotary")
#: grid offsets an audit takes: phases are reported on the aligned reference grid (``random``:
#: one shift per prompt, :func:`~phasemech.experiments.audit.fixes.random_shift`)
AUDIT_OFFSETS = ("aligned", "per_layer", "per_head", "per_layer_head", "random")
#: designs an audit applies post hoc (no trained parameters)
AUDIT_DESIGNS = ("mean", "route", "evict", "quest", "kpool", "partition")


@dataclass(frozen=True)
class AuditConfig:
    """What to audit. ``designs``: one or more of :data:`AUDIT_DESIGNS`, each with the same
    grid (``stride``, ``window``, ``top_k`` for selecting designs, ``layers``, ``offsets``,
    ``block_len``, ``obs_window`` for ``evict``). ``contexts``: prompt lengths in tokens.
    ``contents``: contents per context, each at every phase (``contents x stride`` prompts).
    ``attention_groups``: the first contents (consecutive contents cycle through the depths)
    whose prompts, at every phase, also give per-head attention onto the needle.
    ``variants``: ``aligned`` (the grid above) and the fixes to compare with it, each applied to
    every design that can take it (:mod:`phasemech.experiments.audit.fixes`)."""

    designs: tuple[str, ...] = ("route",)
    model: str = "smollm2-135m"
    stride: int = 4
    window: int | None = 16
    top_k: int | None = 8
    layers: tuple[int, ...] | None = None
    offsets: str = "aligned"
    block_len: int | None = None
    obs_window: int | None = None
    regime: str = "decode"  # one shared prefill: the cheaper regime (docs/audit.md, Cost)
    contexts: tuple[int, ...] = (1024,)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    task: str = "passkey"
    distractors: int | None = None
    contents: int = 50
    seed: int = 0
    attention_groups: int = 5
    n_boot: int = 1000
    n_perm: int = 1000
    variants: tuple[str, ...] = ("aligned",)
    #: the attention sink of the selecting designs (``CompressionConfig.sink_tokens``)
    sink_tokens: int | None = None

    def __post_init__(self) -> None:
        bad = [d for d in self.designs if d not in AUDIT_DESIGNS]
        if not self.designs or bad or len(set(self.designs)) != len(self.designs):
            raise ValueError(
                f"AuditConfig: designs={self.designs!r} is invalid: allowed one or more of "
                f"{AUDIT_DESIGNS}, each once (the others need trained compressors, gates or "
                "indexers)"
            )
        if self.regime not in REGIMES:
            raise ValueError(f"AuditConfig: regime={self.regime!r} is invalid: allowed {REGIMES}")
        if self.task not in TASK_KINDS:
            raise ValueError(f"AuditConfig: task={self.task!r} is invalid: allowed {TASK_KINDS}")
        if self.offsets not in AUDIT_OFFSETS:
            raise ValueError(
                f"AuditConfig: offsets={self.offsets!r} is invalid: allowed {AUDIT_OFFSETS} "
                "(phases are reported on the aligned grid, which these share)"
            )
        check_variants(self.variants)
        self._check_sink()
        for name in ("contents", "attention_groups"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"AuditConfig: {name}={v!r} is invalid: expected an int >= 1")
        if not self.contexts or not all(is_int(c) and c >= 64 for c in self.contexts):
            raise ValueError(
                f"AuditConfig: contexts={self.contexts!r} is invalid: expected ints >= 64"
            )
        if len(self.variants) > 1 and self.offsets != "aligned":
            raise ValueError(
                f"AuditConfig: offsets={self.offsets!r} is invalid with fixes: a fix is compared "
                "with the aligned grid; allowed offsets='aligned' (the offset fixes are --fix "
                "per_head, per_layer, per_layer_head, random)"
            )
        for design in self.designs:  # every compression is checked before any work
            self.compression(design)
        unused = [v for v in self.variants if not any(self._takes(d, v) for d in self.designs)]
        if unused:
            raise ValueError(
                f"AuditConfig: variants {unused} apply to none of designs {list(self.designs)}: "
                f"{'; '.join(self.skipped())}"
            )
        self.retrieval_task(self.contexts[0])

    def _check_sink(self) -> None:
        if self.sink_tokens is None:
            return
        if not is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ValueError(
                f"AuditConfig: sink_tokens={self.sink_tokens!r} is invalid: expected an int >= 0"
            )
        if self.sink_tokens == 0:
            object.__setattr__(self, "sink_tokens", None)  # no sink: the audit's key of before
        elif not any(d in SINK_DESIGNS for d in self.designs):
            raise ValueError(
                f"AuditConfig: sink_tokens={self.sink_tokens} applies to none of designs "
                f"{list(self.designs)}: allowed with {SINK_DESIGNS}"
            )

    @functools.cached_property
    def _grids(self) -> dict[tuple[str, str], CompressionConfig | str]:
        """Each (design, variant): its compression, or why the design cannot take it."""
        out: dict[tuple[str, str], CompressionConfig | str] = {}
        for design, variant in itertools.product(self.designs, self.variants):
            try:
                out[design, variant] = apply_variant(self._compression(design), variant)
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

    def _compression(self, design: str) -> CompressionConfig:
        return CompressionConfig(
            design,
            stride=self.stride,
            window=self.window,
            top_k=self.top_k if design in TOP_K_DESIGNS else None,
            layers=self.layers,
            offsets=self.offsets,
            block_len=self.block_len,
            obs_window=self.obs_window if design == "evict" else None,
            sink_tokens=self.sink_tokens if design in SINK_DESIGNS else None,
        )

    def retrieval_task(self, context: int) -> RetrievalTask:
        kw = dict(kind=self.task, context=context, depths=self.depths, stride=self.stride)
        return RetrievalTask(**kw, distractors=self.distractors)

    def settings(self) -> list[tuple[str, CompressionConfig | None]]:
        """``(name, compression)``: the null first, then each design under each variant it
        can take (the aligned baseline first)."""
        return [("null", None)] + [
            (self.setting_name(d, v), self.compression(d, v))
            for d, v in itertools.product(self.designs, self.variants)
            if self._takes(d, v)
        ]

    def setting_name(self, design: str, variant: str = "aligned") -> str:
        c = self.compression(design, variant)
        k = f"_k{c.top_k}" if c.top_k is not None else ""
        sink = f"_s{c.sink_tokens}" if c.sink_tokens else ""
        suffix = "" if variant == "aligned" else f"_{variant}"
        return f"{design}_d{c.stride}_w{c.window}{k}{sink}{suffix}"

    def setting_meta(self, n_heads: int = 0) -> dict[str, dict[str, Any]]:
        """Per setting name: its design, variant and KV budget per context (``n_heads``: the
        model's query heads, for ``partition``'s share)."""
        out = {"null": dict(design="null", variant="aligned",
                            budget={c: kv_budget(None, c) for c in self.contexts})}  # fmt: skip
        for (d, v), comp in self._grids.items():
            if not isinstance(comp, str):
                budget = {c: kv_budget(comp, c, n_heads) for c in self.contexts}
                out[self.setting_name(d, v)] = dict(design=d, variant=v, budget=budget)
        return out

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["sink_tokens"] is None:  # the cache keys of audits written before it existed
            del out["sink_tokens"]
        return out


__all__ = ["AUDIT_DESIGNS", "AUDIT_OFFSETS", "AuditConfig", "HOSTS"]
