"""The ``phasemech`` command line's base: the one ``typer`` app every group of commands
registers on, the shared options and helpers, and the top-level commands ``info`` and
``theory``. The groups (``data``, ``training``, ``evaluate``, ``interventions``,
``experiments``, ``audit``) import this module; :mod:`phasemech.cli` imports them."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from phasemech.core.config import DESIGNS

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Does a token's phase inside a KV-compression chunk decide whether it is retrieved?",
)
console = Console()


DeviceOpt = Annotated[
    str, typer.Option(help="auto (CUDA where present, else the CPU), cpu, cuda or cuda:N")
]


def _device(device: str) -> torch.device:
    """The device a command runs on; a bad or unavailable one is a usage error, before work."""
    from phasemech.core.device import resolve_device

    try:
        return resolve_device(device)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--device") from err


def _fail(err: Exception | str) -> typer.Exit:
    """Print ``err`` as one line and return the exit to raise (status 1)."""
    # soft_wrap: one line, whatever the terminal width (the terminal wraps it for display)
    console.print(f"[red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


def _split(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(v.strip() for v in value.split(",") if v.strip())


def _layers(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError as err:
        raise ValueError(f"--layers {value!r} is invalid: expected comma-separated ints") from err


def _print_frame(df, title: str, floats: str = ".3f") -> None:
    table = Table(title=title)
    for col in df.columns:
        table.add_column(str(col), justify="right")
    for row in df.itertuples(index=False):
        table.add_row(*(f"{v:{floats}}" if isinstance(v, float) else str(v) for v in row))
    console.print(table)


def _load_model_and_data(
    checkpoint: Path, data_path: Path | None, sequences: int, data_seed: int, device: torch.device
):
    """``(model on device, dataset, model folder)``; the dataset is the run's phase-balanced
    test set unless ``--data`` (``data_path``) is given."""
    from phasemech.data.tasks import balanced_test_set, load_dataset
    from phasemech.training.checkpoints import load_trained

    model, cfg, model_dir = load_trained(checkpoint, device)
    if data_path is not None:
        return model, load_dataset(data_path), model_dir
    if cfg is None:
        raise ValueError(f"{checkpoint} is not part of a training run: pass --data")
    if sequences % cfg.task.stride:
        raise ValueError(
            f"--sequences {sequences} is invalid: the phase-balanced test set needs a multiple "
            f"of the task's stride {cfg.task.stride}"
        )
    return model, balanced_test_set(cfg.task, sequences, data_seed), model_dir


@app.command()
def info() -> None:
    """Version and available compression designs."""
    console.print(f"phasemech {version('phasemech')}; designs: {', '.join(DESIGNS)}")


@app.command()
def theory(
    out: Annotated[Path | None, typer.Option(help="also write the numbers as JSON here")] = None,
    scale: Annotated[
        float, typer.Option(min=0.001, max=1.0, help="simulation length (< 1: a quick look)")
    ] = 1.0,
) -> None:
    """Re-derive the theory model's predictions (idealized gradient flow, docs/theory.md; ~40 s)."""
    from phasemech.core.io import write_json_atomic
    from phasemech.theory.dynamics import predictions, predictions_text

    pred = predictions(scale=scale)
    console.print(predictions_text(pred), highlight=False, markup=False)  # "[x]" is text
    if out is not None:
        write_json_atomic(out, pred)
        console.print(f"wrote {out}")
