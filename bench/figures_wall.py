"""``make figures`` wall time before and after a change, side by side on one machine.

Runs the figures pipeline of an earlier commit (``--before``, checked out into a temporary git
worktree and imported ahead of the installed package) and of the working tree, one after the
other, each from an empty runs folder (nothing cached: every model trained, every panel
computed), and prints both wall times and their ratio. The earlier pipeline is its own
``analyses/figures.py`` (process pools; it also wrote the report); the current one is
``analyses/figures.py`` (the ``figures`` experiment on an embedded Ray) followed by
``analyses/report.py``, as ``make figures`` runs them. Same profile (``default``: five models),
no PNGs (Chromium's time is not what changed).

Usage: ``python bench/figures_wall.py [--before 071525f] [--profile default]``; writes
``bench/results/figures_wall.json``. Expect about 20 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

ROOT = Path(__file__).resolve().parents[1]


def _timed(cmds: list[list[str]], cwd: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    for cmd in cmds:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return time.perf_counter() - t0


def main(
    before: Annotated[str, typer.Option(help="the commit to compare with")] = "071525f",
    profile: Annotated[str, typer.Option(help="the figures profile")] = "default",
) -> None:
    """Time the figures pipeline of ``before`` and of the working tree, side by side."""
    py = sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="figures_wall_") as tmp:
        tmp = Path(tmp)
        old = tmp / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), before], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
        try:
            # the worktree's package shadows the installed (editable) one
            old_env = {**env, "PYTHONPATH": str(old)}
            cmd = [py, "analyses/figures.py", "--profile", profile, "--runs", str(tmp / "r0")]
            cmd += ["--out", str(tmp / "f0"), "--no-png", "--report", str(tmp / "R0.md")]
            t_before = _timed([cmd], old, old_env)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)
        fig = [py, "analyses/figures.py", "--profile", profile, "--runs", str(tmp / "r1")]
        fig += ["--out", str(tmp / "f1"), "--no-png"]
        folder = "phase_sweep_default" if profile == "full" else f"figures_{profile}"
        rep = [py, "analyses/report.py", "--showcase", str(tmp / "r1" / folder / "showcase")]
        rep += ["--captions", str(tmp / "f1" / "captions.json"), "--out", str(tmp / "R1.md")]
        t_after = _timed([fig, rep], ROOT, env)
    out = {
        "before": before,
        "profile": profile,
        "cores": os.cpu_count(),
        "seconds_before": round(t_before, 1),
        "seconds_after": round(t_after, 1),
        "ratio_after_over_before": round(t_after / t_before, 3),
    }
    print(
        f"make figures ({profile}, no PNGs, nothing cached) on {out['cores']} cores: before "
        f"({before}) {t_before:.1f} s, after {t_after:.1f} s, ratio {t_after / t_before:.2f}"
    )
    dest = ROOT / "bench" / "results" / "figures_wall.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
