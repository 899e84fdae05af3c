"""What an explanation is: one :class:`ExplainConfig` (one design
and grid on one model, in one regime, at one context, on the audit's prompts) and the analyses
it may run (:data:`ANALYSES`; :data:`SELECTING`: designs whose selection they read).

Axes: ``phase`` (on the aligned reference grid, as the audit reports it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from phasemech.core.validation import is_int
from phasemech.experiments.audit.config import AuditConfig

ANALYSES = ("selection", "oracle", "ablation", "patching")
#: designs whose selection the selection and oracle analyses read
SELECTING = ("route", "quest", "kpool", "evict")


@dataclass(frozen=True)
class ExplainConfig:
    """What to explain: ``design`` with the audit's grid fields (``offsets`` among them: phases
    stay those of the aligned reference grid, as the audit reports them), ``regime``, ``context``,
    ``contents`` (each at every phase), ``contrast_phases`` (``(clean, corrupted)``; default the
    strongest and weakest phase), ``analyses`` (any of :data:`ANALYSES`), ``per_layer_oracle``
    (the oracle in each layer alone; default in ``decode`` only, where a copy is cheap) and
    ``top_heads`` (heads the step-3 oracle forces)."""

    design: str = "route"
    model: str = "smollm2-135m"
    stride: int = 4
    window: int | None = 16
    top_k: int | None = 1
    layers: tuple[int, ...] | None = None
    offsets: str = "aligned"
    block_len: int | None = None
    obs_window: int | None = None
    regime: str = "decode"
    context: int = 1024
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    task: str = "passkey"
    distractors: int | None = None
    contents: int = 50
    seed: int = 0
    contrast_phases: tuple[int, int] | None = None
    analyses: tuple[str, ...] = ANALYSES
    per_layer_oracle: bool | None = None
    top_heads: int = 10
    n_boot: int = 1000
    n_perm: int = 1000

    def __post_init__(self) -> None:
        bad = [a for a in self.analyses if a not in ANALYSES]
        if not self.analyses or bad:
            raise ValueError(
                f"ExplainConfig: analyses={self.analyses!r} is invalid: allowed any of {ANALYSES}"
            )
        picks = [a for a in self.analyses if a in ("selection", "oracle")]
        if picks and self.design not in SELECTING:
            raise ValueError(
                f"ExplainConfig: analyses {picks} are invalid for design {self.design!r}: it "
                f"selects no blocks; allowed designs {SELECTING} (or analyses ablation, patching)"
            )
        if self.contrast_phases is not None:
            cp = tuple(self.contrast_phases)
            if (
                len(cp) != 2
                or not all(is_int(p) and 0 <= p < self.stride for p in cp)
                or cp[0] == cp[1]
            ):
                raise ValueError(
                    f"ExplainConfig: contrast_phases={self.contrast_phases!r} is invalid: "
                    f"expected two different phases in 0..{self.stride - 1} (clean, corrupted)"
                )
        if not is_int(self.top_heads) or self.top_heads < 1:
            raise ValueError(
                f"ExplainConfig: top_heads={self.top_heads!r} is invalid: expected an int >= 1"
            )
        self.audit()  # the design, grid, task and sizes, checked as the audit checks them

    def audit(self) -> AuditConfig:
        """The audit whose prompts and grid this explains (its null and one design)."""
        return AuditConfig(
            designs=(self.design,),
            model=self.model,
            stride=self.stride,
            window=self.window,
            top_k=self.top_k,
            layers=self.layers,
            offsets=self.offsets,
            block_len=self.block_len,
            obs_window=self.obs_window,
            regime=self.regime,
            contexts=(self.context,),
            depths=self.depths,
            task=self.task,
            distractors=self.distractors,
            contents=self.contents,
            seed=self.seed,
        )

    @property
    def setting(self) -> str:
        name = self.audit().setting_name(self.design)
        return name if self.offsets == "aligned" else f"{name}_{self.offsets}"

    def to_dict(self) -> dict[str, Any]:
        """The cache key's form: the aligned grid leaves ``offsets`` out, so runs recorded
        before the field existed keep their keys."""
        out = dataclasses.asdict(self)
        if out["offsets"] == "aligned":
            del out["offsets"]
        return out

    @property
    def oracle_per_layer(self) -> bool:
        return self.regime == "decode" if self.per_layer_oracle is None else self.per_layer_oracle


__all__ = ["ANALYSES", "ExplainConfig", "SELECTING"]
