"""What an explanation is: one :class:`ExplainConfig`, a probe (:class:`~phasemech.
experiments.probe.config.ProbeConfig`: one design on one model, in one regime, at one context,
on the audit's prompts) and the analyses it runs on it (:data:`ANALYSES`; :data:`SELECTING`:
the designs whose selection they read).

Axes: ``phase`` (on the aligned reference grid, as the audit reports it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from phasemech.core.designs import designs_where
from phasemech.core.validation import is_int
from phasemech.experiments.probe.config import PROBE_DESIGNS, ProbeConfig, setting_name

ANALYSES = ("selection", "oracle", "ablation", "patching", "groups", "decompose")
#: analyses added after runs were recorded: no earlier step's output depends on them (each adds
#: a step of its own), so the cache key leaves them out and recorded runs keep their keys
LATER_ANALYSES = ("groups", "decompose")
#: how many of the heads that read the needle most (under the null) each group ablates
GROUP_SIZES = (1, 3, 5, 10)
#: designs whose selection the selection and oracle analyses read: the probe's designs that
#: rank blocks by a rule (the design registry's ``selector == "rule"``)
SELECTING = tuple(d for d in designs_where(selector="rule") if d in PROBE_DESIGNS)
#: an explanation's probe unless told: the audit's, at the budget where route's gap is largest
DEFAULT_PROBE = ProbeConfig(top_k=1)


@dataclass(frozen=True)
class ExplainConfig:
    """What to explain: ``probe`` with ONE design and ONE context (its ``offsets`` among the
    grid: phases stay those of the aligned reference grid, as the audit reports them),
    ``contrast_phases`` (``(clean, corrupted)``; default the strongest and weakest phase),
    ``analyses`` (any of :data:`ANALYSES`), ``per_layer_oracle`` (the oracle in each layer
    alone; default in ``decode`` only, where a copy is cheap), ``top_heads`` (heads the
    step-3 oracle forces) and ``group_sizes`` (the ``groups`` step's groups of needle-reading
    heads: the top 1, 3, ... by the null's attention onto the needle).
    ``ExplainConfig.of(**fields)`` takes the probe's fields and the explanation's in one call
    (``design`` and ``context`` for the probe's one of each)."""

    probe: ProbeConfig = field(default_factory=lambda: DEFAULT_PROBE)
    contrast_phases: tuple[int, int] | None = None
    analyses: tuple[str, ...] = ANALYSES
    per_layer_oracle: bool | None = None
    top_heads: int = 10
    n_boot: int = 1000
    #: the specialisation test's fixed draws per unit, used only with ``auto_perm=False``
    n_perm: int = 1000
    #: the specialisation test with ``n_perm="auto"``: draws sized to the 540 heads x modes
    #: (smallest attainable Holm p 0.001; a fixed 1000 cannot go below 540/1001). Left out of
    #: :meth:`to_dict` at its default, so recorded keys stay (the jobs are built with
    #: ``n_perm=0`` in any case: the tables compute the test)
    auto_perm: bool = True
    group_sizes: tuple[int, ...] = GROUP_SIZES

    @classmethod
    def of(cls, **kw: Any) -> ExplainConfig:
        """An explanation from the probe's fields and its own, by name (``design``,
        ``context``: the probe's one design and context)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"probe"}
        probe = {k: v for k, v in kw.items() if k not in own}
        if "design" in probe:
            probe["designs"] = (probe.pop("design"),)
        if "context" in probe:
            probe["contexts"] = (probe.pop("context"),)
        base = dataclasses.asdict(DEFAULT_PROBE)
        return cls(ProbeConfig(**(base | probe)), **{k: v for k, v in kw.items() if k in own})

    def __post_init__(self) -> None:
        for name in ("analyses", "contrast_phases", "group_sizes"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        p = self.probe
        if len(p.designs) != 1 or len(p.contexts) != 1:
            raise ValueError(
                f"ExplainConfig: designs={list(p.designs)}, contexts={list(p.contexts)} are "
                "invalid: an explanation takes one design at one context (run one per setting)"
            )
        bad = [a for a in self.analyses if a not in ANALYSES]
        if not self.analyses or bad:
            raise ValueError(
                f"ExplainConfig: analyses={self.analyses!r} is invalid: allowed any of {ANALYSES}"
            )
        picks = [a for a in self.analyses if a in ("selection", "oracle", "decompose")]
        if picks and self.design not in SELECTING:
            raise ValueError(
                f"ExplainConfig: analyses {picks} are invalid for design {self.design!r}: it "
                f"selects no blocks; allowed designs {SELECTING} (or analyses ablation, patching)"
            )
        self._check_contrast()
        # a job carries n_perm=0 (its tables compute no test); a fixed count must be >= 1
        low = 0 if self.auto_perm else 1
        if not is_int(self.n_perm) or self.n_perm < low:
            raise ValueError(
                f"ExplainConfig: n_perm={self.n_perm!r} is invalid: expected an int >= {low} "
                f"(auto_perm={self.auto_perm})"
            )
        if not isinstance(self.auto_perm, bool):
            raise ValueError(
                f"ExplainConfig: auto_perm={self.auto_perm!r} is invalid: expected a bool"
            )
        if not is_int(self.top_heads) or self.top_heads < 1:
            raise ValueError(
                f"ExplainConfig: top_heads={self.top_heads!r} is invalid: expected an int >= 1"
            )
        gs = self.group_sizes
        ok = isinstance(gs, tuple) and gs and all(is_int(k) and k >= 1 for k in gs)
        if not ok or len(set(gs)) != len(gs):
            raise ValueError(
                f"ExplainConfig: group_sizes={gs!r} is invalid: expected distinct ints >= 1"
            )

    def _check_contrast(self) -> None:
        if self.contrast_phases is None:
            return
        cp, d = tuple(self.contrast_phases), self.probe.stride
        if len(cp) != 2 or not all(is_int(p) and 0 <= p < d for p in cp) or cp[0] == cp[1]:
            raise ValueError(
                f"ExplainConfig: contrast_phases={self.contrast_phases!r} is invalid: "
                f"expected two different phases in 0..{d - 1} (clean, corrupted)"
            )

    @property
    def design(self) -> str:
        return self.probe.designs[0]

    @property
    def context(self) -> int:
        return self.probe.contexts[0]

    @property
    def setting(self) -> str:
        name = setting_name(self.probe.compression(self.design))
        offsets = self.probe.offsets
        return name if offsets == "aligned" else f"{name}_{offsets}"

    def flat(self) -> dict[str, Any]:
        """Every field in one mapping (``summary.json``'s ``config``): the probe's, with its
        one ``design`` and ``context``, beside the explanation's own."""
        probe = dataclasses.asdict(self.probe)
        probe["design"], probe["context"] = probe.pop("designs")[0], probe.pop("contexts")[0]
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return probe | {k: v for k, v in own.items() if k != "probe"}

    def to_dict(self) -> dict[str, Any]:
        """The cache key's form: :meth:`flat` without ``offsets`` on the aligned grid, without
        the probe's later fields at their defaults (an unset ``sink_tokens``, the default
        template, no extra prefix), without ``auto_perm`` at its default, without
        :data:`LATER_ANALYSES` among the analyses and without ``group_sizes`` at its default, so
        runs recorded before those existed keep their keys (a later analysis's own step differs
        by its ``step``)."""
        out = self.flat()
        if out["offsets"] == "aligned":
            del out["offsets"]
        for name in self.probe.later_at_default():
            del out[name]
        if out["auto_perm"]:
            del out["auto_perm"]
        out["analyses"] = tuple(a for a in out["analyses"] if a not in LATER_ANALYSES)
        if out["group_sizes"] == GROUP_SIZES:
            del out["group_sizes"]
        return out

    @property
    def perm_draws(self) -> int | str:
        """What the specialisation test takes as ``n_perm``: ``"auto"`` or the fixed count."""
        return "auto" if self.auto_perm else self.n_perm

    @property
    def oracle_per_layer(self) -> bool:
        regime = self.probe.regime
        return regime == "decode" if self.per_layer_oracle is None else self.per_layer_oracle


__all__ = [
    "ANALYSES",
    "DEFAULT_PROBE",
    "ExplainConfig",
    "GROUP_SIZES",
    "LATER_ANALYSES",
    "SELECTING",
]
