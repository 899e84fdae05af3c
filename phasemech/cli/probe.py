"""The real-model studies' shared options, defined once: the probe
(:class:`~phasemech.experiments.probe.config.ProbeConfig`: model, designs and grid, sink,
regime, task, contexts, contents, seed) and the run (``--out``, ``--address``,
``--num-cpus``, ``--device``). :func:`probe_command` adds them to a command, so ``audit``,
``explain`` and every later real-model study take the same flags for the same setting.

A command decorated with it receives ``probe`` (the probe's fields, parsed: a dict for its
config's ``of``; an option left at its ``None`` default is left out, so the study's own default
applies, as ``--top-k``: 8 for an audit, 1 for an explanation) and ``run`` (:class:`RunOptions`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from phasemech.cli.base import (
    LAYERS_HELP,
    DeviceOpt,
    device_option,
    fail,
    parse_ints,
    parse_layers,
    split_list,
)
from phasemech.core.designs import REGIMES
from phasemech.data.retrieval import TASK_KINDS, TEMPLATES
from phasemech.experiments.probe.config import PROBE_DESIGNS, PROBE_OFFSETS, ProbeConfig


def _opt(kind: Any, help: str, default: Any = None, **kw: Any) -> tuple:
    return Annotated[kind, typer.Option(help=help, **kw)], default


#: the probe's defaults, as its options spell them (one place: ``ProbeConfig``'s fields)
_D = {f.name: f.default for f in dataclasses.fields(ProbeConfig)}
_D |= {k: ",".join(map(str, _D[k])) for k in ("contexts", "depths")}
#: name -> (annotation, default): the probe's options (their order is ``--help``'s)
PROBE_OPTIONS: dict[str, tuple] = {
    "design": _opt(str, f"{', '.join(PROBE_DESIGNS)} (comma-list; explain takes one)", ...),
    "model": _opt(
        str, "bundled name, local HF folder, .gguf file or TransformerLens name", _D["model"]
    ),
    "stride": _opt(int, "d: tokens per block", _D["stride"], min=1),
    "top_k": _opt(int | None, "blocks kept per query (default: audit 8, explain 1)", min=1),
    "window": _opt(int, "raw window W (tokens)", _D["window"], min=0),
    "layers": _opt(str | None, f"compressed {LAYERS_HELP}"),
    "offsets": _opt(str, ", ".join(PROBE_OFFSETS), _D["offsets"]),
    "block_len": _opt(int | None, "block length (default: stride)"),
    "obs_window": _opt(int | None, "evict's observation queries"),
    "sink_tokens": _opt(int, "first tokens every query reads raw (designs that rank)", 0, min=0),
    "regime": _opt(str, " or ".join(REGIMES), _D["regime"]),
    "context": _opt(
        str, "prompt lengths in tokens, e.g. 512,2048 (explain takes one)", _D["contexts"]
    ),  # fmt: skip
    "depths": _opt(str, "needle depths (fractions)", _D["depths"]),
    "task": _opt(str, ", ".join(TASK_KINDS), _D["task"]),
    "distractors": _opt(int | None, "multikey/kv: other codes"),
    "contents": _opt(int, "contents per context (x stride prompts)", _D["contents"], min=1),
    "seed": _opt(int, "the prompts' seed", _D["seed"]),
    "template": _opt(str, f"needle template: {', '.join(TEMPLATES)}", _D["template"]),
    "prefix_extra": _opt(int, "extra shift-prefix tokens (taken from the filler)", 0, min=0),
}
#: the run's options: where the results go and what runs them
RUN_OPTIONS: dict[str, tuple] = {
    "out": (Annotated[Path, typer.Option("-o", "--out", help="the folder to write")], ...),
    "address": _opt(str | None, "join this Ray cluster (default: an embedded local Ray)"),
    "num_cpus": _opt(int | None, "embedded Ray's CPUs", min=1),
    "device": (DeviceOpt, "cpu"),
}


@dataclass(frozen=True)
class RunOptions:
    """Where a study writes and what runs it (the launcher's ``address``, ``num_cpus``)."""

    out: Path
    address: str | None
    num_cpus: int | None
    device: str


def probe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The probe's fields from the options' values: lists parsed (one grammar each), the
    layer names resolved on the model, ``--sink-tokens 0`` as no sink, ``None`` left out."""
    out = dict(raw)
    out["designs"] = split_list(out.pop("design"), "--design")
    out["contexts"] = parse_ints(out.pop("context"), "--context")
    out["depths"] = split_list(out["depths"], "--depths", float, "fractions like 0.1,0.5,0.9")
    out["layers"] = parse_layers(out["layers"], _model_layers(out["model"]))
    out["sink_tokens"] = out["sink_tokens"] or None
    return {k: v for k, v in out.items() if v is not None}


def _model_layers(spec: str) -> Callable[[str], tuple[int, ...]]:
    def named(kind: str) -> tuple[int, ...]:
        from phasemech.model.sources import describe

        return describe(spec).layers(kind)

    return named


def probe_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``fn`` (taking ``probe``, ``run`` and options of its own) the shared options: its
    signature gains :data:`PROBE_OPTIONS` and :data:`RUN_OPTIONS` for typer to read."""

    @functools.wraps(fn)
    def command(**kw: Any) -> Any:
        run = RunOptions(**{k: kw.pop(k) for k in RUN_OPTIONS})
        device_option(run.device)  # checked first, as every command does
        try:  # a list the grammar rejects, a model it cannot read: one line, before any work
            probe = probe_fields({k: kw.pop(k) for k in PROBE_OPTIONS})
        except (ValueError, ConnectionError, OSError) as err:
            raise fail(err) from err
        return fn(probe=probe, run=run, **kw)

    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values()
           if p.name not in ("probe", "run")]  # fmt: skip
    kw_only = inspect.Parameter.KEYWORD_ONLY
    shared = [inspect.Parameter(name, kw_only, annotation=ann, default=default)
              for name, (ann, default) in (PROBE_OPTIONS | RUN_OPTIONS).items()]  # fmt: skip
    required = [p for p in shared if p.default is ...]  # typer: no default = required option
    params = [p.replace(default=inspect.Parameter.empty) for p in required]
    params += [p.replace(kind=kw_only) for p in own] + [p for p in shared if p.default is not ...]
    # typer reads this signature and these (evaluated) annotations, not ``fn``'s
    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    del command.__wrapped__
    return command


__all__ = ["PROBE_OPTIONS", "RUN_OPTIONS", "RunOptions", "probe_command", "probe_fields"]
