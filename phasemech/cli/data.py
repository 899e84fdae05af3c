"""``phasemech data mqar|needle``: write a phase-controlled retrieval dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from phasemech.cli.base import app, console, fail, split_list

data_app = typer.Typer(no_args_is_help=True, help="Write a phase-controlled retrieval dataset.")
app.add_typer(data_app, name="data")

OutOpt = Annotated[Path, typer.Option("--out", "-o", help="folder (save_to_disk) or .parquet")]
SeqOpt = Annotated[int, typer.Option(min=1, help="number of sequences")]
BalancedOpt = Annotated[
    bool, typer.Option(help="every content at every prefix: equal counts per phase and depth")
]


def _check_data_out(out: Path) -> None:
    """``--out`` is a new path, a ``.parquet`` file (replaced atomically) or a folder that is
    empty or holds a saved dataset; anything else is someone's file and is left alone."""
    if out.is_file() and out.suffix != ".parquet":
        raise typer.BadParameter(
            f"--out {out} is an existing file: give a new folder (save_to_disk) or a .parquet path"
        )
    if out.is_dir() and any(out.iterdir()) and not (out / "state.json").is_file():
        raise typer.BadParameter(
            f"--out {out} is a folder that is not empty and holds no saved dataset: give a new "
            "or empty folder, or a .parquet path"
        )


def _write_dataset(task, sequences: int, seed: int, balanced: bool, out: Path) -> None:
    from phasemech.data.tasks import generate, save_dataset, targets_frame

    _check_data_out(out)
    try:
        ds = generate(task, sequences, seed, balanced=balanced)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    try:
        save_dataset(ds, out)
    except OSError as err:  # a full or read-only disk
        raise fail(f"{out}: {err.strerror or err}") from err
    counts = targets_frame(ds).groupby("phase").size()
    console.print(
        f"wrote {len(ds)} {task.name} sequences ({int(counts.sum())} targets) to {out}; "
        f"targets per phase (stride {task.stride}): {counts.to_dict()}"
    )


@data_app.command("mqar")
def data_mqar(
    out: OutOpt,
    sequences: SeqOpt = 4096,
    seed: int = 0,
    balanced: BalancedOpt = False,
    vocab_size: int = 64,
    seq_len: int = 64,
    pairs: int = 8,
    queries: Annotated[int | None, typer.Option(help="default: one per pair")] = None,
    stride: Annotated[int, typer.Option(help="grid the phases are logged on")] = 8,
    grid_offset: int = 0,
    jitter: Annotated[int, typer.Option(help="0..jitter fillers before each pair")] = 0,
) -> None:
    """Multi-query associative recall (Zoology conventions) with a random or balanced prefix."""
    from phasemech.data.tasks import MQARTask

    try:
        task = MQARTask(vocab_size, seq_len, pairs, queries, stride, grid_offset, jitter)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    _write_dataset(task, sequences, seed, balanced, out)


@data_app.command("needle")
def data_needle(
    out: OutOpt,
    sequences: SeqOpt = 1000,
    seed: int = 0,
    balanced: BalancedOpt = True,
    vocab_size: int = 64,
    seq_len: int = 64,
    needles: int = 1,
    distractors: int = 8,
    depths: Annotated[str, typer.Option(help="comma-separated fractions")] = "0,0.25,0.5,0.75,1",
    stride: Annotated[int, typer.Option(help="grid the phases are logged on")] = 8,
    grid_offset: int = 0,
) -> None:
    """Single- or multi-needle retrieval among distractor pairs, every phase at every depth."""
    from phasemech.data.tasks import NeedleTask

    try:
        fractions = split_list(depths, "--depths", float, "fractions like 0.1,0.5,0.9")
        task = NeedleTask(vocab_size, seq_len, needles, distractors, fractions, stride, grid_offset)
    except ValueError as err:
        raise typer.BadParameter(f"{err} (--depths {depths!r})") from err
    _write_dataset(task, sequences, seed, balanced, out)
