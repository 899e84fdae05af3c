"""What a real-model study probes: one :class:`ProbeConfig` (a model, one or more post-hoc
designs on one grid, a regime, a retrieval task at some contexts, the prompts' contents and
seed), the one constructor of each design's compression (:meth:`ProbeConfig.compression`),
its KV budget and the grid shift of ``random`` offsets.

Every real-model study holds one: :class:`~phasemech.experiments.audit.config.AuditConfig`
and :class:`~phasemech.experiments.explain.config.ExplainConfig` contain it (``.probe``), the
command line builds it from one set of options (:mod:`phasemech.cli.probe`), and its workers
score its prompts (:mod:`phasemech.experiments.probe.worker`).

Axes: ``setting`` (``null``: the uncompressed model; then one per design), ``context``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from phasemech.core.config import CompressionConfig
from phasemech.core.designs import OFFSET_MODES, POST_HOC_DESIGNS, REGIMES, traits
from phasemech.core.grid import last_query_blocks, raw_band_width
from phasemech.core.validation import is_int
from phasemech.data.retrieval import TASK_KINDS, RetrievalTask

#: position encodings a compressed layer can host (keys carry their positions)
HOSTS = ("standard", "shortformer", "rotary")
#: grid offsets a probe takes: phases are reported on the aligned reference grid (``random``:
#: one shift per prompt, :func:`random_shift`)
PROBE_OFFSETS = OFFSET_MODES
#: designs a real-model study applies post hoc (no trained parameters; the design registry's
#: ``post_hoc`` designs)
PROBE_DESIGNS = POST_HOC_DESIGNS


@dataclass(frozen=True)
class ProbeConfig:
    """What to probe. ``designs``: one or more of :data:`PROBE_DESIGNS`, each on the same grid
    (``stride``, ``window``, ``top_k`` for the designs that rank blocks, ``layers``,
    ``offsets``, ``block_len``, ``obs_window`` for ``evict``, ``sink_tokens`` for the designs
    that take a sink); ``regime``: ``decode`` (a dense prefill, then the compressed cache) or
    ``trained``; ``contexts``: prompt lengths in tokens; ``contents``: contents per context,
    each at every phase at every depth (``contents x stride`` prompts, the same for every
    study with the same task, contents and seed); ``template`` and ``prefix_extra``: the
    needle's words and the extra shift-prefix tokens (:class:`~phasemech.data.retrieval.
    RetrievalTask`), to tell the grid's phase from the template's and the prefix's."""

    designs: tuple[str, ...] = ("route",)
    model: str = "smollm2-135m"
    stride: int = 4
    window: int | None = 16
    top_k: int | None = 8
    layers: tuple[int, ...] | None = None
    offsets: str = "aligned"
    block_len: int | None = None
    obs_window: int | None = None
    #: the attention sink of the designs that rank blocks (``CompressionConfig.sink_tokens``)
    sink_tokens: int | None = None
    regime: str = "decode"  # one shared prefill: the cheaper regime (docs/audit.md, Cost)
    contexts: tuple[int, ...] = (1024,)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    task: str = "passkey"
    distractors: int | None = None
    contents: int = 50
    seed: int = 0
    template: str = "pass_code"
    prefix_extra: int = 0

    def __post_init__(self) -> None:
        for name in ("designs", "contexts", "depths", "layers"):  # lists from JSON or a user
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))
        bad = [d for d in self.designs if d not in PROBE_DESIGNS]
        if not self.designs or bad or len(set(self.designs)) != len(self.designs):
            raise ValueError(
                f"designs={self.designs!r} is invalid: allowed one or more of {PROBE_DESIGNS}, "
                "each once (the others need trained compressors, gates or indexers)"
            )
        no_regime = [d for d in self.designs if self.regime not in traits(d).regimes]
        if self.regime not in REGIMES or no_regime:
            raise ValueError(
                f"regime={self.regime!r} is invalid for designs {no_regime or self.designs}: "
                f"allowed {REGIMES} (decode only where a KV cache holds what a design reads)"
            )
        if self.task not in TASK_KINDS:
            raise ValueError(f"task={self.task!r} is invalid: allowed {TASK_KINDS}")
        if self.offsets not in PROBE_OFFSETS:
            raise ValueError(
                f"offsets={self.offsets!r} is invalid: allowed {PROBE_OFFSETS} (phases are "
                "reported on the aligned grid, which these share)"
            )
        self._check_sizes()
        for design in self.designs:  # every compression is checked before any work
            self.compression(design)
        self.retrieval_task(self.contexts[0])

    def _check_sizes(self) -> None:
        if not is_int(self.contents) or self.contents < 1:
            raise ValueError(f"contents={self.contents!r} is invalid: expected an int >= 1")
        if not self.contexts or not all(is_int(c) and c >= 64 for c in self.contexts):
            raise ValueError(f"contexts={self.contexts!r} is invalid: expected ints >= 64")
        if self.sink_tokens is None:
            return
        if not is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens={self.sink_tokens!r} is invalid: expected an int >= 0")
        if self.sink_tokens == 0:
            object.__setattr__(self, "sink_tokens", None)  # no sink: the key of before
        elif not any(traits(d).sink for d in self.designs):
            raise ValueError(
                f"sink_tokens={self.sink_tokens} applies to none of designs "
                f"{list(self.designs)}: allowed with {[d for d in PROBE_DESIGNS if traits(d).sink]}"
            )

    def compression(self, design: str) -> CompressionConfig:
        """``design`` on the probe's grid: each field where the design takes it (the design
        registry's traits), so one grid serves designs that differ in what they take."""
        t = traits(design)
        return CompressionConfig(
            design,
            stride=self.stride,
            window=self.window,
            top_k=self.top_k if t.top_k else None,
            layers=self.layers,
            offsets=self.offsets,
            block_len=self.block_len,
            obs_window=self.obs_window if design == "evict" else None,
            sink_tokens=self.sink_tokens if t.sink else None,
        )

    def retrieval_task(self, context: int) -> RetrievalTask:
        kw = dict(kind=self.task, context=context, depths=self.depths, stride=self.stride)
        kw |= dict(template=self.template, prefix_extra=self.prefix_extra)
        return RetrievalTask(**kw, distractors=self.distractors)

    def to_dict(self) -> dict[str, Any]:
        """The cache key's form: every field, but those of :data:`LATER_FIELDS` left out while
        at their default, so the keys of runs recorded before they existed stay the same."""
        out = dataclasses.asdict(self)
        for name in self.later_at_default():
            del out[name]
        return out

    def later_at_default(self) -> list[str]:
        """The fields of :data:`LATER_FIELDS` at their defaults: every cache key leaves them out."""
        return [name for name in LATER_FIELDS if getattr(self, name) == _DEFAULTS[name]]


#: fields added after runs were recorded: a new field goes here (its default must keep the old
#: behaviour), so that recorded runs keep their cache keys (``tests/test_probe_keys.py``)
LATER_FIELDS = ("sink_tokens", "template", "prefix_extra")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ProbeConfig)}


def setting_name(comp: CompressionConfig, variant: str = "aligned") -> str:
    """A setting's name: ``<design>_d<stride>_w<window>[_k<top_k>][_s<sink>][_<variant>]``."""
    k = f"_k{comp.top_k}" if comp.top_k is not None else ""
    sink = f"_s{comp.sink_tokens}" if comp.sink_tokens else ""
    suffix = "" if variant == "aligned" else f"_{variant}"
    return f"{comp.design}_d{comp.stride}_w{comp.window}{k}{sink}{suffix}"


def kv_budget(comp: CompressionConfig | None, context: int, n_heads: int = 0) -> int:
    """Most tokens (or compressed entries) one query reads at the end of a ``context``-token
    prompt: ``top_k`` blocks of ``block_len`` plus the raw band (and the sink's tokens) for the
    selecting designs, the used blocks plus the raw band for ``mean``, a head's share of the
    blocks (of ``n_heads``) plus the block it closes and the raw band for ``partition``; the
    null reads every token."""
    if comp is None:
        return context
    band = raw_band_width(context, comp.stride, comp.window, comp.block_scope)
    used, ranked = last_query_blocks(
        context, comp.stride, comp.block_len, comp.window, comp.visibility, 0, comp.block_scope
    )
    if comp.design == "partition":
        if n_heads < 1:
            raise ValueError("kv_budget: partition's budget needs the model's n_heads")
        return min(context, (-(-ranked // n_heads) + 1) * comp.block_len + band)
    if comp.top_k is not None:  # never more blocks than the last query can rank
        sink = comp.sink_tokens or 0  # read raw beside the band and the kept blocks
        return min(context, min(comp.top_k, ranked) * comp.block_len + band + sink)
    return min(context, used + band)


def random_shift(seed: int, context: int, prompt_id: int, stride: int) -> int:
    """The grid shift of prompt ``prompt_id`` under ``random`` offsets: drawn from the probe's
    seed, never from the needle's phase, and the same for every design (paired)."""
    return int(np.random.default_rng([seed, context, prompt_id]).integers(stride))


__all__ = [
    "HOSTS",
    "LATER_FIELDS",
    "PROBE_DESIGNS",
    "PROBE_OFFSETS",
    "ProbeConfig",
    "kv_budget",
    "random_shift",
    "setting_name",
]
