"""``phasemech run``, ``sweep-pretrained`` and ``dashboard``: experiments on the launcher."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from phasemech.cli.base import DeviceOpt, app, console, device_option, fail, split_list


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
    device: DeviceOpt = "auto",
) -> None:
    """One self-contained HTML dashboard (plotly.js inlined) for head-attribution exploration."""
    from phasemech.experiments.showcase.panels import PanelConfig, build_dashboard

    dev = device_option(device)
    try:
        config = PanelConfig(
            sequences=sequences, data_seed=data_seed, n_boot=n_boot, n_perm=n_perm, seed=seed
        )
        dest = build_dashboard(
            run_dir, out, config, models=split_list(models), force=force, progress=True, device=dev
        )
    except (FileNotFoundError, ValueError) as err:
        raise fail(err) from err
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
    device: DeviceOpt = "auto",
) -> None:
    """Passkey accuracy by needle phase on SmolLM2-135M, uncompressed and post-hoc compressed
    (the ``pretrained`` experiment: the same as ``phasemech run pretrained``)."""
    out = _launch("pretrained", profile, runs, address, workers, 1, 0, device)
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
        raise fail(err) from err
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
