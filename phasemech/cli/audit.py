"""``phasemech audit`` and ``phasemech explain``: the per-phase retrieval audit of compression
designs on a real model, and the causal explanation of its weak phase."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from phasemech.cli.base import DeviceOpt, _device, _fail, app, console

LAYERS_HELP = "compressed layers: e.g. 2-29, or global / local / all (by the model's layer types)"


def _layer_set(value: str | None, model: str) -> tuple[int, ...] | None:
    """``--layers``: ints and ranges, or ``global``, ``local`` or ``all`` (the model's layers
    of that kind, read from its config)."""
    if value is None or value.strip() not in ("global", "local", "all"):
        return None if value is None else _ints(value, "--layers")
    from phasemech.model.sources import describe

    try:
        return describe(model).layers(value.strip())
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--layers") from None


def _ints(value: str, flag: str) -> tuple[int, ...]:
    """``"512,2048"`` or ranges ``"2-29"`` as ints; a one-line error names the flag."""
    out: list[int] = []
    try:
        for part in (p.strip() for p in value.split(",") if p.strip()):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        msg = f"{value!r}: expected ints or ranges like 2-29"
        raise typer.BadParameter(msg, param_hint=flag) from None
    return tuple(out)


def _depths(value: str) -> tuple[float, ...]:
    """``"0.1,0.5"`` as floats; a one-line error names the flag (the range is the config's)."""
    try:
        return tuple(float(x) for x in value.split(",") if x.strip())
    except ValueError:
        msg = f"{value!r}: expected fractions like 0.1,0.5,0.9"
        raise typer.BadParameter(msg, param_hint="--depths") from None


def _variants(fix: str | None) -> tuple[str, ...]:
    """``--fix``: the aligned baseline first, then the named fixes (``all``: every fix)."""
    from phasemech.experiments.audit.fixes import FIXES

    if fix is None:
        return ("aligned",)
    names = [f.strip() for f in fix.split(",") if f.strip()]
    names = list(FIXES) if names == ["all"] else [n for n in names if n != "aligned"]
    if not names:
        msg = f"{fix!r} names no fix: allowed 'all' or any of {', '.join(FIXES)}"
        raise typer.BadParameter(msg, param_hint="--fix")
    return ("aligned", *names)


@app.command()
def audit(
    design: Annotated[
        str, typer.Option(help="mean, route, evict, quest, kpool, partition (comma-list)")
    ],
    out: Annotated[Path, typer.Option("-o", "--out", help="the audit folder to write")],
    model: Annotated[
        str, typer.Option(help="bundled name, local HF folder, .gguf file or TransformerLens name")
    ] = "smollm2-135m",
    stride: Annotated[int, typer.Option(min=1, help="d: tokens per block")] = 4,
    top_k: Annotated[int, typer.Option(min=1, help="blocks kept per query (selecting)")] = 8,
    window: Annotated[int, typer.Option(min=0, help="raw window W (tokens)")] = 16,
    layers: Annotated[str | None, typer.Option(help=LAYERS_HELP)] = None,
    offsets: Annotated[
        str, typer.Option(help="aligned, per_layer, per_head, per_layer_head or random")
    ] = "aligned",
    fix: Annotated[
        str | None,
        typer.Option(
            help="fixes to compare with the aligned grid (comma-list, or 'all'): "
            "per_head, per_layer, per_layer_head, random, overlap, before_window, "
            "half_stride, topk_x2, topk_x4, topk_x8"
        ),
    ] = None,  # fmt: skip
    block_len: Annotated[int | None, typer.Option(help="block length (default: stride)")] = None,
    obs_window: Annotated[int | None, typer.Option(help="evict's observation queries")] = None,
    sink_tokens: Annotated[
        int, typer.Option(min=0, help="first tokens every query reads raw (selecting designs)")
    ] = 0,
    regime: Annotated[str, typer.Option(help="decode (default) or trained")] = "decode",
    context: Annotated[str, typer.Option(help="prompt lengths in tokens, e.g. 512,2048")] = "1024",
    depths: Annotated[str, typer.Option(help="needle depths (fractions)")] = "0.1,0.3,0.5,0.7,0.9",
    task: Annotated[str, typer.Option(help="passkey, multikey or kv")] = "passkey",
    distractors: Annotated[int | None, typer.Option(help="multikey/kv: other codes")] = None,
    contents: Annotated[int, typer.Option(min=1, help="contents per context (x stride)")] = 50,
    attention_groups: Annotated[
        int, typer.Option(min=1, help="contents whose prompts also read per-head attention")
    ] = 5,
    seed: int = 0,
    address: Annotated[str | None, typer.Option(help="join this Ray cluster")] = None,
    num_cpus: Annotated[int | None, typer.Option(min=1, help="embedded Ray's CPUs")] = None,
    device: DeviceOpt = "cpu",
) -> None:
    """Per-phase retrieval of each design against the uncompressed model (the null), on the
    same paired prompts (every content at every phase at every depth), through the launcher."""
    from phasemech.experiments.audit.config import AuditConfig
    from phasemech.experiments.audit.jobs import run_audit

    _device(device)
    try:
        cfg = AuditConfig(
            designs=tuple(d.strip() for d in design.split(",") if d.strip()),
            model=model, stride=stride, window=window, top_k=top_k,
            layers=_layer_set(layers, model),
            offsets=offsets, block_len=block_len, obs_window=obs_window,
            sink_tokens=sink_tokens or None, regime=regime, contexts=_ints(context, "--context"),
            depths=_depths(depths), task=task,
            distractors=distractors, contents=contents, seed=seed, variants=_variants(fix),
            attention_groups=attention_groups,
        )  # fmt: skip
        summary = run_audit(cfg, out, address=address, num_cpus=num_cpus, device=device)
    except (ValueError, ConnectionError, FileNotFoundError, RuntimeError) as err:
        raise _fail(err) from err
    console.print((out / "summary.md").read_text(), markup=False, highlight=False)
    console.print(f"wrote {out} ({summary['wall_s']:.0f} s); open {out / 'audit.html'}")


def _phases(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    got = _ints(value, "--contrast-phases")
    if len(got) != 2:
        msg = f"{value!r}: expected two phases CLEAN,CORRUPT"
        raise typer.BadParameter(msg, param_hint="--contrast-phases")
    return got[0], got[1]


@app.command()
def explain(
    design: Annotated[str, typer.Option(help="route, quest, kpool, evict (or mean, partition)")],
    out: Annotated[Path, typer.Option("-o", "--out", help="the folder to write")],
    model: Annotated[str, typer.Option(help="as for audit")] = "smollm2-135m",
    stride: Annotated[int, typer.Option(min=1, help="d: tokens per block")] = 4,
    top_k: Annotated[int, typer.Option(min=1, help="blocks kept per query")] = 1,
    window: Annotated[int, typer.Option(min=0, help="raw window W (tokens)")] = 16,
    layers: Annotated[str | None, typer.Option(help=LAYERS_HELP)] = None,
    offsets: Annotated[
        str, typer.Option(help="aligned, per_layer, per_head, per_layer_head or random")
    ] = "aligned",
    block_len: Annotated[int | None, typer.Option(help="block length (default: stride)")] = None,
    obs_window: Annotated[int | None, typer.Option(help="evict's observation queries")] = None,
    regime: Annotated[str, typer.Option(help="decode (default) or trained")] = "decode",
    context: Annotated[int, typer.Option(min=64, help="prompt length in tokens")] = 1024,
    depths: Annotated[str, typer.Option(help="needle depths (fractions)")] = "0.1,0.3,0.5,0.7,0.9",
    task: Annotated[str, typer.Option(help="passkey, multikey or kv")] = "passkey",
    distractors: Annotated[int | None, typer.Option(help="multikey/kv: other codes")] = None,
    contents: Annotated[int, typer.Option(min=1, help="contents (x stride prompts)")] = 50,
    contrast_phases: Annotated[
        str | None, typer.Option(help="CLEAN,CORRUPT phases to patch (default: best, worst)")
    ] = None,
    analyses: Annotated[
        str, typer.Option(help="comma-list of selection, oracle, ablation, patching")
    ] = "selection,oracle,ablation,patching",
    top_heads: Annotated[int, typer.Option(min=1, help="heads the head-oracle forces")] = 10,
    seed: int = 0,
    address: Annotated[str | None, typer.Option(help="join this Ray cluster")] = None,
    num_cpus: Annotated[int | None, typer.Option(min=1, help="embedded Ray's CPUs")] = None,
    device: DeviceOpt = "cpu",
) -> None:
    """Which selections, layers and heads make a design's weak phase weak, on the audit's
    prompts: needle selection, oracle forcing, head ablation and patching across phases."""
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.tables import run_explain

    _device(device)
    try:
        cfg = ExplainConfig(
            design=design.strip(), model=model, stride=stride, window=window, top_k=top_k,
            layers=_layer_set(layers, model),
            offsets=offsets, block_len=block_len, obs_window=obs_window, regime=regime,
            context=context, depths=_depths(depths), task=task, distractors=distractors,
            contents=contents, seed=seed, contrast_phases=_phases(contrast_phases),
            analyses=tuple(a.strip() for a in analyses.split(",") if a.strip()),
            top_heads=top_heads,
        )  # fmt: skip
        summary = run_explain(cfg, out, address=address, num_cpus=num_cpus, device=device)
    except (ValueError, ConnectionError, FileNotFoundError, RuntimeError) as err:
        raise _fail(err) from err
    console.print((out / "summary.md").read_text(), markup=False, highlight=False)
    console.print(
        f"wrote {out}/summary.md, {out}/explain.html and the tables ({summary['wall_s']:.0f} s)"
    )
