"""Phase-controlled retrieval tasks, generated from a seed as HF ``datasets.Dataset`` objects.

Names used throughout:

- ``pos``: absolute token position in a sequence; ``phase``: ``(pos - grid_offset) mod stride``,
  the offset of a position inside its compression chunk;
- a *target* is one answer the model must retrieve: the logits at ``query_pos`` must put the
  ``answer`` token first; the answer sits earlier in the context at ``source_pos`` (the *needle*),
  right after its key. ``phase`` is the phase of ``source_pos``: the token a compressed head has
  to read through a block.
- ``depth``: where the needle lies in the context before its query, ``(source_pos - prefix) /
  (query_pos - prefix)`` in ``(0, 1)``; measured inside the content, so shifting a sequence by
  a prefix changes the phase and nothing else.
- ``distance``: ``query_pos - source_pos``, what decides whether the needle is still in the raw
  window.

Vocabulary follows Zoology's MQAR: keys from ``[1, V/2)``, values from ``[V/2, V)``. Fillers
come from the value range, so a filler can never be mistaken for a key.

Every sequence is built as *content* (``seq_len - stride + 1`` tokens) placed after a filler
prefix of ``prefix`` tokens, ``0 <= prefix < stride``, and followed by fillers to length
``seq_len``. A random prefix makes source phases uniform and independent of depth, on any grid
whose stride divides ``stride`` (Zoology's layout alone puts every value at an odd position). A
*phase-balanced* set instead repeats each content at every prefix: equal counts per phase
for every needle and depth, and pairs of sequences that differ only in phase.

One dataset row is one sequence; the columns ``query_pos, source_pos, answer, depth, distance,
phase`` are lists with one entry per target of that sequence (:func:`targets_frame` explodes
them into a tidy table, one row per target).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
from datasets import Dataset, load_from_disk
from jaxtyping import Int
from torch import Tensor

from phasemech.core.config import is_int
from phasemech.core.grid import phase_of
from phasemech.core.io import atomic_write

TaskName = Literal["mqar", "needle"]
TARGET_COLUMNS = ("query_pos", "source_pos", "answer", "depth", "distance", "phase")


def _check(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class MQARTask:
    """Multi-query associative recall (Zoology): ``n_pairs`` key-value pairs, then queries.

    ``jitter > 0`` inserts ``0..jitter`` random fillers before each pair (phase-jittered data:
    values of one sequence no longer share a parity). ``n_queries`` defaults to ``n_pairs``
    (every key is asked once, in random order, at random places after the pairs).
    """

    vocab_size: int = 64
    seq_len: int = 64
    n_pairs: int = 8
    n_queries: int | None = None
    stride: int = 8
    grid_offset: int = 0
    jitter: int = 0

    def __post_init__(self) -> None:
        _common_checks(self)
        _check("n_pairs", self.n_pairs, is_int(self.n_pairs) and self.n_pairs >= 1, "need >= 1")
        max_keys = self.vocab_size // 2 - 1
        _check(
            "n_pairs",
            self.n_pairs,
            self.n_pairs <= max_keys,
            f"keys are distinct tokens from [1, {self.vocab_size // 2}): at most {max_keys}",
        )
        q = self.queries
        _check("n_queries", q, is_int(q) and 1 <= q <= self.n_pairs, "need 1..n_pairs")
        _check("jitter", self.jitter, is_int(self.jitter) and self.jitter >= 0, "need >= 0")
        need = 2 * self.n_pairs + self.n_pairs * self.jitter + 2 * q
        _check(
            "seq_len",
            self.seq_len,
            self.content_len >= need,
            f"content of {self.content_len} tokens (seq_len - stride + 1) cannot hold "
            f"{self.n_pairs} pairs with jitter {self.jitter} and {q} queries ({need} tokens)",
        )

    @property
    def name(self) -> str:
        return "mqar"

    @property
    def queries(self) -> int:
        return self.n_pairs if self.n_queries is None else self.n_queries

    @property
    def content_len(self) -> int:
        return self.seq_len - self.stride + 1


@dataclass(frozen=True)
class NeedleTask:
    """Needles (key-value pairs) among distractor pairs and fillers, queried at the end.

    Needle 0 is placed at a controlled depth (``depths``: fractions of the context); the other
    ``n_needles - 1`` needles and the ``n_distractors`` pairs go to random free places. All
    needles are queried after the context, in random order.
    """

    vocab_size: int = 64
    seq_len: int = 64
    n_needles: int = 1
    n_distractors: int = 8
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    stride: int = 8
    grid_offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(float(x) for x in self.depths))
        _common_checks(self)
        m, k = self.n_needles, self.n_distractors
        _check("n_needles", m, is_int(m) and m >= 1, "need >= 1")
        _check("n_distractors", k, is_int(k) and k >= 0, "need >= 0")
        max_keys = self.vocab_size // 2 - 1
        _check("n_needles + n_distractors", m + k, m + k <= max_keys, f"at most {max_keys} keys")
        ok = len(self.depths) > 0 and all(0.0 <= x <= 1.0 for x in self.depths)
        _check("depths", self.depths, ok, "need one or more fractions in [0, 1]")
        for depth in self.depths:  # pairs cannot straddle needle 0's slot
            first = _needle_slot(depth, self.context_len)
            room = first // 2 + (self.context_len - first - 2) // 2 + 1
            _check(
                "seq_len",
                self.seq_len,
                self.context_len >= 2 and room >= m + k,
                f"a context of {self.context_len} tokens with needle 0 at depth {depth} holds "
                f"{room} pairs, not {m + k} (needles + distractors)",
            )

    @property
    def name(self) -> str:
        return "needle"

    @property
    def content_len(self) -> int:
        return self.seq_len - self.stride + 1

    @property
    def context_len(self) -> int:
        return self.content_len - 2 * self.n_needles


Task = MQARTask | NeedleTask
TASKS: dict[str, type] = {"mqar": MQARTask, "needle": NeedleTask}


def _common_checks(task: Task) -> None:
    v, t, d = task.vocab_size, task.seq_len, task.stride
    _check("vocab_size", v, is_int(v) and v >= 8 and v % 2 == 0, "need an even int >= 8")
    _check("stride", d, is_int(d) and d >= 1, "need an int >= 1")
    _check("seq_len", t, is_int(t) and t > d, f"need an int > stride={d}")
    _check("grid_offset", task.grid_offset, is_int(task.grid_offset), "need an int")


def task_to_dict(task: Task) -> dict[str, Any]:
    return {"task": task.name, **dataclasses.asdict(task)}


def task_from_dict(d: dict[str, Any]) -> Task:
    d = dict(d)
    name = d.pop("task", None)
    if name not in TASKS:
        raise ValueError(f"task={name!r} is invalid: allowed {sorted(TASKS)}")
    cls = TASKS[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{name} task fields {unknown} are unknown: allowed {sorted(known)}")
    if "depths" in d:
        d["depths"] = tuple(d["depths"])
    return cls(**d)


# ---------------------------------------------------------------------------------- content
# A content generator returns (tokens [content_len], key_pos [target]) with the answer at
# key_pos + 1 and its query key at query_pos (both inside the content).


def _fillers(rng: np.random.Generator, vocab: int, n: int) -> np.ndarray:
    return rng.integers(vocab // 2, vocab, size=n)


def _two_slots(rng: np.random.Generator, length: int, n: int) -> np.ndarray:
    """Sorted starts of ``n`` non-overlapping 2-token slots in ``[0, length)``, uniformly.

    Stars and bars: ``s_i - i`` are ``n`` distinct values in ``[0, length - n)``.
    """
    return np.sort(rng.choice(length - n, size=n, replace=False)) + np.arange(n)


def _mqar_content(task: MQARTask, rng: np.random.Generator):
    v, n, q = task.vocab_size, task.n_pairs, task.queries
    tokens = _fillers(rng, v, task.content_len)
    keys = rng.choice(np.arange(1, v // 2), size=n, replace=False)
    values = rng.integers(v // 2, v, size=n)
    gaps = rng.integers(0, task.jitter + 1, size=n) if task.jitter else np.zeros(n, dtype=int)
    key_pos = np.cumsum(gaps + 2) - 2  # pair i: gaps[i] fillers, then key, value
    tokens[key_pos], tokens[key_pos + 1] = keys, values
    start = int(key_pos[-1]) + 2
    asked = rng.permutation(n)[:q]
    # each query is a key followed by its value, at random non-overlapping places after pairs
    starts = _two_slots(rng, task.content_len - start, q) + start
    tokens[starts], tokens[starts + 1] = keys[asked], values[asked]
    return tokens, key_pos[asked] + 1, starts


def _needle_slot(depth: float, context_len: int) -> int:
    """Key position of needle 0 at ``depth`` (a fraction of the context)."""
    return int(round(depth * (context_len - 2)))


def _needle_content(task: NeedleTask, rng: np.random.Generator, depth: float):
    v, m, k = task.vocab_size, task.n_needles, task.n_distractors
    ctx = task.context_len
    tokens = _fillers(rng, v, task.content_len)
    keys = rng.choice(np.arange(1, v // 2), size=m + k, replace=False)
    values = rng.integers(v // 2, v, size=m + k)
    first = _needle_slot(depth, ctx)
    # the other pairs: uniformly among non-overlapping 2-slots left and right of needle 0
    left, right = first, ctx - first - 2
    rest = m + k - 1
    n_left = np.arange(rest + 1)
    ways = np.array(
        [
            math.comb(left - a, a) * math.comb(right - rest + a, rest - a)
            if 2 * a <= left and 2 * (rest - a) <= right
            else 0
            for a in n_left
        ],
        float,
    )
    a = int(rng.choice(n_left, p=ways / ways.sum()))
    key_pos = [first]
    key_pos += _two_slots(rng, left, a).tolist()
    key_pos += (_two_slots(rng, right, rest - a) + first + 2).tolist()
    key_pos[1:] = rng.permutation(key_pos[1:]).tolist()  # needles 1.. at random places
    key_pos = np.asarray(key_pos)
    tokens[key_pos], tokens[key_pos + 1] = keys, values
    order = rng.permutation(m)
    starts = ctx + 2 * np.arange(m)
    tokens[starts], tokens[starts + 1] = keys[order], values[order]
    return tokens, key_pos[order] + 1, starts


# ---------------------------------------------------------------------------------- sequences


def _sequence(task: Task, rng: np.random.Generator, content, prefix: int) -> dict[str, Any]:
    body, source, query = content
    seq = np.concatenate(
        [
            _fillers(rng, task.vocab_size, prefix),
            body,
            _fillers(rng, task.vocab_size, task.seq_len - prefix - len(body)),
        ]
    )
    source, query = source + prefix, query + prefix
    return {
        "input_ids": seq.astype(np.int64).tolist(),
        "prefix": int(prefix),
        "query_pos": query.tolist(),
        "source_pos": source.tolist(),
        "answer": seq[source].tolist(),
        "depth": ((source - prefix) / (query - prefix)).tolist(),
        "distance": (query - source).tolist(),
        "phase": phase_of(source, task.stride, task.grid_offset).tolist(),
    }


def _contents(task: Task, rng: np.random.Generator, n: int):
    if isinstance(task, MQARTask):
        return [_mqar_content(task, rng) for _ in range(n)]
    depths = np.resize(np.asarray(task.depths), n)  # cycle through depths
    return [_needle_content(task, rng, float(x)) for x in depths]


def generate_rows(
    task: Task,
    n: int,
    seed: int | np.random.Generator,
    balanced: bool = False,
    spread: int | None = None,
) -> list[dict[str, Any]]:
    """``n`` sequences as plain dicts (see :func:`generate`). ``spread`` (random sets only):
    prefixes drawn from ``0..spread-1`` instead of ``0..stride-1``; the content's layout is the
    task's either way (a training curriculum narrows the prefix, never the content)."""
    _check("n", n, is_int(n) and n >= 1, "need an int >= 1")
    if spread is not None:
        _check("spread", spread, not balanced, "a phase-balanced set uses every prefix")
        ok = is_int(spread) and 1 <= spread <= task.stride
        _check("spread", spread, ok, f"need None or an int in 1..stride={task.stride}")
    if balanced and n % task.stride:
        raise ValueError(
            f"n={n} is invalid for a phase-balanced set: need a multiple of stride={task.stride}"
        )
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    rows = []
    if balanced:  # every content at every prefix: groups of `stride` shifted copies
        for group, content in enumerate(_contents(task, rng, n // task.stride)):
            for prefix in range(task.stride):
                rows.append({"group_id": group, **_sequence(task, rng, content, prefix)})
    else:
        prefixes = rng.integers(0, task.stride if spread is None else spread, size=n)
        for i, content in enumerate(_contents(task, rng, n)):
            rows.append({"group_id": i, **_sequence(task, rng, content, int(prefixes[i]))})
    for i, row in enumerate(rows):
        row["seq_id"] = i
    return rows


def generate(task: Task, n: int, seed: int, balanced: bool = False) -> Dataset:
    """A ``datasets.Dataset`` of ``n`` sequences of ``task``, deterministic in ``seed``.

    ``balanced=False``: each sequence gets a random prefix (training and random test sets).
    ``balanced=True``: ``n / stride`` contents, each at every prefix ``0..stride-1`` (the
    ``phase_balanced`` evaluation set); ``group_id`` names the content, so the ``stride``
    copies can be compared paired. For needles, contents cycle through ``task.depths``.
    The task config is kept in the dataset's description (JSON).
    """
    rows = generate_rows(task, n, seed, balanced)
    ds = Dataset.from_list(rows)
    meta = {**task_to_dict(task), "seed": seed, "balanced": balanced, "n": n}
    ds.info.description = json.dumps(meta)
    return ds


def task_of(ds: Dataset) -> Task | None:
    """The task a dataset was generated from, if its description carries it."""
    try:
        meta = json.loads(ds.info.description or "")
    except json.JSONDecodeError:
        return None
    if not isinstance(meta, dict) or "task" not in meta:
        return None
    return task_from_dict({k: v for k, v in meta.items() if k not in ("seed", "balanced", "n")})


def training_batch(
    task: Task, batch: int, seed: int, step: int, spread: int | None = None
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch target"], Int[Tensor, "batch target"]]:
    """Training batch ``step`` of a seeded stream: ``(tokens, query_pos, answer)``; ``spread``
    narrows the random prefix (see :func:`generate_rows`).

    A pure function of ``(task, batch, seed, step, spread)``, so a resumed run sees the same data.
    """
    rng = np.random.default_rng([seed, step])
    return to_tensors(generate_rows(task, batch, rng, spread=spread))


def to_tensors(
    rows: Dataset | list[dict[str, Any]],
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch target"], Int[Tensor, "batch target"]]:
    """``(tokens, query_pos, answer)`` tensors from dataset rows (all rows same target count)."""
    if isinstance(rows, Dataset):
        rows = rows.with_format(None)
        cols = rows[:]
        ids, qp, ans = cols["input_ids"], cols["query_pos"], cols["answer"]
    else:
        ids = [r["input_ids"] for r in rows]
        qp = [r["query_pos"] for r in rows]
        ans = [r["answer"] for r in rows]
    return torch.tensor(ids), torch.tensor(qp), torch.tensor(ans)


PARQUET_KEY = b"phasemech"  # parquet schema metadata: the task, as in the dataset description


def save_dataset(ds: Dataset, path: str | Path) -> Path:
    """Write ``ds`` as a ``save_to_disk`` folder, or as one parquet file when ``path`` ends in
    ``.parquet`` (the task description travels in the parquet schema metadata)."""
    path = Path(path)
    if path.suffix != ".parquet":
        ds.save_to_disk(str(path))
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    table = ds.with_format("arrow")[:]
    meta = dict(table.schema.metadata or {})
    meta[PARQUET_KEY] = (ds.info.description or "").encode()
    atomic_write(path, lambda tmp: pq.write_table(table.replace_schema_metadata(meta), tmp))
    return path


def load_dataset(path: str | Path) -> Dataset:
    """Read a dataset written by :func:`save_dataset` (or ``phasemech data``)."""
    path = Path(path)
    if path.is_dir():
        return load_from_disk(str(path))
    if path.suffix != ".parquet" or not path.is_file():
        raise ValueError(f"{path} is neither a save_to_disk folder nor a .parquet file")
    ds = Dataset.from_parquet(str(path))
    meta = pq.read_schema(path).metadata or {}
    if PARQUET_KEY in meta:
        ds.info.description = meta[PARQUET_KEY].decode()
    return ds


def targets_frame(ds: Dataset, stride: int | None = None, grid_offset: int = 0) -> pd.DataFrame:
    """One row per target: ``seq_id, group_id, target, prefix, query_pos, source_pos, answer,
    depth, distance, phase``. ``stride`` recomputes ``phase`` on another grid (e.g. a model's)."""
    df = ds.remove_columns("input_ids").to_pandas()
    df = df.explode(list(TARGET_COLUMNS), ignore_index=False)
    df["target"] = df.groupby(level=0).cumcount()
    df = df.reset_index(drop=True)
    for col in ("query_pos", "source_pos", "answer", "distance", "phase"):
        df[col] = df[col].astype(np.int64)
    df["depth"] = df["depth"].astype(np.float64)
    if stride is not None:
        df["phase"] = phase_of(df["source_pos"].to_numpy(), stride, grid_offset)
    first = ["seq_id", "group_id", "target", "prefix"]
    return df[first + list(TARGET_COLUMNS)]


def balanced_test_set(task: Task, sequences: int = 4096, seed: int = 777) -> Dataset:
    """The phase-balanced test set of a task (seed distinct from training and held-out sets)."""
    return generate(task, sequences, seed, balanced=True)


__all__ = [
    "MQARTask",
    "NeedleTask",
    "Task",
    "balanced_test_set",
    "generate",
    "generate_rows",
    "load_dataset",
    "save_dataset",
    "targets_frame",
    "task_from_dict",
    "task_of",
    "task_to_dict",
    "to_tensors",
    "training_batch",
]
