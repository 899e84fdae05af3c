"""Dashboard panels: everything the dashboard shows about one trained run, computed once and
cached under ``RUN/dashboard/<setting>/``.

:func:`model_panel` gathers, for one run, the per-phase accuracy with cluster-bootstrap CIs and
the debiased phase gap (:func:`phasemech.measure.evaluate.evaluate`), per-head attention mass
from the answer position onto its needle by needle phase
(:func:`phasemech.model.phase.phase_attention`, pair mode), every head's zero-ablation effect on
accuracy by phase with CIs and its specialisation statistics
(:func:`phasemech.interventions.ablation.ablate`, saved as an ablation folder), and the
effective token pattern of every head on one example sequence (needle and query marked).
:func:`build_dashboard` collects the panels of a folder of runs and renders them with
:func:`phasemech.viz.dashboard.render_dashboard`.

``phasemech dashboard RUN_DIR -o dashboard.html`` does both (RUN_DIR: one run, or a folder of
runs such as a phase sweep).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from phasemech.core.io import write_json_atomic, write_text_atomic
from phasemech.viz.dashboard import render_dashboard

if TYPE_CHECKING:
    import torch

#: bump when the panel's content changes: cached panels of another version are recomputed
PANEL_VERSION = 4
PANEL_DIR = "dashboard"


@dataclass(frozen=True)
class PanelConfig:
    """What one model's panel is computed on (part of the cache key)."""

    sequences: int = 1024  # phase-balanced test sequences (a multiple of the task stride)
    data_seed: int = 777  # the test set of phasemech.data.tasks.balanced_test_set
    n_boot: int = 400  # cluster-bootstrap draws (per-phase CIs, gap CI, ablation CIs)
    n_perm: int = 400  # permutations (gap null, specialisation test)
    seed: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            low = 0 if f.name in ("n_boot", "n_perm", "seed", "data_seed") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(
                    f"PanelConfig: {f.name}={v!r} is invalid: expected an int >= {low}"
                )


