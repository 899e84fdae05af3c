"""``phasemech eval`` and ``phasemech phase-attention``: measure a trained model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.table import Table

from phasemech.cli.base import DeviceOpt, app, console, device_option, fail, load_model_and_data
from phasemech.model.phase import phase_attention


@app.command("phase-attention")
def phase_attention_cmd(
    model_dir: Annotated[Path, typer.Argument(help="run folder, checkpoint or model folder")],
    sequences: Annotated[int, typer.Option(min=1, help="random sequences to average over")] = 64,
    length: Annotated[int, typer.Option(min=0, help="sequence length (0: the model's n_ctx)")] = 0,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="write the tidy table (.parquet/.csv)")] = None,
    device: DeviceOpt = "auto",
) -> None:
    """Attention mass per (layer, head, source phase) on seeded random tokens."""
    from phasemech.training.checkpoints import load_trained

    dev = device_option(device)
    torch.set_num_threads(1)
    try:
        model, _, model_dir = load_trained(model_dir, dev)
    except (FileNotFoundError, ValueError) as err:
        raise fail(err) from err
    seq = length or model.cfg.n_ctx
    if seq > model.cfg.n_ctx:
        raise typer.BadParameter(f"--length {seq} exceeds the model's n_ctx={model.cfg.n_ctx}")
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.cfg.d_vocab, (sequences, seq), generator=gen)
    pa = phase_attention(model, tokens)
    table = Table(title=f"attention mass by source phase (stride {pa.stride})")
    wide = pa.table()
    table.add_column("head")
    for phase in wide.columns:
        table.add_column(f"phase {phase}", justify="right")
    for name, row in wide.iterrows():
        table.add_row(str(name), *(f"{v:.3f}" for v in row))
    console.print(table)
    if out is not None:
        if out.suffix == ".csv":
            pa.frame.to_csv(out, index=False)
        else:
            pa.frame.to_parquet(out)
        console.print(f"wrote {out}")


@app.command("eval")
def eval_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="run folder, checkpoint or model folder")],
    data: Annotated[Path | None, typer.Option(help="dataset (default: the run's test set)")] = None,
    sequences: Annotated[int, typer.Option(min=1, help="test-set size without --data")] = 4096,
    data_seed: Annotated[int, typer.Option(help="test-set seed without --data")] = 777,
    stride: Annotated[int | None, typer.Option(help="report on this grid stride")] = None,
    grid_offset: Annotated[int | None, typer.Option(help="report on this grid offset")] = None,
    n_boot: int = 1000,
    n_perm: int = 1000,
    seed: int = 0,
    out: Annotated[
        Path | None,
        typer.Option(help="default: eval/ in the model folder (a run: its last checkpoint)"),
    ] = None,
    device: DeviceOpt = "auto",
) -> None:
    """Per-phase accuracy with the full statistics template (parquet + JSON)."""
    from phasemech.data.tasks import task_of
    from phasemech.measure.evaluate import evaluate

    dev = device_option(device)
    torch.set_num_threads(1)
    try:
        model, ds, model_dir = load_model_and_data(checkpoint, data, sequences, data_seed, dev)
        evaluation = evaluate(
            model,
            ds,
            stride=stride,
            grid_offset=grid_offset,
            seed=seed,
            n_boot=n_boot,
            n_perm=n_perm,
        )
    except (FileNotFoundError, ValueError) as err:
        raise fail(err) from err
    task = task_of(ds)
    console.print(
        f"model {model_dir}; data: {task.name if task else 'dataset'} "
        f"({len(ds)} sequences); phases on {evaluation.grid_note}"
    )
    console.print(evaluation.report.summary())
    dest = evaluation.save(out or model_dir / "eval")
    console.print(f"wrote {dest}/targets.parquet, per_phase.parquet, report.json")
