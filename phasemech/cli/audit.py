"""``phasemech audit`` and ``phasemech explain``: the per-phase retrieval audit of compression
designs on a real model, and the causal explanation of its weak phase. Both take the same
probe and run options (:mod:`phasemech.cli.probe`): an audited setting is explained with the
flags that audited it (one design and one context at a time)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from phasemech.cli.base import app, console, fail, parse_ints, split_list
from phasemech.cli.probe import RunOptions, probe_command
from phasemech.experiments.audit.fixes import FIXES
from phasemech.experiments.explain.config import ANALYSES

FIX_HELP = f"fixes to compare with the aligned grid (comma-list, or 'all'): {', '.join(FIXES)}"
ANALYSES_HELP = f"comma-list of {', '.join(ANALYSES)}"


def _variants(fix: str | None) -> tuple[str, ...]:
    """``--fix``: the aligned baseline first, then the named fixes (``all``: every fix)."""
    names = list(split_list(fix, "--fix") or ())
    names = list(FIXES) if names == ["all"] else [n for n in names if n != "aligned"]
    if fix is not None and not names:
        msg = f"{fix!r} names no fix: allowed 'all' or any of {', '.join(FIXES)}"
        raise typer.BadParameter(msg, param_hint="--fix")
    return ("aligned", *names)


def _contrast(value: str | None) -> tuple[int, int] | None:
    got = parse_ints(value, "--contrast-phases")
    if got is not None and len(got) != 2:
        raise ValueError(f"--contrast-phases {value!r} is invalid: expected CLEAN,CORRUPT")
    return got


def _study(build, runner, run: RunOptions):
    """Build the study's config and run it; bad input and failed jobs are one line (exit 1)."""
    try:
        cfg = build()
        return runner(cfg, run.out, address=run.address, num_cpus=run.num_cpus,
                      device=run.device)  # fmt: skip
    except (ValueError, ConnectionError, OSError, RuntimeError) as err:
        raise fail(err) from err


@app.command()
@probe_command
def audit(
    probe: dict[str, Any],
    run: RunOptions,
    fix: Annotated[str | None, typer.Option(help=FIX_HELP)] = None,
    attention_groups: Annotated[
        int, typer.Option(min=1, help="contents whose prompts also read per-head attention")
    ] = 5,
) -> None:
    """Per-phase retrieval of each design against the uncompressed model (the null), on the
    same paired prompts (every content at every phase at every depth), through the launcher."""
    from phasemech.experiments.audit.config import AuditConfig
    from phasemech.experiments.audit.study import run_audit

    variants = _variants(fix)
    build = lambda: AuditConfig.of(**probe, variants=variants, attention_groups=attention_groups)  # noqa: E731
    summary = _study(build, run_audit, run)
    console.print((run.out / "summary.md").read_text(), markup=False, highlight=False)
    console.print(f"wrote {run.out} ({summary['wall_s']:.0f} s); open {run.out / 'audit.html'}")


@app.command()
@probe_command
def explain(
    probe: dict[str, Any],
    run: RunOptions,
    contrast_phases: Annotated[
        str | None, typer.Option(help="CLEAN,CORRUPT phases to patch (default: best, worst)")
    ] = None,
    analyses: Annotated[str, typer.Option(help=ANALYSES_HELP)] = ",".join(ANALYSES),
    top_heads: Annotated[int, typer.Option(min=1, help="heads the head-oracle forces")] = 10,
) -> None:
    """Which selections, layers and heads make a design's weak phase weak, on the audit's
    prompts: needle selection, oracle forcing, head ablation and patching across phases."""
    from phasemech.experiments.explain.config import ExplainConfig
    from phasemech.experiments.explain.run import run_explain

    def build() -> ExplainConfig:
        own = dict(contrast_phases=_contrast(contrast_phases), top_heads=top_heads,
                   analyses=split_list(analyses, "--analyses"))  # fmt: skip
        return ExplainConfig.of(**probe, **own)

    summary = _study(build, run_explain, run)
    out = run.out
    console.print((out / "summary.md").read_text(), markup=False, highlight=False)
    console.print(
        f"wrote {out}/summary.md, {out}/explain.html and the tables ({summary['wall_s']:.0f} s)"
    )
