"""``phasemech`` command line: ``info``, ``phase-attention``, ``data``, ``train``, ``eval``,
``ablate``, ``patch``, ``dashboard``, ``sweep-pretrained``."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, Literal

import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from phasemech.core.config import DESIGNS, OFFSET_MODES, SELECTING_DESIGNS
from phasemech.interventions.ablation import METRICS as ABLATION_METRICS
from phasemech.interventions.contrasts import CONTRASTS
from phasemech.interventions.contrasts import METRICS as PATCH_METRICS
from phasemech.interventions.patching import SITES
from phasemech.model.phase import phase_attention

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])
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
    console.print(f"[red]error:[/] {escape(str(err))}", highlight=False)
    return typer.Exit(1)


@app.command()
def info() -> None:
    """Version and available compression designs."""
    console.print(f"phasemech {version('phasemech')}; designs: {', '.join(DESIGNS)}")


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

    dev = _device(device)
    torch.set_num_threads(1)
    try:
        model, _, model_dir = load_trained(model_dir, dev)
    except (FileNotFoundError, ValueError) as err:
        raise _fail(err) from err
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


# ------------------------------------------------------------------------------------ data

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
        raise _fail(f"{out}: {err.strerror or err}") from err
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
        fractions = tuple(float(x) for x in depths.split(","))
        task = NeedleTask(vocab_size, seq_len, needles, distractors, fractions, stride, grid_offset)
    except ValueError as err:
        raise typer.BadParameter(f"{err} (--depths {depths!r})") from err
    _write_dataset(task, sequences, seed, balanced, out)


# ----------------------------------------------------------------------------------- train


PosInt = Annotated[int | None, typer.Option(min=1)]


@app.command()
def train(
    out: Annotated[Path, typer.Option("--out", "-o", help="run folder")],
    config: Annotated[Path | None, typer.Option(help="TrainConfig JSON (flags override)")] = None,
    resume: Annotated[bool, typer.Option(help="continue from the last checkpoint")] = False,
    design: Annotated[Literal[DESIGNS] | None, typer.Option()] = None,
    stride: PosInt = None,
    window: Annotated[int | None, typer.Option(min=0, help="raw window (default 2*stride)")] = None,
    layers: Annotated[str | None, typer.Option(help="compressed layers, e.g. '1'")] = None,
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
    warmup_steps: Annotated[int | None, typer.Option(min=0)] = None,
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

    dev = _device(device)
    flags = dict(
        design=design, stride=stride, window=window, layers=layers, offsets=offsets, heads=heads,
        d_model=d_model, n_layers=n_layers, seq_len=seq_len, pairs=pairs, jitter=jitter,
        steps=steps, batch_size=batch_size, lr=lr, warmup_steps=warmup_steps,
        eval_every=eval_every, eval_sequences=eval_sequences, target_accuracy=target_accuracy,
        seed=seed, threads=threads,
    )  # fmt: skip
    try:
        cfg = _train_config(out, config, resume, flags)
    except (ValueError, TypeError, OSError) as err:
        raise typer.BadParameter(str(err)) from err
    try:
        result = run_train(cfg, out, resume=resume, device=dev)
    except (OSError, ValueError) as err:  # a foreign folder, a corrupt run, a full disk
        raise _fail(err) from err
    phases = " ".join(f"{p:.3f}" for p in result.accuracy_by_phase)
    console.print(
        f"step {result.step}: held-out accuracy {result.accuracy:.3f} (by phase {phases})"
        f"{' (early stop)' if result.stopped_early else ''}; checkpoint {result.checkpoint}"
    )


def _train_config(out: Path, config: Path | None, resume: bool, flags: dict):
    """The run's ``TrainConfig``: the ``--config`` file, else the run's own config when
    resuming, else the defaults; then the flags given on the command line."""
    import dataclasses
    import math

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
    comp.update(_pick(f, design="design", stride="stride", window="window", offsets="offsets"))
    if "layers" in f:
        try:
            comp["layers"] = [int(x) for x in f["layers"].split(",")] if f["layers"] else None
        except ValueError as err:
            raise ValueError(
                f"--layers {f['layers']!r} is invalid: expected ints like 0,1"
            ) from err
    if "stride" in f:  # derived fields follow the new stride unless given
        comp["block_len"] = None
        if "window" not in f:
            comp["window"] = None
        if task.stride % f["stride"]:
            # keep phases balanced on the new grid: the task stride must be a multiple of it
            task = dataclasses.replace(task, stride=math.lcm(task.stride, f["stride"]))
    if comp["design"] not in SELECTING_DESIGNS:
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
    keys = ("steps", "batch_size", "lr", "warmup_steps", "eval_every", "eval_sequences",
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


# ------------------------------------------------------------------------------------ eval


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
    from phasemech.data.tasks import balanced_test_set, load_dataset, task_of
    from phasemech.measure.evaluate import evaluate
    from phasemech.training.checkpoints import load_trained

    dev = _device(device)
    torch.set_num_threads(1)
    try:
        model, cfg, model_dir = load_trained(checkpoint, dev)
        if data is not None:
            ds = load_dataset(data)
        elif cfg is not None:
            ds = balanced_test_set(cfg.task, sequences, data_seed)
        else:
            raise ValueError(f"{checkpoint} is not part of a training run: pass --data")
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
        raise _fail(err) from err
    task = task_of(ds)
    console.print(
        f"model {model_dir}; data: {task.name if task else 'dataset'} "
        f"({len(ds)} sequences); phases on {evaluation.grid_note}"
    )
    console.print(evaluation.report.summary())
    dest = evaluation.save(out or model_dir / "eval")
    console.print(f"wrote {dest}/targets.parquet, per_phase.parquet, report.json")


# ------------------------------------------------------------------------- interventions


def _load_for_intervention(
    checkpoint: Path, data: Path | None, sequences: int, data_seed: int, device: torch.device
):
    """``(model on device, dataset, model folder)``; the dataset is the run's phase-balanced
    test set unless ``--data`` is given."""
    from phasemech.data.tasks import balanced_test_set, load_dataset
    from phasemech.training.checkpoints import load_trained

    model, cfg, model_dir = load_trained(checkpoint, device)
    if data is not None:
        return model, load_dataset(data), model_dir
    if cfg is None:
        raise ValueError(f"{checkpoint} is not part of a training run: pass --data")
    if sequences % cfg.task.stride:
        raise ValueError(
            f"--sequences {sequences} is invalid: the phase-balanced test set needs a multiple "
            f"of the task's stride {cfg.task.stride}"
        )
    return model, balanced_test_set(cfg.task, sequences, data_seed), model_dir


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
    layers: Annotated[
        str | None, typer.Option(help="comma-separated layers (default: all)")
    ] = None,
    metric: Annotated[Literal[ABLATION_METRICS], typer.Option()] = "accuracy",
    n_boot: int = 1000,
    n_perm: int = 1000,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="default: CHECKPOINT/ablate")] = None,
    device: DeviceOpt = "auto",
) -> None:
    """Zero/mean/resample ablation of heads and compressor parts, effect per target phase."""
    from phasemech.interventions.ablation import ablate as run_ablation

    dev = _device(device)
    torch.set_num_threads(1)
    try:
        model, ds, model_dir = _load_for_intervention(checkpoint, data, sequences, data_seed, dev)
        design = model.cfg.compression.design
        default = ["head"]
        if design != "none":
            default += ["blocks"] + (["raw"] if design not in SELECTING_DESIGNS else [])
            default += ["phase_bias"] if design == "gated" else []
        chosen = {"modes": _split(modes)} if modes else {}
        result = run_ablation(
            model,
            ds,
            components=_split(components) or tuple(default),
            **chosen,
            layers=_layers(layers),
            n_boot=n_boot,
            seed=seed,
            progress=True,
        )
        spec = result.specialization(metric=metric, n_perm=n_perm, seed=seed)
    except (FileNotFoundError, ValueError) as err:
        raise _fail(err) from err
    dest = result.save(out or model_dir / "ablate", specialization=spec)
    cols = ["component", "mode", "layer", "unit", "overall", "phase_range", "served_phase", "si"]
    top = spec.sort_values("rank").head(12)[cols + ["p_perm", "rank"]]
    _print_frame(top, f"most phase-specialised units ({metric}, stride {result.stride})")
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
    layers: Annotated[
        str | None, typer.Option(help="comma-separated layers (default: all)")
    ] = None,
    data: Annotated[Path | None, typer.Option(help="dataset (default: the run's test set)")] = None,
    data_seed: Annotated[int, typer.Option(help="test-set seed without --data")] = 777,
    seed: int = 0,
    out: Annotated[
        Path | None, typer.Option(help="default: CHECKPOINT/patch_<contrast>_<site>")
    ] = None,
    device: DeviceOpt = "auto",
) -> None:
    """Activation patching by phase contrast: per (layer, head) effect per target phase."""
    dev = _device(device)
    torch.set_num_threads(1)
    try:
        model, pairs_, model_dir = _contrast_pairs(
            checkpoint, contrast, shift, pairs, data, data_seed, seed, dev
        )
        kw = dict(metric=metric, layers=_layers(layers), progress=True)
        result, comparison = _patch(model, pairs_, site, by_pos, attribution, kw)
    except (FileNotFoundError, ValueError) as err:
        raise _fail(err) from err
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
    _print_frame(effects.reset_index(drop=True), f"{site} patches (normalised: 1 = restored)")
    if comparison is not None:
        comparison.to_parquet(dest / "attribution.parquet")
        _print_frame(comparison, "attribution patching vs exact")
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
    model, ds, model_dir = _load_for_intervention(checkpoint, data, n_seq, data_seed, dev)
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


@app.command()
def dashboard(
    run_dir: Annotated[Path, typer.Argument(help="a trained run, or a folder of runs (a sweep)")],
    out: Annotated[Path, typer.Option("-o", "--out", help="the HTML file to write")] = Path(
        "dashboard.html"
    ),
    models: Annotated[
        str | None, typer.Option(help="comma-separated run names (default: every run)")
    ] = None,
    sequences: Annotated[int, typer.Option(min=1, help="phase-balanced test sequences")] = 1024,
    data_seed: Annotated[int, typer.Option(help="test-set seed")] = 777,
    n_boot: Annotated[int, typer.Option(min=0, help="bootstrap draws for CIs")] = 400,
    n_perm: Annotated[int, typer.Option(min=0, help="permutations for the tests")] = 400,
    seed: int = 0,
    force: Annotated[bool, typer.Option(help="recompute cached panels")] = False,
) -> None:
    """One self-contained HTML dashboard (plotly.js inlined) for head-attribution exploration."""
    from phasemech.experiments.panels import PanelConfig, build_dashboard

    try:
        config = PanelConfig(
            sequences=sequences, data_seed=data_seed, n_boot=n_boot, n_perm=n_perm, seed=seed
        )
        dest = build_dashboard(
            run_dir, out, config, models=_split(models), force=force, progress=True
        )
    except (FileNotFoundError, ValueError) as err:
        raise _fail(err) from err
    size = dest.stat().st_size / 1e6
    console.print(f"wrote {dest} ({size:.1f} MB, self-contained: open it in any browser)")


@app.command("sweep-pretrained")
def sweep_pretrained(
    profile: Annotated[str, typer.Option(help="default, map, full or tiny")] = "default",
    runs: Annotated[Path, typer.Option(help="results go to RUNS/pretrained_<profile>/")] = Path(
        "runs"
    ),
    workers: Annotated[
        int, typer.Option(min=1, help="CPUs of the embedded Ray (each worker loads the model)")
    ] = 2,
    address: Annotated[str | None, typer.Option(help="join this Ray cluster instead")] = None,
) -> None:
    """Passkey accuracy by needle phase on SmolLM2-135M, uncompressed and post-hoc compressed
    (the ``pretrained`` experiment: the same as ``phasemech run pretrained``)."""
    out = _launch("pretrained", profile, runs, address, workers, 1, 0)
    console.print((out.folder / "summary.md").read_text(), markup=False, highlight=False)


@app.command("run")
def run_experiment(
    name: Annotated[str, typer.Argument(metavar="EXPERIMENT", help="e.g. phase_sweep")],
    profile: Annotated[str, typer.Option(help="the experiment's profile (tiny: seconds)")] = "tiny",
    runs: Annotated[Path, typer.Option(help="results go to RUNS/<experiment>_<profile>/")] = Path(
        "runs"
    ),
    address: Annotated[
        str | None, typer.Option(help="join this Ray cluster (default: an embedded local Ray)")
    ] = None,
    num_cpus: Annotated[int | None, typer.Option(min=1, help="embedded Ray's CPUs")] = None,
    cpus_per_job: Annotated[int, typer.Option(min=1, help="CPUs (torch threads) per job")] = 1,
    gpus_per_job: Annotated[float, typer.Option(min=0, help="GPUs per job")] = 0,
    device: Annotated[
        str, typer.Option(help="auto (CUDA in a job that holds a GPU), cpu, cuda or cuda:N")
    ] = "auto",
) -> None:
    """Run an experiment on Ray: its stages of jobs, then its tables. Finished jobs are cached;
    a rerun runs only what is missing."""
    _launch(name, profile, runs, address, num_cpus, cpus_per_job, gpus_per_job, device)


def _launch(name, profile, runs, address, num_cpus, cpus_per_job, gpus_per_job, device="auto"):
    """Run experiment ``name`` at ``profile``; failures printed with their configs, exit 1."""
    from phasemech.core.device import check_device_name
    from phasemech.experiments import experiment
    from phasemech.experiments.experiment import run_experiment as run

    try:
        exp = experiment(name)
        exp.profile(profile)
        check_device_name(device)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    try:
        out = run(
            exp,
            profile,
            runs,
            address=address,
            num_cpus=num_cpus,
            cpus_per_job=cpus_per_job,
            gpus_per_job=gpus_per_job,
            device=device,
        )
    except (ConnectionError, OSError, ValueError) as err:
        raise _fail(err) from err
    for failure in out.failures:
        console.print(
            f"[red]failed[/] {escape(failure.label)}: {escape(json.dumps(failure.config))}"
        )
        console.print(escape(failure.error), highlight=False)
    console.print(
        f"{name} ({profile}): {out.ran} jobs run, {out.cached} cached; results in "
        f"{out.folder} ({out.seconds:.1f} s)"
    )
    if out.failures:
        raise typer.Exit(1)
    return out


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


if __name__ == "__main__":
    app()
