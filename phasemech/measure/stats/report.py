"""The reporting template: every statistic of one evaluation in one :class:`PhaseReport`, with
its JSON/parquet form and markdown summary.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phasemech.core.io import atomic_write
from phasemech.core.validation import check_int
from phasemech.measure.stats.gap import (
    design_guard_on_targets,
    paired_phase_test_on_targets,
    phase_gap_on_targets,
)
from phasemech.measure.stats.intervals import by_depth_on_targets, per_phase_on_targets
from phasemech.measure.stats.omnibus import (
    chi2_phase_on_targets,
    harmonics_on_targets,
    logistic_phase_test_on_targets,
)
from phasemech.measure.stats.targets import check_alpha, load_targets


def _plain(x: Any) -> Any:
    """JSON-ready copy: numpy scalars to Python, NaN / inf to None, frames to row records."""
    if isinstance(x, pd.DataFrame):
        return [_plain(r) for r in x.to_dict(orient="records")]
    if isinstance(x, dict):
        return {str(key): _plain(v) for key, v in x.items()}
    if isinstance(x, list | tuple | np.ndarray):
        return [_plain(v) for v in x]
    if isinstance(x, bool | np.bool_):
        return bool(x)
    if isinstance(x, int | np.integer):
        return int(x)
    if isinstance(x, float | np.floating):
        return float(x) if math.isfinite(x) else None
    return x


def _fmt_p(p: Any) -> str:
    if p is None or not np.isfinite(p):
        return "n/a"
    return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "n/a" if x is None or not np.isfinite(x) else format(x, spec)


@dataclass(frozen=True, eq=False)  # eq=False: DataFrame fields have no truth value
class PhaseReport:
    """The reporting template (docs/statistics.md) for one (model, design, stride, length).

    ``per_phase``, ``by_depth``, ``harmonics`` are the frames of the functions of those names;
    ``chi2``, ``logistic``, ``gap``, ``guard`` the dicts of :func:`chi2_phase`,
    :func:`logistic_phase_test`, :func:`phase_gap`, :func:`design_guard`.
    """

    stride: int
    n: int
    accuracy: float
    per_phase: pd.DataFrame
    by_depth: pd.DataFrame
    chi2: dict
    logistic: dict
    harmonics: pd.DataFrame
    gap: dict
    guard: dict
    paired: dict = field(default_factory=dict)  # paired_phase_test, if pair_id

    def to_dict(self) -> dict:
        """Plain ints / floats / lists / dicts (frames as lists of row dicts); NaN -> None."""
        return _plain({name: getattr(self, name) for name in self.__dataclass_fields__})

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``{per_phase,by_depth,harmonics}.parquet`` and ``report.json`` into ``directory``.

        Each file is written to a temp file and moved into place, so an interrupted save never
        leaves a truncated file under the final name.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("per_phase", "by_depth", "harmonics"):
            frame = getattr(self, name)
            atomic_write(
                directory / f"{name}.parquet", lambda p, f=frame: f.to_parquet(p, index=False)
            )
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        atomic_write(directory / "report.json", lambda p: Path(p).write_text(text + "\n"))

    def summary(self) -> str:
        """A few lines for a terminal: the per-phase curve, the tests and the gaps."""
        lines = [f"stride {self.stride}: {self.n} targets, accuracy {_fmt(self.accuracy)}"]
        lines.append("phase  acc    wilson 95%       cluster boot 95%       n")
        for r in self.per_phase.itertuples():
            lines.append(
                f"{r.phase:>5}  {_fmt(r.accuracy)}  [{_fmt(r.wilson_lo)}, {_fmt(r.wilson_hi)}]"
                f"   [{_fmt(r.boot_lo)}, {_fmt(r.boot_hi)}]   {r.n:>7}"
            )
        lo, ch = self.logistic, self.chi2
        lines.append(
            f"phase effect: logistic LR (depth, seed adjusted) chi2={_fmt(lo['statistic'], '.1f')}"
            f" dof={lo['dof']} p={_fmt_p(lo['p'])}; unadjusted chi2 p={_fmt_p(ch['p'])}"
        )
        lines.append(
            "harmonics: "
            + "; ".join(
                f"k={r.k} |A|={_fmt(r.amplitude)} p={_fmt_p(r.p)} (Holm {_fmt_p(r.p_holm)})"
                for r in self.harmonics.itertuples()
            )
        )
        g = self.gap
        lines.append(
            f"gap: raw {_fmt(g['raw_gap'])} (phase {g['argmax_phase']} - {g['argmin_phase']};"
            f" null median {_fmt(g['null_median'])}, 95th {_fmt(g['null_p95'])},"
            f" perm p={_fmt_p(g['p_perm'])}); debiased {_fmt(g['debiased_gap'])}"
            f" [{_fmt(g['debiased_lo'])}, {_fmt(g['debiased_hi'])}];"
            f" harmonic p2p {_fmt(g['harmonic_p2p'])}"
        )
        if self.paired.get("blocks"):
            pq = self.paired
            lines.append(
                f"paired (Cochran's Q over {pq['blocks']} targets seen at every phase, "
                f"{pq['discordant']} discordant): Q={_fmt(pq['statistic'], '.1f')} "
                f"dof={pq['dof']} p={_fmt_p(pq['p'])}"
            )
        lines.append(
            "by depth: "
            + "; ".join(
                f"[{r.depth_lo:.1f}, {r.depth_hi:.1f}) {_fmt(r.accuracy)} (n={r.n})"
                for r in self.by_depth.itertuples()
            )
        )
        gd = self.guard
        lines.append(
            f"design guard: phase uniform p={_fmt_p(gd['uniform_p'])},"
            f" phase independent of depth p={_fmt_p(gd['independence_p'])}"
        )
        notes = [
            f"{name}: {d['note']}"
            for name, d in (("chi2", ch), ("logistic", lo), ("guard", gd))
            if d.get("note")
        ]
        if notes:
            lines.append("notes: " + "; ".join(notes))
        return "\n".join(lines)


def phase_report(
    df: pd.DataFrame,
    stride: int,
    *,
    n_boot: int = 1000,
    n_perm: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
    n_depth_bins: int = 5,
) -> PhaseReport:
    """Everything in the reporting template (docs/statistics.md), deterministic given ``seed``.

    ``n_depth_bins`` sets the depth bins of ``by_depth``, the design guard and the permutation
    strata. The logistic test uses its default spline (``depth_df=4``), the gap 20 splits.
    """
    where = "phase_report"
    t = load_targets(df, stride, where)
    n_boot = check_int(where, "n_boot", n_boot, 0)
    n_perm = check_int(where, "n_perm", n_perm, 0)
    n_depth_bins = check_int(where, "n_depth_bins", n_depth_bins, 1)
    alpha = check_alpha(where, alpha)
    return PhaseReport(
        stride=t.stride,
        n=len(t.correct),
        accuracy=float(t.correct.mean()),
        # Same seed handling as the standalone functions, so their results match the report's.
        per_phase=per_phase_on_targets(t, n_boot, np.random.default_rng(seed), alpha),
        by_depth=by_depth_on_targets(t, n_depth_bins, alpha),
        chi2=chi2_phase_on_targets(t),
        logistic=logistic_phase_test_on_targets(t, 4),
        harmonics=harmonics_on_targets(t, alpha),
        gap=phase_gap_on_targets(t, n_perm, n_boot, 20, seed, alpha, n_depth_bins),
        guard=design_guard_on_targets(t, n_depth_bins),
        # the frame is already checked: reuse its flattened form
        paired=paired_phase_test_on_targets(t, df["pair_id"].to_numpy())
        if "pair_id" in df.columns
        else {},
    )


__all__ = ["PhaseReport", "phase_report"]
