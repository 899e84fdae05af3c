"""Per-phase evaluation of a model on a retrieval dataset.

:func:`predict` scores every target (one row per target: the task columns of
:func:`phasemech.data.tasks.targets_frame` plus ``correct``, ``logprob`` and ``margin``);
:func:`evaluate` adds the statistics template of :mod:`phasemech.measure.stats` on the model's
reference grid. Clusters for the statistics are *contents* (``group_id``): in a phase-balanced
set the ``stride`` shifted copies of one content are correlated, so they are resampled together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from datasets import Dataset

from phasemech.core.config import is_int
from phasemech.core.device import model_device
from phasemech.core.grid import phase_of, reference_grid
from phasemech.core.io import atomic_write, write_json_atomic
from phasemech.data.tasks import targets_frame, task_of, to_tensors
from phasemech.measure.readout import answer_logits
from phasemech.measure.stats import PhaseReport, phase_report
from phasemech.model.transformer import PhaseTransformer


@torch.no_grad()
def predict(model: PhaseTransformer, ds: Dataset, batch_size: int = 256) -> pd.DataFrame:
    """One row per target with ``correct`` (greedy answer), ``logprob`` of the answer and
    ``margin`` (answer logit minus the best other logit)."""
    if len(ds) == 0:
        raise ValueError("dataset is empty: nothing to evaluate")
    seq_len = len(ds[0]["input_ids"])
    if seq_len > model.cfg.n_ctx:
        raise ValueError(
            f"sequences of {seq_len} tokens exceed the model's n_ctx={model.cfg.n_ctx}"
        )
    was_training = model.training
    model.eval()
    tokens, query_pos, answer = to_tensors(ds)
    dev = model_device(model)  # data are built on the CPU; the model may sit on a GPU
    correct, logprob, margin = [], [], []
    for i in range(0, len(tokens), batch_size):
        chunk = slice(i, i + batch_size)
        logits = answer_logits(model, tokens[chunk].to(dev), query_pos[chunk].to(dev))
        ans = answer[chunk].to(dev)
        lp = logits.log_softmax(-1)
        logprob.append(lp.gather(-1, ans[..., None])[..., 0])
        correct.append(logits.argmax(-1) == ans)
        right = logits.gather(-1, ans[..., None])[..., 0]
        margin.append(right - logits.scatter(-1, ans[..., None], -torch.inf).amax(-1))
    model.train(was_training)
    df = targets_frame(ds)
    df["correct"] = torch.cat(correct).flatten().cpu().numpy()
    df["logprob"] = torch.cat(logprob).flatten().cpu().numpy()
    df["margin"] = torch.cat(margin).flatten().cpu().numpy()
    return df


@dataclass(frozen=True)
class Evaluation:
    targets: pd.DataFrame  # one row per target, ``phase`` on the reference grid
    report: PhaseReport
    stride: int
    grid_offset: int
    grid_note: str

    def save(self, out: str | Path) -> Path:
        """``targets.parquet`` plus the report's parquet and JSON files under ``out``."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "targets.parquet", lambda tmp: self.targets.to_parquet(tmp))
        self.report.save(out)
        meta = {"stride": self.stride, "grid_offset": self.grid_offset, "grid": self.grid_note}
        write_json_atomic(out / "grid.json", meta)
        return out


def grid_note(model: PhaseTransformer) -> tuple[int, int, str]:
    """``(stride, offset, sentence)``: the grid phases are reported on, stated for the reader."""
    comp = model.cfg.compression
    stride, offset = reference_grid(comp)
    if not comp.enabled:
        return (
            stride,
            offset,
            (f"dense model: phases on the stride-{stride} grid of its matched compressed models"),
        )
    spec = comp.offsets
    if spec == "aligned" or isinstance(spec, int):
        return stride, offset, f"the model's own grid (stride {stride}, offset {offset})"
    base = comp.base_offsets(model.cfg.n_layers, model.cfg.n_kv_heads)
    return (
        stride,
        offset,
        (
            f"reference grid stride {stride}, offset {offset}; the model's heads use offsets "
            f"'{spec}' ({base[comp.compressed_layers(model.cfg.n_layers)].tolist()} per "
            "compressed layer and KV head)"
            if spec != "random"
            else f"reference grid stride {stride}, offset {offset} (the evaluation offset of a "
            "model trained with random offsets)"
        ),
    )


def evaluate(
    model: PhaseTransformer,
    ds: Dataset,
    *,
    stride: int | None = None,
    grid_offset: int | None = None,
    seed: int = 0,
    n_boot: int = 1000,
    n_perm: int = 1000,
    batch_size: int = 256,
) -> Evaluation:
    """Score ``model`` on ``ds`` and compute the full per-phase statistics template.

    Phases are taken on the model's reference grid (:func:`grid_note`) unless ``stride`` /
    ``grid_offset`` name another one (e.g. a dense model scored on a stride-4 grid).
    """
    m_stride, m_offset, note = grid_note(model)
    if stride is not None or grid_offset is not None:
        m_stride = m_stride if stride is None else stride
        if not is_int(m_stride) or m_stride < 2:
            raise ValueError(f"stride={m_stride!r} is invalid for a phase report: need >= 2")
        # a stated stride alone keeps the model's offset (reduced onto the new grid)
        m_offset = m_offset % m_stride if grid_offset is None else grid_offset
        note = f"stated grid stride {m_stride}, offset {m_offset}"
    if m_stride < 2:
        raise ValueError(f"stride={m_stride} is invalid for a phase report: need >= 2")
    task = task_of(ds)
    if task is not None and task.stride % m_stride:
        raise ValueError(
            f"stride={m_stride} does not divide the dataset's stride={task.stride}: its phases "
            "would not be balanced nor independent of depth; generate the data with a stride "
            f"that is a multiple of {m_stride}"
        )
    df = predict(model, ds, batch_size)
    df["phase"] = phase_of(df["source_pos"].to_numpy(), m_stride, m_offset)
    # cluster = content (see module docstring); a block = one target of one content, seen at
    # every shift in a phase-balanced set (the paired test uses complete blocks only)
    pair_id = df["group_id"] * (df["target"].max() + 1) + df["target"]
    stats_df = df.assign(seq_id=df["group_id"], pair_id=pair_id)
    report = phase_report(stats_df, m_stride, n_boot=n_boot, n_perm=n_perm, seed=seed)
    return Evaluation(df, report, m_stride, m_offset, note)


__all__ = [
    "Evaluation",
    "evaluate",
    "grid_note",
    "predict",
]
