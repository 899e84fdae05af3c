"""Phase sweep on a pretrained model with post-hoc chunked compression (passkey retrieval).

Axes: ``layer, head, phase``; prompts are rows of tidy frames.

For each *setting* (the uncompressed model: the null, where no phase effect is expected; and
each post-hoc compression: design, stride, raw window, top-k, compressed layers), every prompt
of one shared phase-swept passkey set (:mod:`phasemech.data.passkey`) is scored teacher-forced, and
the per-head attention from the answer step onto the needle is broken down by needle phase.
:func:`report` gives, per setting, the full statistics template (:func:`phasemech.measure.stats.
phase_report`: per-phase accuracy with cluster-bootstrap CIs, raw and debiased gap, permutation
and logistic tests) and the paired tests the design allows (the ``stride`` prompts of a content
differ only by the shift): Cochran's Q over all phases and exact McNemar tests of every pair of
phases (Holm-corrected).

The ``pretrained`` experiment (``phasemech.experiments.pretrained``) runs the prompts in chunks
as jobs on the launcher; :func:`run_sweep` runs them in this process.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from phasemech.core.config import CompressionConfig
from phasemech.core.device import resolve_device
from phasemech.data.passkey import PasskeyTask


@dataclass(frozen=True)
class Setting:
    """One model variant: ``compression=None`` is the uncompressed model."""

    name: str
    compression: CompressionConfig | None = None

    def describe(self) -> str:
        c = self.compression
        if c is None:
            return "uncompressed (null)"
        layers = list(c.layers) if c.layers is not None else "all"
        extra = f", top_k {c.top_k}" if c.top_k is not None else ""
        if c.block_len != c.stride:
            extra += f", l={c.block_len}"
        if c.offsets != "aligned":
            extra += f", offsets {c.offsets}"
        if c.block_scope != "outside_window":
            extra += f", blocks {c.block_scope}"
        if layers != "all" and len(layers) > 3:
            layers = f"{layers[0]}-{layers[-1]}"
        return f"{c.design}, d={c.stride}, W={c.window}{extra}, layers {layers}"


@dataclass(frozen=True)
class SweepConfig:
    model: str = "smollm2-135m"
    task: PasskeyTask = field(default_factory=PasskeyTask)
    contents: int = 200  # per setting, each at every phase: contents x stride prompts
    seed: int = 0
    batch_size: int = 16
    attention_prompts: int = 64  # prompts whose answer-step attention is broken down by phase
    n_boot: int = 1000
    n_perm: int = 1000

    def __post_init__(self) -> None:
        for name in ("contents", "batch_size", "attention_prompts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SweepConfig: {name}={v!r} is invalid: expected an int >= 1")


def check_settings(settings: Sequence[Setting], task: PasskeyTask) -> None:
    """Names unique; every compression's stride divides the prompt set's (else phases would not
    be balanced)."""
    names = [s.name for s in settings]
    if len(set(names)) != len(names):
        raise ValueError(f"setting names repeat: {names}")
    for s in settings:
        c = s.compression
        if c is not None and c.enabled and task.stride % c.stride:
            raise ValueError(
                f"setting {s.name!r}: stride {c.stride} does not divide the prompts' stride "
                f"{task.stride}: its phases would not be balanced"
            )


# ------------------------------------------------------------------------------ scoring


class Scorer:
    """Scores chunks of one prompt set under any setting, keeping the uncompressed model, one
    compressed copy (they share nothing) and the prompts between calls: a worker process loads
    the model once for all its chunks.

    ``device`` (``auto``, ``cpu``: the default, ``cuda`` or ``cuda:N``): where the model it
    loads runs; a ``base`` model given is used where it is (its compressed copies sit beside
    it). Prompts are built on the CPU and moved to the model for each forward."""

    def __init__(
        self, base=None, model_name: str = "smollm2-135m", device: str | torch.device = "cpu"
    ) -> None:
        self.device = resolve_device(device)  # checked before any model is loaded
        self.base, self.model_name = base, model_name
        self.compressed: dict[str, object] = {}
        self.prompts, self.prompts_key = None, None

    def model(self, setting: Setting):
        from phasemech.model.transformer import PhaseTransformer

        if self.base is None:
            from phasemech.model.pretrained import load_pretrained

            self.base = load_pretrained(self.model_name, device=self.device)
        if setting.compression is None:
            return self.base
        if setting.name not in self.compressed:
            self.compressed.clear()
            m = PhaseTransformer.from_hooked(self.base, setting.compression)
            m.eval()
            self.compressed[setting.name] = m
        return self.compressed[setting.name]

    def score(
        self, setting: Setting, cfg: SweepConfig, ids: Sequence[int], attention: bool
    ) -> tuple[pd.DataFrame, pd.DataFrame | None]:
        """Score prompts ``ids`` under ``setting``; with ``attention``, also the per-head phase
        attention from the answer step onto the needle on the first of them."""
        from phasemech.data.passkey import PasskeyBatch, build_prompts, score

        model = self.model(setting)
        key = (cfg.task, cfg.contents, cfg.seed)
        if self.prompts_key != key:  # built once per prompt set
            self.prompts = build_prompts(model.tokenizer, cfg.task, cfg.contents, seed=cfg.seed)
            self.prompts_key = key
        full = self.prompts
        sel = torch.tensor(list(ids))
        frame = full.frame.iloc[list(ids)].reset_index(drop=True)
        batch = PasskeyBatch(full.tokens[sel], full.answer[sel], frame, full.stride)
        scored = score(model, batch, cfg.batch_size).assign(setting=setting.name)
        pa = None
        if attention:
            k = min(cfg.attention_prompts, len(ids))
            sub = PasskeyBatch(batch.tokens[:k], batch.answer[:k], frame.iloc[:k], full.stride)
            pa = answer_attention(model, sub, setting).assign(setting=setting.name)
        return scored, pa


def answer_attention(model, batch, setting: Setting) -> pd.DataFrame:
    """Per (layer, head, needle phase): attention from the position that predicts the first
    answer token onto the needle's first digit (token patterns on compressed layers; the phase
    API hooks them, so nothing needs switching on; it moves the CPU prompts to the model)."""
    from phasemech.model.phase import combine_frames, phase_attention

    frames = []
    for i in range(0, len(batch.tokens), 8):
        f = batch.frame.iloc[i : i + 8]
        width = int(f["answer_start"].max())
        with torch.inference_mode():
            pa = phase_attention(
                model,
                batch.tokens[i : i + 8, :width],
                query_pos=torch.tensor(f["answer_start"].to_numpy() - 1),
                key_pos=torch.tensor(f["needle_pos"].to_numpy()),
                stride=batch.stride,
                reference_offset=0,
            )
        frames.append(pa.frame)
    return combine_frames(frames)


def run_sweep(
    settings: Sequence[Setting],
    cfg: SweepConfig = SweepConfig(),
    model=None,
    device: str | torch.device = "cpu",
) -> tuple[pd.DataFrame, pd.DataFrame, float]:
    """``(targets, attention, seconds)`` in this process: one row per (setting, prompt), and per
    (setting, layer, head, phase) the answer-step attention onto the needle. ``model``: an
    already loaded uncompressed ``HookedTransformer``, used on its own device (default: load
    ``cfg.model`` on ``device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``). Across processes or
    machines, the ``pretrained`` experiment runs the same chunks as jobs."""
    check_settings(settings, cfg.task)
    scorer = Scorer(model, cfg.model, device)
    ids = list(range(cfg.contents * cfg.task.stride))
    t0 = time.perf_counter()
    out = [scorer.score(s, cfg, ids, True) for s in settings]
    targets = pd.concat([o[0] for o in out], ignore_index=True)
    attention = pd.concat([o[1] for o in out], ignore_index=True)
    return targets, attention, time.perf_counter() - t0


# ------------------------------------------------------------------------------- statistics


def mcnemar_pairs(df: pd.DataFrame, stride: int) -> pd.DataFrame:
    """Exact McNemar test of every pair of phases over the contents seen at both (paired:
    same content, shifted), Holm-corrected. Columns ``phase_a, phase_b, acc_a, acc_b, n, b, c,
    p, p_holm``."""
    from statsmodels.stats.contingency_tables import mcnemar
    from statsmodels.stats.multitest import multipletests

    wide = df.pivot_table(index="group_id", columns="phase", values="correct", aggfunc="first")
    rows = []
    for a, b in itertools.combinations(range(stride), 2):
        if a not in wide.columns or b not in wide.columns:
            continue
        pair = wide[[a, b]].dropna().astype(bool)
        n10 = int((pair[a] & ~pair[b]).sum())
        n01 = int((~pair[a] & pair[b]).sum())
        table = [[0, n10], [n01, 0]]
        p = 1.0 if n10 + n01 == 0 else float(mcnemar(table, exact=True).pvalue)
        rows.append(
            dict(
                phase_a=a,
                phase_b=b,
                acc_a=pair[a].mean(),
                acc_b=pair[b].mean(),
                n=len(pair),
                b=n10,
                c=n01,
                p=p,
            )
        )
    out = pd.DataFrame(rows)
    if len(out):
        out["p_holm"] = multipletests(out["p"], method="holm")[1]
    return out


def report(
    targets: pd.DataFrame,
    settings: Sequence[Setting],
    stride: int,
    n_boot: int = 1000,
    n_perm: int = 1000,
    seed: int = 0,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(summary, per_phase)``: one summary row per setting, per-phase accuracy with CIs."""
    from phasemech.measure.stats import phase_report

    rows, phases = [], []
    for s in settings:
        df = targets[targets["setting"] == s.name]
        sdf = df.assign(
            phase=df["needle_pos"] % stride, seq_id=df["group_id"], pair_id=df["group_id"]
        )
        rep = phase_report(sdf, stride, n_boot=n_boot, n_perm=n_perm, seed=seed)
        pairs = mcnemar_pairs(sdf, stride)
        pp = rep.per_phase.assign(setting=s.name)
        phases.append(pp)
        worst = pairs.loc[pairs["p_holm"].idxmin()] if len(pairs) else None
        g = rep.gap
        rows.append(
            dict(
                setting=s.name,
                description=s.describe(),
                n=rep.n,
                accuracy=rep.accuracy,
                acc_by_phase=[round(float(x), 4) for x in pp["accuracy"]],
                ci_lo=[round(float(x), 4) for x in pp["boot_lo"]],
                ci_hi=[round(float(x), 4) for x in pp["boot_hi"]],
                raw_gap=g["raw_gap"],
                null_p95=g["null_p95"],
                debiased_gap=g["debiased_gap"],
                gap_lo=g["debiased_lo"],
                gap_hi=g["debiased_hi"],
                p_perm=g["p_perm"],
                p_logistic=rep.logistic["p"],
                p_cochran=rep.paired.get("p", np.nan),
                mcnemar_min_p_holm=np.nan if worst is None else float(worst["p_holm"]),
                mcnemar_pair=None
                if worst is None
                else f"{int(worst.phase_a)}-{int(worst.phase_b)}",
                first_token_accuracy=float(df["first_correct"].mean()),
                min_pos=int(df["needle_pos"].min()),
                max_pos=int(df["answer_start"].max()),
            )
        )
    return pd.DataFrame(rows), pd.concat(phases, ignore_index=True)


__all__ = [
    "Setting",
    "SweepConfig",
    "answer_attention",
    "check_settings",
    "mcnemar_pairs",
    "report",
    "Scorer",
    "run_sweep",
]
