"""The ``phasemech`` command line's base: the one ``typer`` app every group of commands
registers on, the shared options and helpers, and the top-level commands ``info`` and
``theory``. The groups (``data``, ``training``, ``evaluate``, ``interventions``,
``experiments``, ``audit``) import this module; :mod:`phasemech.cli` imports them."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from phasemech.core.config import DESIGNS, LAYER_KINDS

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Does a token's phase inside a KV-compression chunk decide whether it is retrieved?",
)
console = Console()


DeviceOpt = Annotated[
    str, typer.Option(help="auto (CUDA where present, else the CPU), cpu, cuda or cuda:N")
]


def device_option(device: str) -> torch.device:
    """The device a command runs on; a bad or unavailable one is a usage error, before work."""
    from phasemech.core.device import resolve_device

    try:
        return resolve_device(device)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--device") from err


def fail(err: Exception | str) -> typer.Exit:
    """Print ``err`` as one line and return the exit to raise (status 1)."""
    # soft_wrap: one line, whatever the terminal width (the terminal wraps it for display)
    console.print(f"[red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
    return typer.Exit(1)


def split_list(
    value: str | None, flag: str = "", item: Callable[[str], Any] = str, expected: str = ""
) -> tuple | None:
    """The one comma-list parser of every command: ``"a, b,c"`` as ``item`` of each part
    (``None`` stays ``None``); a part ``item`` rejects is a one-line ``ValueError`` naming
    ``flag``, the value and what is ``expected`` (the command prints it and exits 1)."""
    if value is None:
        return None
    try:
        return tuple(item(v.strip()) for v in value.split(",") if v.strip())
    except ValueError:
        what = expected or "a comma-separated list"
        raise ValueError(f"{flag} {value!r} is invalid: expected {what}".strip()) from None


#: every command's ``--layers`` help: the one grammar of :func:`parse_layers`
LAYERS_HELP = "layers: ints and ranges, e.g. 2-29 or 0,3-5, or global / local / all (by layer type)"


def model_layers(model) -> Callable[[str], tuple[int, ...]]:
    """``parse_layers``' resolver of ``global``/``local``/``all`` on a TransformerLens model."""
    from phasemech.core.config import layer_types, layers_of_kind

    return lambda kind: layers_of_kind(layer_types(model.cfg), kind)


def _int_range(part: str) -> list[int]:
    lo, sep, hi = part.partition("-")
    return list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]


def parse_ints(value: str | None, flag: str) -> tuple[int, ...] | None:
    """``"512,2048"`` or ranges ``"2-29"`` as ints (``split_list`` of ints and ranges)."""
    parts = split_list(value, flag, _int_range, "ints or ranges like 2-29")
    return None if parts is None else tuple(i for part in parts for i in part)


def parse_layers(
    value: str | None, named: Callable[[str], tuple[int, ...]] | None = None, flag="--layers"
) -> tuple[int, ...] | None:
    """The one ``--layers`` grammar of every command: ints and ranges (``2-29``, ``0,3-5``),
    or one of ``global``, ``local``, ``all`` (the model's layers of that type, resolved by
    ``named``: a command without a model to read refuses the names). Bad input is a one-line
    ``ValueError`` naming the flag and the value."""
    if value is None or value.strip() not in LAYER_KINDS:
        return parse_ints(value, flag)
    if named is None:
        kinds = "/".join(LAYER_KINDS)
        raise ValueError(f"{flag} {value!r} is invalid here: {kinds} need a model; give ints")
    return named(value.strip())


def print_frame(df, title: str, floats: str = ".3f") -> None:
    """A frame as a rich table (floats as ``floats``)."""
    table = Table(title=title)
    for col in df.columns:
        table.add_column(str(col), justify="right")
    for row in df.itertuples(index=False):
        table.add_row(*(f"{v:{floats}}" if isinstance(v, float) else str(v) for v in row))
    console.print(table)


def load_model_and_data(
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
