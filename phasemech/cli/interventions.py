"""``phasemech ablate`` and ``phasemech patch``: interventions on a trained model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import torch
import typer

from phasemech.cli.base import (
    LAYERS_HELP,
    DeviceOpt,
    app,
    console,
    device_option,
    fail,
    load_model_and_data,
    model_layers,
    parse_layers,
    print_frame,
    split_list,
)
from phasemech.interventions.ablation import METRICS as ABLATION_METRICS
from phasemech.interventions.ablation_plan import components_for
from phasemech.interventions.contrasts import CONTRASTS
from phasemech.interventions.contrasts import METRICS as PATCH_METRICS
from phasemech.interventions.patching import SITES


@app.command()
def ablate(
    checkpoint: Annotated[Path, typer.Argument(help="run folder, checkpoint or model folder")],
    data: Annotated[Path | None, typer.Option(help="dataset (default: the run's test set)")] = None,
    sequences: Annotated[int, typer.Option(min=1, help="test-set size without --data")] = 1024,
    data_seed: Annotated[int, typer.Option(help="test-set seed without --data")] = 777,
    components: Annotated[
        str | None,
        typer.Option(help="comma-separated: head,blocks,raw,phase_bias (default: all that apply)"),
    ] = None,
    modes: Annotated[
        str | None, typer.Option(help="comma-separated: zero,mean,resample,mask (default: all)")
    ] = None,
    layers: Annotated[str | None, typer.Option(help=LAYERS_HELP)] = None,
    metric: Annotated[Literal[ABLATION_METRICS], typer.Option()] = "accuracy",
    n_boot: int = 1000,
    n_perm: int = 1000,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="default: CHECKPOINT/ablate")] = None,
    device: DeviceOpt = "auto",
) -> None:
    """Zero/mean/resample ablation of heads and compressor parts, effect per target phase."""
    from phasemech.interventions.ablation import ablate as run_ablation

    dev = device_option(device)
    torch.set_num_threads(1)
    try:
        model, ds, model_dir = load_model_and_data(checkpoint, data, sequences, data_seed, dev)
        design = model.cfg.compression.design
        default = components_for(design)
        chosen = {"modes": split_list(modes)} if modes else {}
        result = run_ablation(
            model,
            ds,
            components=split_list(components) or tuple(default),
            **chosen,
            layers=parse_layers(layers, model_layers(model)),
            n_boot=n_boot,
            seed=seed,
            progress=True,
        )
        spec = result.specialization(metric=metric, n_perm=n_perm, seed=seed)
    except (FileNotFoundError, ValueError) as err:
        raise fail(err) from err
    dest = result.save(out or model_dir / "ablate", specialization=spec)
    cols = ["component", "mode", "layer", "unit", "overall", "phase_range", "served_phase", "si"]
    top = spec.sort_values("rank").head(12)[cols + ["p_perm", "rank"]]
    print_frame(top, f"most phase-specialised units ({metric}, stride {result.stride})")
    console.print(f"wrote {dest}/targets.parquet, effects.parquet, specialization.parquet")


@app.command()
def patch(
    checkpoint: Annotated[Path, typer.Argument(help="run folder, checkpoint or model folder")],
    contrast: Annotated[Literal[CONTRASTS], typer.Option()] = "grid",
    shift: Annotated[
        int | None, typer.Option(help="grid/content shift (default: stride // 2)")
    ] = None,
    site: Annotated[
        Literal[tuple(SITES)], typer.Option(help="z: head outputs; q; k, v: per KV head")
    ] = "z",
    by_pos: Annotated[bool, typer.Option(help="one position at a time")] = False,
    metric: Annotated[Literal[PATCH_METRICS], typer.Option()] = "logit_diff",
    pairs: Annotated[int, typer.Option(min=1, help="clean/corrupted pairs")] = 256,
    attribution: Annotated[
        bool, typer.Option(help="also attribution patching vs exact _by_pos (site z)")
    ] = False,
    layers: Annotated[str | None, typer.Option(help=LAYERS_HELP)] = None,
    data: Annotated[Path | None, typer.Option(help="dataset (default: the run's test set)")] = None,
    data_seed: Annotated[int, typer.Option(help="test-set seed without --data")] = 777,
    seed: int = 0,
    out: Annotated[
        Path | None, typer.Option(help="default: CHECKPOINT/patch_<contrast>_<site>")
    ] = None,
    device: DeviceOpt = "auto",
) -> None:
    """Activation patching by phase contrast: per (layer, head) effect per target phase."""
    dev = device_option(device)
    torch.set_num_threads(1)
    try:
        model, pairs_, model_dir = _contrast_pairs(
            checkpoint, contrast, shift, pairs, data, data_seed, seed, dev
        )
        kw = dict(metric=metric, layers=parse_layers(layers, model_layers(model)), progress=True)
        result, comparison = _patch(model, pairs_, site, by_pos, attribution, kw)
    except (FileNotFoundError, ValueError) as err:
        raise fail(err) from err
    dest = result.save(out or model_dir / f"patch_{contrast}_{site}")
    console.print(
        f"{len(pairs_)} {contrast} pairs, metric {metric}: clean {result.clean.mean():.3f}, "
        f"corrupted {result.corrupted.mean():.3f}; {result.n_run} patched copies run"
    )
    effects = result.frame()
    if result.by_pos:  # summarise per unit: the position with the largest effect
        strongest = effects.assign(size=effects.effect.abs()).dropna(subset=["size"])
        strongest = strongest.loc[strongest.groupby(["layer", "unit"])["size"].idxmax()]
        effects = strongest.drop(columns="size")
    print_frame(effects.reset_index(drop=True), f"{site} patches (normalised: 1 = restored)")
    if comparison is not None:
        comparison.to_parquet(dest / "attribution.parquet")
        print_frame(comparison, "attribution patching vs exact")
    console.print(f"wrote {dest}/effects.parquet, by_phase.parquet, pairs.parquet, values.parquet")


def _contrast_pairs(checkpoint, contrast, shift, pairs, data, data_seed, seed, dev):
    """``(model, contrast pairs, model folder)`` on the model's reference grid."""
    from phasemech.core.grid import reference_grid
    from phasemech.interventions.contrasts import make_contrast
    from phasemech.training.checkpoints import resolve_checkpoint

    _, cfg = resolve_checkpoint(checkpoint)
    # enough balanced sequences for the pairs (a multiple of the task's stride)
    step = cfg.task.stride if cfg is not None else 1
    n_seq = -(-pairs // step) * step
    model, ds, model_dir = load_model_and_data(checkpoint, data, n_seq, data_seed, dev)
    stride, offset = reference_grid(model.cfg.compression)
    ds = ds.shuffle(seed=seed)  # balanced sets come in blocks of one content
    made = make_contrast(
        ds, contrast, stride=stride, grid_offset=offset, shift=shift,
        n_pairs=min(pairs, len(ds)), seed=seed,
    )  # fmt: skip
    return model, made, model_dir


def _patch(model, pairs_, site: str, by_pos: bool, attribution: bool, kw: dict):
    """Exact patching of ``site`` (the fast engine for head outputs), and with ``attribution``
    AtP against the exact position-resolved patches."""
    from phasemech.interventions.attribution import attribution_patch, compare_attribution
    from phasemech.interventions.patching import patch_sites
    from phasemech.interventions.patching_fast import patch_heads

    if attribution and site != "z":
        raise ValueError("--attribution needs --site z")
    if site == "z":
        result = patch_heads(model, pairs_, by_pos=attribution or by_pos, **kw)
    else:
        result = patch_sites(model, pairs_, site=site, by_pos=by_pos, **kw)
    if not attribution:
        return result, None
    atp = attribution_patch(model, pairs_, metric=kw["metric"], progress=True)
    return result, compare_attribution(atp, result)
