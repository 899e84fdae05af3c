"""``phasemech`` command line. Later capabilities (data, train, eval, ablate, patch, dashboard)
add their commands here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from phasemech import __version__
from phasemech.config import DESIGNS
from phasemech.model import PhaseTransformer
from phasemech.phase import phase_attention

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])
console = Console()


@app.command()
def info() -> None:
    """Version and available compression designs."""
    console.print(f"phasemech {__version__}; designs: {', '.join(DESIGNS)}")


@app.command("phase-attention")
def phase_attention_cmd(
    model_dir: Annotated[Path, typer.Argument(help="folder written by PhaseTransformer.save")],
    sequences: Annotated[int, typer.Option(min=1, help="random sequences to average over")] = 64,
    length: Annotated[int, typer.Option(min=0, help="sequence length (0: the model's n_ctx)")] = 0,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="write the tidy table (.parquet/.csv)")] = None,
) -> None:
    """Attention mass per (layer, head, source phase) on seeded random tokens."""
    torch.set_num_threads(1)
    model = PhaseTransformer.load(model_dir)
    model.eval()
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


if __name__ == "__main__":
    app()
