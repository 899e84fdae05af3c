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

Work is spread over processes (one torch thread each); each loads the model once.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from phasemech.core.config import CompressionConfig
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


# ------------------------------------------------------------------------------ the workers

_STATE: dict = {}


def _init(model_name: str) -> None:
    import torch

    torch.set_num_threads(1)
    from phasemech.model.pretrained import load_pretrained

    _STATE["base"] = load_pretrained(model_name)
    _STATE["models"] = {}


def _model(setting: Setting):
    from phasemech.model.transformer import PhaseTransformer

    if setting.compression is None:
        return _STATE["base"]
    if setting.name not in _STATE["models"]:
        _STATE["models"].clear()  # one compressed copy at a time: they share nothing
        m = PhaseTransformer.from_hooked(_STATE["base"], setting.compression)
        m.eval()
        _STATE["models"][setting.name] = m
    return _STATE["models"][setting.name]


def _job(setting: Setting, cfg: SweepConfig, ids: list[int], attention: bool) -> tuple:
    """Score prompts ``ids`` under ``setting``; with ``attention``, also the per-head phase
    attention from the answer step onto the needle on those prompts."""
    import torch

    from phasemech.data.passkey import PasskeyBatch, build_prompts, score

    model = _model(setting)
    key = (cfg.task, cfg.contents, cfg.seed)
    if _STATE.get("prompts_key") != key:  # built once per process and prompt set
        _STATE["prompts"] = build_prompts(model.tokenizer, cfg.task, cfg.contents, seed=cfg.seed)
        _STATE["prompts_key"] = key
    full = _STATE["prompts"]
    sel = torch.tensor(ids)
    frame = full.frame.iloc[ids].reset_index(drop=True)
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
    API hooks them, so nothing needs switching on)."""
    import torch

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
    workers: int | None = None,
    progress: bool = True,
    model=None,
) -> tuple[pd.DataFrame, pd.DataFrame, float]:
    """``(targets, attention, seconds)``: one row per (setting, prompt), and per (setting,
    layer, head, phase) the answer-step attention onto the needle.

    ``workers`` processes each load ``cfg.model`` once; with ``model`` (an already loaded
    uncompressed ``HookedTransformer``) everything runs in this process instead."""
    check_settings(settings, cfg.task)
    if model is not None:
        _STATE.clear()
        _STATE.update(base=model, models={})
        t0 = time.perf_counter()
        out = [_job(s, cfg, list(range(cfg.contents * cfg.task.stride)), True) for s in settings]
        _STATE.clear()
        targets = pd.concat([o[0] for o in out], ignore_index=True)
        return targets, pd.concat([o[1] for o in out], ignore_index=True), time.perf_counter() - t0
    workers = workers or min(2, os.cpu_count() or 1)
    n = cfg.contents * cfg.task.stride
    chunk = max(cfg.batch_size, -(-n // (4 * workers)))  # a few chunks per worker: balance
    jobs = []
    for s in settings:
        for i in range(0, n, chunk):
            ids = list(range(i, min(i + chunk, n)))
            jobs.append((s, ids, i == 0))
    # the first chunk of each setting also measures attention on its first prompts
    t0 = time.perf_counter()
    targets, attention = [], []
    with (
        _bar(progress) as b,
        ProcessPoolExecutor(workers, initializer=_init, initargs=(cfg.model,)) as pool,
    ):
        task = b.add_task("passkey prompts", total=n * len(settings), item="") if b else None
        futures = {pool.submit(_job, s, cfg, ids, att): (s, len(ids)) for s, ids, att in jobs}
        for fut in as_completed(futures):
            scored, pa = fut.result()
            targets.append(scored)
            if pa is not None:
                attention.append(pa)
            s, k = futures[fut]
            if b:
                b.update(task, advance=k, item=s.name)
    order = {s.name: i for i, s in enumerate(settings)}
    df = pd.concat(targets, ignore_index=True)
    df = df.sort_values(
        ["setting", "prompt_id"], key=lambda c: c.map(order) if c.name == "setting" else c
    )
    att = pd.concat(attention, ignore_index=True) if attention else pd.DataFrame()
    return df.reset_index(drop=True), att, time.perf_counter() - t0


def _bar(show: bool):
    import contextlib

    from phasemech.core.progress import progress_bar

    return progress_bar() if show else contextlib.nullcontext(None)


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
    "run_sweep",
]
