"""Contrasts for activation patching by source phase, and the metric read at the answer.

Axes: ``batch`` (one clean/corrupted pair, one target each), ``pos``, ``copy`` (one patched run
of one pair), ``vocab``.

**Contrasts** (:func:`make_contrast`) pair a clean and a corrupted run of the same target:

* ``grid``: the same tokens, the corrupted run's compression grid shifted by ``shift``
  (``PhaseTransformer.shift_grid``): the needle's phase changes and nothing else does;
* ``content``: the content moved right by ``shift`` tokens (``shift`` new fillers in front, as
  many tail fillers dropped): phase and absolute position change together. Activations are
  patched content-aligned: clean position ``p`` goes to corrupted position ``p + shift``;
* ``answer``: the needle's value replaced by another value (the standard corrupted-answer pair;
  the replacement is the foil of the logit difference).

**Metric** per pair, read at the answer position only: ``logit_diff`` (answer minus foil logit;
the foil is the corrupted value, or for ``grid``/``content`` the corrupted run's best wrong
token), ``logprob`` or ``prob`` of the answer, ``margin`` (answer minus the best other logit:
positive iff the answer is the greedy token, the lab's ablation ``logit_diff``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from datasets import Dataset
from jaxtyping import Float, Int
from torch import Tensor

from phasemech.core.grid import phase_of
from phasemech.data.tasks import targets_frame, task_of, to_tensors

CONTRASTS = ("grid", "content", "answer")


METRICS = ("logit_diff", "logprob", "prob", "margin")


@dataclass(frozen=True)
class Contrast:
    """Clean and corrupted runs of one target per pair (see the module docstring).

    ``shift`` is the content offset: corrupted position = clean position + ``shift`` for the
    ``content`` contrast, 0 otherwise. ``foil`` is ``-1`` where it is chosen from the corrupted
    run (its best wrong token). ``pairs`` has one row per pair: ``seq_id, group_id, target,
    query_pos, source_pos, depth, distance, phase`` (clean needle's phase) and
    ``corrupted_phase``.
    """

    kind: str
    clean_tokens: Int[Tensor, "batch pos"]
    corrupted_tokens: Int[Tensor, "batch pos"]
    clean_grid: Int[Tensor, "batch"]
    corrupted_grid: Int[Tensor, "batch"]
    query_pos: Int[Tensor, "batch"]
    answer: Int[Tensor, "batch"]
    foil: Int[Tensor, "batch"]
    stride: int
    shift: int
    pairs: pd.DataFrame = field(repr=False)

    @property
    def corrupted_query_pos(self) -> Int[Tensor, "batch"]:
        return self.query_pos + (self.shift if self.kind == "content" else 0)

    def __len__(self) -> int:
        return int(self.clean_tokens.shape[0])

    def to(self, device: torch.device | str) -> Contrast:
        """The same contrast with its tensors on ``device`` (itself when they are there already):
        contrasts are built on the CPU, the patching functions move them to the model's device."""
        names = (
            "clean_tokens",
            "corrupted_tokens",
            "clean_grid",
            "corrupted_grid",
            "query_pos",
            "answer",
            "foil",
        )
        moved = {n: getattr(self, n).to(device) for n in names}
        if all(moved[n] is getattr(self, n) for n in names):
            return self
        return dataclasses.replace(self, **moved)


def check_choice(name: str, value: object, allowed: Iterable[str]) -> None:
    """Refuse ``value`` unless it is one of ``allowed`` (``name`` names it in the error)."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: allowed {', '.join(allowed)}")


def _check_contrast(
    ds: Dataset, kind: str, stride: int, grid_offset: int, shift: int | None, n_pairs: int | None
) -> tuple[int, int]:
    """Checked ``(shift, number of pairs)``; ``shift=None`` takes the kind's default."""
    check_choice("kind", kind, CONTRASTS)
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 2:
        raise ValueError(f"stride={stride!r} is invalid: expected an int >= 2")
    if isinstance(grid_offset, bool) or not isinstance(grid_offset, int):
        raise ValueError(f"grid_offset={grid_offset!r} is invalid: expected an int")
    if shift is None:
        shift = stride // 2 if kind != "answer" else 0
    if kind == "answer" and shift != 0:
        raise ValueError(f"shift={shift} is invalid for the answer contrast: only 0 is allowed")
    if kind != "answer" and (
        isinstance(shift, bool) or not isinstance(shift, int) or shift % stride == 0
    ):
        raise ValueError(
            f"shift={shift!r} is invalid for the {kind} contrast: expected an int that is not a "
            f"multiple of stride={stride} (the needle's phase must change)"
        )
    if kind == "content" and shift < 0:
        raise ValueError(f"shift={shift} is invalid for the content contrast: expected > 0")
    n = len(ds) if n_pairs is None else n_pairs
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(ds):
        raise ValueError(f"n_pairs={n_pairs!r} is invalid: expected 1..{len(ds)} (dataset size)")
    return shift, n


def _picked_targets(
    rows: Dataset, pick: Int[Tensor, "batch"], stride: int, grid_offset: int
) -> pd.DataFrame:
    """The ``targets_frame`` row of each sequence's picked target."""
    # targets_frame lists each row's targets in order: row i's pick sits at start_i + pick_i
    counts = np.array([len(q) for q in rows["query_pos"]])
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    df = targets_frame(rows, stride, grid_offset).iloc[starts + pick.numpy()]
    return df.reset_index(drop=True)


def _content_shifted(
    tokens: Int[Tensor, "batch pos"],
    qp: Int[Tensor, "batch"],
    shift: int,
    vocab: int,
    rng: np.random.Generator,
) -> Int[Tensor, "batch pos"]:
    """The content moved right by ``shift``: fresh fillers in front, the tail dropped."""
    n, seq_len = tokens.shape
    if int(qp.max()) + shift >= seq_len:
        raise ValueError(
            f"shift={shift} moves a query past the sequence end (query at {int(qp.max())}, "
            f"{seq_len} positions): use a smaller shift or sequences with more tail filler"
        )
    fill = torch.as_tensor(rng.integers(vocab // 2, vocab, size=(n, shift)))
    return torch.cat([fill, tokens[:, : seq_len - shift]], dim=1)


def _answer_replaced(
    tokens: Int[Tensor, "batch pos"],
    source: Int[Tensor, "batch"],
    qp: Int[Tensor, "batch"],
    ans: Int[Tensor, "batch"],
    vocab: int,
    rng: np.random.Generator,
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch"]]:
    """``(corrupted tokens, the replacing value)``: the needle's value swapped for another."""
    n, seq_len = tokens.shape
    ar = torch.arange(n)
    corrupted = tokens.clone()
    # another value from the value range (keys sit in [1, V/2), values in [V/2, V))
    other = torch.as_tensor(rng.integers(vocab // 2, vocab - 1, size=n))
    other = other + (other >= ans).long()
    corrupted[ar, source] = other
    after = qp + 1  # keep the query's own copy of the value consistent
    inside = after < seq_len
    corrupted[ar[inside], after[inside]] = other[inside]
    return corrupted, other


def make_contrast(
    ds: Dataset,
    kind: str = "grid",
    *,
    stride: int,
    grid_offset: int = 0,
    shift: int | None = None,
    n_pairs: int | None = 256,
    seed: int = 0,
) -> Contrast:
    """Pairs from a task dataset: the first ``n_pairs`` sequences, one target each (drawn with
    ``seed``). ``shift`` (``grid``/``content``, default ``stride // 2``) must not be a multiple
    of ``stride`` (the phase would not change). Phases are on the grid ``(stride, grid_offset)``.
    """
    shift, n = _check_contrast(ds, kind, stride, grid_offset, shift, n_pairs)
    rows = ds.select(range(n))
    tokens, query_pos, answer = to_tensors(rows)
    rng = np.random.default_rng(seed)
    pick = torch.as_tensor(rng.integers(0, query_pos.shape[1], size=n))
    ar = torch.arange(n)
    qp, ans = query_pos[ar, pick], answer[ar, pick]
    df = _picked_targets(rows, pick, stride, grid_offset)
    foil = torch.full((n,), -1, dtype=torch.long)
    corrupted_grid = torch.zeros(n, dtype=torch.long)
    vocab = _vocab_size(ds, tokens)
    if kind == "grid":
        corrupted = tokens.clone()
        corrupted_grid += shift
        df["corrupted_phase"] = phase_of(df.source_pos.to_numpy(), stride, grid_offset + shift)
    elif kind == "content":
        corrupted = _content_shifted(tokens, qp, shift, vocab, rng)
        df["corrupted_phase"] = phase_of(df.source_pos.to_numpy() + shift, stride, grid_offset)
    else:
        source = torch.tensor(df.source_pos.to_numpy())
        corrupted, foil = _answer_replaced(tokens, source, qp, ans, vocab, rng)
        df["corrupted_phase"] = df["phase"]
    return Contrast(
        kind=kind,
        clean_tokens=tokens,
        corrupted_tokens=corrupted,
        clean_grid=torch.zeros(n, dtype=torch.long),
        corrupted_grid=corrupted_grid,
        query_pos=qp,
        answer=ans,
        foil=foil,
        stride=stride,
        shift=shift,
        pairs=df,
    )


def _vocab_size(ds: Dataset, tokens: Tensor) -> int:
    task = task_of(ds)
    return int(task.vocab_size) if task is not None else int(tokens.max()) + 1


def metric_values(
    logits: Float[Tensor, "copy vocab"],
    answer: Int[Tensor, "copy"],
    foil: Int[Tensor, "copy"],
    metric: str,
) -> Float[Tensor, "copy"]:
    """The per-pair metric from answer-position logits."""
    right = logits.gather(-1, answer[:, None])[:, 0]
    if metric == "margin":
        return right - logits.scatter(-1, answer[:, None], float("-inf")).amax(-1)
    if metric == "logit_diff":
        return right - logits.gather(-1, foil[:, None])[:, 0]
    lp = logits.log_softmax(-1).gather(-1, answer[:, None])[:, 0]
    return lp if metric == "logprob" else lp.exp()


__all__ = ["Contrast", "check_choice", "make_contrast", "metric_values"]
