"""The experiment launcher's overhead per job, measured side by side with running jobs inline.

Jobs that do no work isolate what the launcher adds: shipping the job to a Ray worker, the
result back, and the atomic cache write. Reported (median over repeats, one run, one machine):

* Ray start-up: ``ray.init`` of the embedded local Ray plus the first job (workers import torch
  and phasemech), paid once per launch that has anything to run;
* one job per ``launch`` call on a warm Ray (the latency a single cached-miss job sees);
* many jobs in one ``launch`` call (per job: the throughput cost), first while Ray starts more
  workers for the queue (each imports torch), then with those workers warm;
* the same jobs inline (``job.run`` in this process), the floor.

Usage: ``python bench/launcher.py [--jobs 40] [--cpus 2]``; writes ``bench/results/launcher.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import ray.cloudpickle

from phasemech.core.io import write_json_atomic
from phasemech.experiments import Job, launch
from phasemech.experiments.ray_connect import ray_connected

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import bench/


@dataclass(frozen=True)
class NoopJob(Job):
    kind: ClassVar[str] = "noop"
    i: int
    batch: str = ""

    def run(self, workdir: Path) -> dict:
        return {"i": self.i}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="phasemech-launcher-bench-"))
    t0 = time.perf_counter()
    with ray_connected(None, args.cpus):  # the launcher's own embedded Ray
        launch([NoopJob(-1)], root / "warm", progress=False)
        startup = time.perf_counter() - t0
        single = []
        for i in range(args.jobs):
            t = time.perf_counter()
            launch([NoopJob(i)], root / "single", progress=False)
            single.append(time.perf_counter() - t)
        batched = []
        for rep in ("cold", "warm"):  # cold: Ray starts more workers for the queue (torch imports)
            batch = [NoopJob(i, rep) for i in range(args.jobs)]
            t = time.perf_counter()
            out = launch(batch, root / "batch", progress=False)
            batched.append((time.perf_counter() - t) / args.jobs)
            assert len(out.ran) == args.jobs and not out.failures
    inline = []
    for job in batch:
        t = time.perf_counter()
        job.run(root)
        inline.append(time.perf_counter() - t)
    res = {
        "jobs": args.jobs,
        "cpus": args.cpus,
        "startup_s": startup,
        "single_job_median_s": statistics.median(single),
        "batched_cold_per_job_s": batched[0],
        "batched_warm_per_job_s": batched[1],
        "inline_median_s": statistics.median(inline),
    }
    res["single_over_inline"] = res["single_job_median_s"] / max(res["inline_median_s"], 1e-9)
    dest = Path(__file__).resolve().parent / "results" / "launcher.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(dest, res)
    print(
        f"Ray start-up + first job: {startup:.2f} s; per job: one per launch (warm) "
        f"{res['single_job_median_s'] * 1e3:.1f} ms median, {args.jobs} in one launch "
        f"{batched[0] * 1e3:.1f} ms (cold workers) / {batched[1] * 1e3:.1f} ms (warm), inline "
        f"{res['inline_median_s'] * 1e6:.1f} us; wrote {dest}"
    )


if __name__ == "__main__":
    main()