def find_runs(run_dir: str | Path) -> list[Path]:
    """Trained runs under ``run_dir``: itself if it is one (has ``train_config.json``), else the
    folders below it that are, at any depth (an experiment keeps its runs in
    ``jobs/work/<key>/<name>/``), sorted by name. Raises ``FileNotFoundError`` naming the folder
    if none."""
    root = Path(run_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder: expected a run or a folder of runs")
    if (root / "train_config.json").is_file():
        return [root]
    runs = sorted((p.parent for p in root.rglob("train_config.json")), key=lambda p: p.name)
    if not runs:
        raise FileNotFoundError(
            f"{root} holds no trained run (a folder with train_config.json, as written by "
            "`phasemech train` or `phasemech run`)"
        )
    return runs


def _r(x: Any, nd: int = 4) -> float | None:
    """A float rounded for JSON; ``None`` for NaN / missing (JSON has no NaN)."""
    if x is None or (isinstance(x, float | np.floating) and not math.isfinite(float(x))):
        return None
    if x is pd.NA:
        return None
    return round(float(x), nd)


def _example(model, ds, stride: int, offset: int, max_sequences: int = 4) -> dict[str, Any]:
    """Every head's token pattern on a few test sequences chosen so that their targets' needles
    cover every phase (MQAR puts needles at every other position, so one sequence holds only
    half the phases); each with its targets ``[needle, query]``, farthest first."""
    import torch

    from phasemech.core.device import model_device
    from phasemech.data.tasks import to_tensors
    from phasemech.model.phase import pattern_hook_name

    names = [pattern_hook_name(model, i) for i in range(model.cfg.n_layers)]
    chosen, covered = [], set()
    for i in range(min(len(ds), 8 * stride)):
        phases = {(int(sp) - offset) % stride for sp in ds[i]["source_pos"]}
        if not chosen or phases - covered:
            chosen.append(i)
            covered |= phases
        if len(covered) == stride or len(chosen) == max_sequences:
            break
    rows = ds.select(chosen)
    tokens, query_pos, _ = to_tensors(rows)
    was = getattr(model.cfg, "use_token_pattern", False)
    model.set_use_token_pattern(True)
    try:
        with torch.inference_mode():
            _, cache = model.run_with_cache(
                tokens.to(model_device(model)), names_filter=lambda n: n in names
            )
    finally:
        model.set_use_token_pattern(was)
    examples = []
    for b in range(len(chosen)):
        source = np.asarray(rows[b]["source_pos"])
        order = np.argsort(source - query_pos[b].numpy(), kind="stable")  # farthest first
        examples.append(
            {
                "tokens": tokens[b].tolist(),
                "targets": [[int(source[t]), int(query_pos[b, t])] for t in order],
                # [layer][head][query][key]; two decimals keep the file small
                "patterns": [
                    np.round(cache[n][b].float().cpu().numpy(), 2).tolist() for n in names
                ],
            }
        )
    return {"stride": int(stride), "grid_offset": int(offset), "examples": examples}


def _run_info(run: Path, cfg) -> dict[str, Any]:
    from phasemech.training.checkpoints import read_metrics

    comp = cfg.compression
    rows = [r for r in read_metrics(run) if "accuracy_by_phase" in r]
    return {
        "name": run.name,
        "design": comp.design,
        "stride": int(comp.stride),
        "window": int(comp.window) if comp.enabled else None,
        "compressed_layers": comp.compressed_layers(cfg.model.n_layers),
        "n_layers": int(cfg.model.n_layers),
        "n_heads": int(cfg.model.n_heads),
        "seq_len": int(cfg.task.seq_len),
        "seed": int(cfg.seed),
        "trained_steps": int(rows[-1]["step"]) if rows else None,
    }


def panel_dir(run: str | Path, config: PanelConfig = PanelConfig()) -> Path:
    """Where :func:`model_panel` caches a run's panel for ``config``: one folder per setting, so
    panels of different settings (the CLI's, ``make figures``') never overwrite each other."""
    c = config
    tag = f"n{c.sequences}_data{c.data_seed}_boot{c.n_boot}_perm{c.n_perm}_seed{c.seed}"
    return Path(run) / PANEL_DIR / tag


def _checkpoint_stamp(run: Path, model_dir: Path) -> dict[str, Any]:
    """Identifies the weights: path, size and mtime of the safetensors file (a run retrained in
    place to the same step gets a new panel)."""
    weights = sorted(model_dir.glob("*.safetensors"))
    stat = [[w.name, w.stat().st_size, w.stat().st_mtime_ns] for w in weights]  # JSON-shaped
    rel = str(model_dir.relative_to(run)) if model_dir.is_relative_to(run) else str(model_dir)
    return {"checkpoint": rel, "weights": stat}


def _pair_attention(model, ds, stride: int, offset: int, batch: int = 256) -> pd.DataFrame:
    """:func:`phasemech.model.phase.phase_attention` from each answer onto its needle, in batches
    (token patterns are ``O(batch * head * T^2)``), combined as count-weighted means."""
    import torch

    from phasemech.data.tasks import to_tensors
    from phasemech.model.phase import combine_frames, phase_attention

    parts = []
    for i in range(0, len(ds), batch):
        rows = ds.select(range(i, min(i + batch, len(ds))))
        tokens, query_pos, _ = to_tensors(rows)
        source = torch.tensor(rows["source_pos"])
        pa = phase_attention(
            model,
            tokens,
            query_pos=query_pos,
            key_pos=source,
            stride=stride,
            reference_offset=offset,
        )
        parts.append(pa.frame)
    return combine_frames(parts)


def _load_run(run: Path, config: PanelConfig, device: Any) -> tuple[Any, Any, Path]:
    """``(model on device, its TrainConfig, model folder)``; raises for a folder that is not a
    trained run and for a ``config`` whose set size does not fit its task."""
    from phasemech.training.checkpoints import load_trained

    model, cfg, model_dir = load_trained(run, device=device)
    if cfg is None:
        raise FileNotFoundError(f"{run} has no train_config.json: not a trained run")
    if config.sequences % cfg.task.stride:
        raise ValueError(
            f"sequences={config.sequences} is invalid for {run.name}: a phase-balanced set needs "
            f"a multiple of the task stride {cfg.task.stride}"
        )
    return model, cfg, model_dir


@dataclass(frozen=True)
class _Measured:
    """What a panel is built from: evaluation, pair attention, zero ablation, specialisation
    and the example patterns."""

    ev: Any  # phasemech.measure.evaluate.Evaluation
    pa: pd.DataFrame
    abl: Any  # phasemech.interventions.ablation.AblationResult
    spec: pd.DataFrame
    example: dict[str, Any]


def _measure(
    model, cfg, config: PanelConfig, stride: int, offset: int, threads: int | None
) -> _Measured:
    """Every measurement of the panel, on the model's device, with ``threads`` torch threads
    (``None``: torch's setting)."""
    import torch
    from threadpoolctl import threadpool_limits

    from phasemech.data.tasks import balanced_test_set
    from phasemech.interventions.ablation import ablate
    from phasemech.measure.evaluate import evaluate

    ds = balanced_test_set(cfg.task, config.sequences, config.data_seed)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with threadpool_limits(threads):
            ev = evaluate(model, ds, n_boot=config.n_boot, n_perm=config.n_perm, seed=config.seed)
            pa = _pair_attention(model, ds, stride, offset)
            abl = ablate(
                model,
                ds,
                components=("head",),
                modes=("zero",),
                n_boot=config.n_boot,
                seed=config.seed,
            )
            spec = abl.specialization(metric="accuracy", n_perm=config.n_perm, seed=config.seed)
            example = _example(model, ds, stride, offset)
    finally:
        torch.set_num_threads(before)
    return _Measured(ev, pa, abl, spec, example)


def _summary(rep, stride: int) -> dict[str, Any]:
    """Accuracy, per-phase accuracy with CIs (exactly ``stride`` entries, index = phase, None
    where undefined) and the phase gap of a :class:`phasemech.measure.stats.PhaseReport`."""
    phases = pd.Index(range(stride), name="phase")
    pp = rep.per_phase.set_index("phase").reindex(phases)
    per_phase = [
        {
            "phase": int(ph),
            "accuracy": _r(r.accuracy),
            "lo": _r(r.boot_lo),
            "hi": _r(r.boot_hi),
            "n": 0 if pd.isna(r.n) else int(r.n),
        }
        for ph, r in zip(phases, pp.itertuples(), strict=True)
    ]
    gap = rep.gap
    return {
        "accuracy": _r(rep.accuracy),
        "n": int(rep.n),
        "per_phase": per_phase,
        "raw_gap": _r(gap["raw_gap"]),
        "debiased_gap": _r(gap["debiased_gap"]),
        "gap_lo": _r(gap["debiased_lo"]),
        "gap_hi": _r(gap["debiased_hi"]),
        "p_perm": _r(gap["p_perm"]),
    }


def _heads(cfg, m: _Measured, stride: int) -> list[dict[str, Any]]:
    """One entry per head: attention mass onto the needle and zero-ablation effect per phase
    (``stride`` entries each), and the head's specialisation statistics."""
    phases = pd.Index(range(stride), name="phase")
    eff = m.abl.effects[m.abl.effects.metric == "accuracy"]
    spec_by = m.spec.set_index(["layer", "unit"])
    compressed = cfg.compression.compressed_layers(cfg.model.n_layers)
    pa = m.pa
    heads = []
    for layer in range(cfg.model.n_layers):
        for h in range(cfg.model.n_heads):
            e = eff[(eff.layer == layer) & (eff.unit == h)].set_index("phase").reindex(phases)
            mass = pa[(pa.layer == layer) & (pa["head"] == h)].set_index("phase").reindex(phases)
            s = spec_by.loc[(layer, h)]
            effect = [_r(x) for x in e["effect"]]
            defined = [x for x in effect if x is not None]
            heads.append(
                {
                    "layer": layer,
                    "head": h,
                    "label": f"L{layer}H{h}",
                    "compressed": layer in compressed,
                    "mass": [_r(x) for x in mass["mass"]],
                    "mass_n": [0 if pd.isna(x) else int(x) for x in mass["n"]],
                    "effect": effect,
                    "effect_lo": [_r(x) for x in e["ci_low"]],
                    "effect_hi": [_r(x) for x in e["ci_high"]],
                    "effect_n": [0 if pd.isna(x) else int(x) for x in e["n"]],
                    "effect_range": _r(max(defined) - min(defined)) if defined else None,
                    "overall": _r(s["overall"]),
                    "si": _r(s["si"]),
                    "p_holm": _r(s["p_holm"]),
                    "served_phase": None if pd.isna(s["served_phase"]) else int(s["served_phase"]),
                }
            )
    return heads


def model_panel(
    run: str | Path,
    config: PanelConfig = PanelConfig(),
    *,
    force: bool = False,
    threads: int | None = 1,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """The dashboard data of one trained run (JSON-ready), cached in :func:`panel_dir`.

    Reuses ``panel.json`` when it was computed with the same ``config``, panel version and
    weights, unless ``force``. Also writes, beside it, the ablation folder ``ablate``
    (:meth:`phasemech.interventions.ablation.AblationResult.save`) and ``phase_attention.parquet``.
    ``threads``: torch threads while computing (``None``: leave torch's setting; one is fastest
    on a busy 2-core machine). ``device``: where the model runs (``auto``, ``cpu``: the default,
    ``cuda`` or ``cuda:N``); a GPU's numbers agree with the CPU's to float tolerance.
    """
    from phasemech.core.grid import reference_grid

    run = Path(run)
    model, cfg, model_dir = _load_run(run, config, device)
    out = panel_dir(run, config)
    key = {
        "version": PANEL_VERSION,
        "config": dataclasses.asdict(config),
        **_checkpoint_stamp(run, model_dir),
    }
    cached = out / "panel.json"
    if cached.is_file() and not force:
        panel = json.loads(cached.read_text())
        if panel.get("key") == key:
            return panel
    stride, offset = reference_grid(cfg.compression)
    m = _measure(model, cfg, config, stride, offset, threads)
    panel = {
        "key": key,
        **_run_info(run, cfg),
        "phase_stride": int(stride),
        "grid_offset": int(offset),
        "grid_note": m.ev.grid_note,
        "summary": _summary(m.ev.report, stride),
        "heads": _heads(cfg, m, stride),
        "example": m.example,
    }
    out.mkdir(parents=True, exist_ok=True)
    m.abl.save(out / "ablate", specialization=m.spec)
    m.pa.to_parquet(out / "phase_attention.parquet")
    write_json_atomic(cached, panel)
    return panel


def collect_panels(
    run_dir: str | Path,
    config: PanelConfig = PanelConfig(),
    *,
    models: Sequence[str] | None = None,
    force: bool = False,
    progress: bool = False,
    device: str | torch.device = "cpu",
) -> list[dict[str, Any]]:
    """:func:`model_panel` of every run under ``run_dir`` (or only those named in ``models``),
    each run on ``device``."""
    runs = find_runs(run_dir)
    if models:
        names = {r.name for r in runs}
        missing = [m for m in models if m not in names]
        if missing:
            raise ValueError(
                f"models {missing} are not runs of {run_dir}; it holds {sorted(names)}"
            )
        runs = [r for r in runs if r.name in set(models)]
    panels = []
    for run in _progress(runs, progress, "dashboard data"):
        panels.append(model_panel(run, config, force=force, device=device))
    return panels


def _progress(items: list[Path], show: bool, what: str) -> Iterable[Path]:
    if not show:
        yield from items
        return
    from phasemech.core.progress import progress_bar

    with progress_bar() as bar:
        task = bar.add_task(what, total=len(items), item="")
        for run in items:
            bar.update(task, item=run.name)
            yield run
            bar.advance(task)


def build_dashboard(
    run_dir: str | Path,
    out: str | Path,
    config: PanelConfig = PanelConfig(),
    *,
    models: Sequence[str] | None = None,
    force: bool = False,
    progress: bool = False,
    title: str | None = None,
    initial: str | None = None,
    device: str | torch.device = "cpu",
) -> Path:
    """Collect every run's panel and write the dashboard to ``out`` (atomically), opening on
    the run named ``initial`` (default: the first); the models run on ``device``."""
    out = Path(out)
    if out.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"out={str(out)!r} is invalid: the dashboard is an .html file")
    panels = collect_panels(
        run_dir, config, models=models, force=force, progress=progress, device=device
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    title = title or f"phasemech: {Path(run_dir).name}"
    write_text_atomic(out, render_dashboard(panels, title, initial))
    return out


__all__ = [
    "PANEL_VERSION",
    "PanelConfig",
    "build_dashboard",
    "collect_panels",
    "find_runs",
    "model_panel",
    "panel_dir",
    "render_dashboard",
]
