"""``phasemech train``: train a model from scratch, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from phasemech.cli.base import (
    LAYERS_HELP,
    DeviceOpt,
    app,
    console,
    device_option,
    fail,
    parse_layers,
)
from phasemech.core.config import DESIGNS, OFFSET_MODES, TOP_K_DESIGNS, layers_of_kind

#: compression fields whose default depends on the design: reset when ``--design`` changes it
DESIGN_DEFAULTED = (
    "block_len", "block_scope", "top_k", "obs_window", "select_len", "index_heads",
    "indexer_train", "pool_rope",
)  # fmt: skip

PosInt = Annotated[int | None, typer.Option(min=1)]


@app.command()
def train(
    out: Annotated[Path, typer.Option("--out", "-o", help="run folder")],
    config: Annotated[Path | None, typer.Option(help="TrainConfig JSON (flags override)")] = None,
    resume: Annotated[bool, typer.Option(help="continue from the last checkpoint")] = False,
    design: Annotated[Literal[DESIGNS] | None, typer.Option()] = None,
    stride: PosInt = None,
    window: Annotated[int | None, typer.Option(min=0, help="raw window (default 2*stride)")] = None,
    layers: Annotated[str | None, typer.Option(help=f"compressed {LAYERS_HELP}")] = None,
    offsets: Annotated[Literal[OFFSET_MODES] | None, typer.Option()] = None,
    heads: PosInt = None,
    d_model: PosInt = None,
    n_layers: PosInt = None,
    seq_len: PosInt = None,
    pairs: PosInt = None,
    jitter: Annotated[int | None, typer.Option(min=0)] = None,
    steps: PosInt = None,
    batch_size: PosInt = None,
    lr: float | None = None,
    weight_decay: Annotated[float | None, typer.Option(min=0)] = None,
    schedule: Annotated[Literal["constant", "cosine"] | None, typer.Option()] = None,
    warmup_steps: Annotated[int | None, typer.Option(min=0)] = None,
    prefix_warmup: Annotated[
        int | None,
        typer.Option(min=0, help="steps over which the data's prefix spread widens to the stride"),
    ] = None,
    selection_warmup: Annotated[
        int | None,
        typer.Option(min=0, help="steps during which selecting layers keep every block (DSA)"),
    ] = None,
    eval_every: PosInt = None,
    eval_sequences: Annotated[
        int | None,
        typer.Option(min=1, help="held-out set size (default: 512 rounded up to the task stride)"),
    ] = None,
    target_accuracy: float | None = None,
    seed: int | None = None,
    threads: PosInt = None,
    device: DeviceOpt = "auto",
) -> None:
    """Train a model from scratch on MQAR (progress shows held-out accuracy per phase)."""
    from phasemech.training.trainer import train as run_train

    dev = device_option(device)
    flags = dict(
        design=design, stride=stride, window=window, layers=layers, offsets=offsets, heads=heads,
        d_model=d_model, n_layers=n_layers, seq_len=seq_len, pairs=pairs, jitter=jitter,
        steps=steps, batch_size=batch_size, lr=lr, weight_decay=weight_decay,
        schedule=schedule, warmup_steps=warmup_steps, prefix_warmup=prefix_warmup,
        selection_warmup=selection_warmup,
        eval_every=eval_every, eval_sequences=eval_sequences, target_accuracy=target_accuracy,
        seed=seed, threads=threads,
    )  # fmt: skip
    try:
        cfg = _train_config(out, config, resume, flags)
    except (ValueError, TypeError, OSError) as err:
        raise typer.BadParameter(str(err)) from err
    if cfg.compression.design == "dsa" and not cfg.selection_warmup:
        # trained sparse from the start, its random indexer kept a model on the loss plateau
        console.print(
            "[yellow]dsa without a dense warm-up: its indexer starts random and models stayed "
            "on the loss plateau; consider --selection-warmup 500 (docs/training.md)[/]"
        )
    try:
        result = run_train(cfg, out, resume=resume, device=dev)
    except (OSError, ValueError) as err:  # a foreign folder, a corrupt run, a full disk
        raise fail(err) from err
    phases = " ".join(f"{p:.3f}" for p in result.accuracy_by_phase)
    console.print(
        f"step {result.step}: held-out accuracy {result.accuracy:.3f} (by phase {phases})"
        f"{' (early stop)' if result.stopped_early else ''}; checkpoint {result.checkpoint}"
    )


def _train_config(out: Path, config: Path | None, resume: bool, flags: dict):
    """The run's ``TrainConfig``: the ``--config`` file, else the run's own config when
    resuming, else the defaults; then the flags given on the command line."""
    import dataclasses

    from phasemech.core.config import CompressionConfig
    from phasemech.training.checkpoints import CONFIG_NAME
    from phasemech.training.config import TrainConfig, default_eval_sequences

    source = config or (out / CONFIG_NAME if resume and (out / CONFIG_NAME).is_file() else None)
    cfg = TrainConfig() if source is None else TrainConfig.load(source)
    f = _given(**flags)
    task = dataclasses.replace(
        cfg.task, **_pick(f, seq_len="seq_len", pairs="n_pairs", jitter="jitter")
    )
    model = dataclasses.replace(
        cfg.model, **_pick(f, heads="n_heads", d_model="d_model", n_layers="n_layers")
    )
    comp = cfg.compression.to_dict()
    if f.get("design", comp["design"]) != comp["design"]:
        # another design: its own defaults for the fields that depend on the design
        comp.update(dict.fromkeys(DESIGN_DEFAULTED, None))
    comp.update(_pick(f, design="design", stride="stride", window="window", offsets="offsets"))
    if "layers" in f:  # the one grammar; the lab's layers are all global (full attention)
        named = lambda kind: layers_of_kind(["global"] * model.n_layers, kind)  # noqa: E731
        layers = parse_layers(f["layers"] or None, named)
        comp["layers"] = None if layers is None else list(layers)
    if "stride" in f:  # derived fields follow the new stride unless given
        comp["block_len"] = None
        if "window" not in f:
            comp["window"] = None
        if task.stride != f["stride"] and not resume:
            # the task's random prefix spans one stride: phases balanced on the model's grid with
            # the least positional spread (a prefix spread over a wider stride than the model's
            # keeps models on the loss plateau far longer, see docs/training.md)
            task = dataclasses.replace(task, stride=f["stride"])
    if comp["design"] not in TOP_K_DESIGNS:
        comp["top_k"] = None
    if comp["design"] != "evict":
        comp["obs_window"] = None
    default = default_eval_sequences(cfg.task.stride)
    if (
        "eval_sequences" not in f
        and cfg.eval_sequences == default
        and task.stride != cfg.task.stride
    ):
        # the default held-out size (never set, or a run's config that kept it) follows the
        # new task stride; a size the user chose stays, and an invalid one is an error
        f["eval_sequences"] = None
    keys = ("steps", "batch_size", "lr", "weight_decay", "schedule", "warmup_steps",
            "prefix_warmup", "selection_warmup", "eval_every", "eval_sequences",
            "target_accuracy", "seed", "threads")  # fmt: skip
    return dataclasses.replace(
        cfg,
        task=task,
        model=model,
        compression=CompressionConfig.from_dict(comp),
        **{k: f[k] for k in keys if k in f},
    )


def _pick(given: dict, **names: str) -> dict:
    """``{field: given[flag]}`` for each ``flag=field`` that was given."""
    return {field: given[flag] for flag, field in names.items() if flag in given}


def _given(**kwargs):
    return {k: v for k, v in kwargs.items() if v is not None}
