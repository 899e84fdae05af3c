"""The explanation's ``groups`` step, driver side: which groups of heads it ablates, each
prompt's resample source, and the tables of its results; and the selection read at the heads
that read the needle (``reader_recall``).

Axes: ``prompt``, ``layer``, ``head``, ``phase``, ``unit`` (a group of heads: ``top k``, the
``k`` heads that read the needle most under the null, or ``layer L``, every head of layer
``L``), ``mode`` (``zero``, ``mean``, ``resample``).

A unit enters the lab's effects table (:func:`~phasemech.interventions.ablation_result.
phase_effects`) and its specialisation test (:func:`~phasemech.interventions.specialization.
specialization`) as a head ablation whose ``(layer, unit)`` encodes the group: ``(-1, k)`` for
``top k``, ``(L, -1)`` for ``layer L``; the tables name it in ``group`` and list its heads.

Tables (under ``OUT``):

* ``group_ablation.parquet``: per (group, mode, metric, phase) the effect (ablated - intact;
  ``logit_diff`` = the answer's margin at the first answer token, ``accuracy`` = that margin
  > 0) with its cluster-bootstrap interval (contents resampled), the intact and ablated means;
  ``group_ablation_specialization.parquet``: its per-unit specialisation test (Holm over every
  group and mode of one metric, ``n_perm="auto"`` draws sized to that family: its ``n_perm``,
  ``p_floor``, ``p_holm_floor``);
* ``needle_readers.parquet``: every head by the null's mean attention from the answer row onto
  the needle (``rank`` 1 = reads it most);
* ``reader_recall.parquet``: per (readers, phase) the selection recall of the needle's block
  at the top ``k`` needle-reading heads among the selecting heads (``readers = "top k"``),
  beside every selecting head (``"every head"``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from phasemech.experiments.explain.tables import margin_tables
from phasemech.interventions.ablation_plan import AblationRun
from phasemech.interventions.group_ablation import GROUP_MODES

#: a group unit's name and its heads
Unit = tuple[str, tuple[tuple[int, int], ...]]


def needle_readers(attention: pd.DataFrame, among: pd.DataFrame | None = None) -> pd.DataFrame:
    """Heads by the null model's mean attention from the answer row onto the needle (over
    every prompt), largest first, with their ``rank``; ``among``: only heads listed there
    (``layer``, ``head`` columns)."""
    att = attention[attention.setting == "null"]
    mass = att.groupby(["layer", "head"], as_index=False).mass.mean()
    if among is not None:
        keep = among[["layer", "head"]].drop_duplicates()
        mass = mass.merge(keep, on=["layer", "head"])
    # ties: the lower layer and head first (a stable, seed-free order)
    mass = mass.sort_values(["mass", "layer", "head"], ascending=[False, True, True])
    return mass.reset_index(drop=True).assign(rank=lambda x: np.arange(1, len(x) + 1))


def head_groups(readers: pd.DataFrame, sizes, n_layers: int, n_heads: int) -> list[Unit]:
    """The ``groups`` step's units: the top ``k`` needle readers for each ``k`` of ``sizes``
    (at most every head), then every layer's heads together."""
    top = list(zip(readers.layer.astype(int), readers["head"].astype(int), strict=True))
    units = [(f"top {k}", tuple(top[:k])) for k in sorted(sizes) if k <= len(top)]
    units += [(f"layer {i}", tuple((i, h) for h in range(n_heads))) for i in range(n_layers)]
    return units


def resample_sources(prompts: pd.DataFrame, seed: int) -> dict[int, int] | None:
    """Each prompt's resample source: a prompt of ANOTHER content at ANOTHER phase, drawn
    from ``seed`` (one content shift per content, one phase shift per prompt); None with
    fewer than two contents or phases (no such prompt)."""
    groups = sorted(prompts.group_id.unique())
    phases = sorted(prompts.phase.unique())
    if len(groups) < 2 or len(phases) < 2:
        return None
    rng = np.random.default_rng([seed, 49])
    g_shift = dict(zip(groups, rng.integers(1, len(groups), len(groups)), strict=True))
    rows = prompts.sort_values("prompt_id")
    by = {(g, p): int(i) for g, p, i in zip(rows.group_id, rows.phase, rows.prompt_id,
                                            strict=True)}  # fmt: skip
    out = {}
    for (g, p), i in by.items():  # prompt order: the draws follow it
        g2 = groups[(groups.index(g) + g_shift[g]) % len(groups)]
        p2 = phases[(phases.index(p) + int(rng.integers(1, len(phases)))) % len(phases)]
        if (g2, p2) in by:
            out[i] = by[(g2, p2)]
    return out


def _encode(label: str) -> tuple[int, int]:
    kind, n = label.split()
    return (-1, int(n)) if kind == "top" else (int(n), -1)


def group_tables(
    results: list[dict], stride: int, n_boot: int, seed: int, n_perm: int | str
) -> dict[str, pd.DataFrame | None]:
    """``group_ablation`` and ``group_ablation_specialization`` from the step's per-prompt
    results (module doc; each names its units and their heads)."""
    items = sorted((p for p in results if "groups" in p), key=lambda p: p["prompt"]["prompt_id"])
    if not items:
        return {"group_ablation": None, "group_ablation_specialization": None}
    labels = [label for label, _ in items[0]["units"]]
    heads = {label: [tuple(h) for h in hs] for label, hs in items[0]["units"]}
    modes = [m for m in GROUP_MODES if m in items[0]["groups"]]
    runs = [AblationRun("head", m, *_encode(u)) for m in modes for u in labels]
    # Holm runs over every unit x mode: ``"auto"`` sizes the draws so its smallest p can reach
    # 0.001 (the head test's rule)
    effects, spec = margin_tables(items, "groups", runs, stride, n_boot, seed, n_perm)
    return {
        "group_ablation": _named(effects, labels, heads),
        "group_ablation_specialization": _named(spec, labels, heads),
    }


def _named(df: pd.DataFrame, labels: list[str], heads: dict) -> pd.DataFrame:
    """``df`` with each unit's ``group`` label, ``heads`` (``L19H8,L18H6``) and ``n_heads``."""
    code = {_encode(u): u for u in labels}
    names = [code[(int(a), int(b))] for a, b in zip(df.layer, df.unit, strict=True)]
    text = {u: ",".join(f"L{a}H{b}" for a, b in heads.get(u, ())) for u in labels}
    return df.assign(group=names, heads=[text[u] for u in names],
                     n_heads=[len(heads.get(u, ())) for u in names])  # fmt: skip


def reader_recall(selection: pd.DataFrame, attention: pd.DataFrame, sizes) -> pd.DataFrame:
    """Selection recall per phase at the top ``k`` needle-reading heads among the selecting
    heads (``readers = "top k"``, ``heads`` named), beside every selecting head."""
    readers = needle_readers(attention, among=selection)
    rows = []
    for k in [*sorted(sizes), None]:
        if k is not None and k > len(readers):
            continue
        top = readers if k is None else readers.head(k)
        sel = selection.merge(top[["layer", "head"]], on=["layer", "head"])
        by = sel.groupby("phase")
        for phase, g in by:
            rows.append(dict(readers="every head" if k is None else f"top {k}", phase=int(phase),
                             recall=g.selected.mean(), rank=g["rank"].median(),
                             n_heads=len(top), n=len(g),
                             heads="" if k is None else ",".join(
                                 f"L{a}H{b}" for a, b in zip(top.layer, top["head"],
                                                             strict=True))))  # fmt: skip
    return pd.DataFrame(rows)


__all__ = [
    "Unit",
    "group_tables",
    "head_groups",
    "needle_readers",
    "reader_recall",
    "resample_sources",
]
