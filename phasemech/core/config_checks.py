"""The checks of :mod:`phasemech.core.config` that stand apart from its dataclasses: the error
every field check raises, explicit grid offsets frozen into nested tuples, and the refusal of a
compression that could never act in a model's context.

Axes: ``layer``, ``kv_head`` (an explicit offset per KV head, or per layer and KV head),
``block`` (one compressed cache entry). Every check raises ``ValueError`` naming the field
(``CompressionConfig.<field>``), the bad value and what is allowed, before any work starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phasemech.core.designs import OFFSET_MODES, SELECTING_DESIGNS, OffsetSpec
from phasemech.core.grid import last_query_blocks
from phasemech.core.validation import is_int


def invalid_field(field_name: str, value: Any, allowed: str) -> ValueError:
    """The error for ``CompressionConfig.<field_name>=value``, saying what is allowed."""
    return ValueError(f"CompressionConfig.{field_name}={value!r} is invalid: {allowed}")


def freeze_offsets(value: Any) -> OffsetSpec:
    """Turn a tensor / array / list of explicit offsets into nested tuples of ints."""
    if isinstance(value, str):
        return value
    if hasattr(value, "tolist"):  # torch.Tensor or numpy array
        value = value.tolist()
    if is_int(value):
        return int(value)
    if isinstance(value, Sequence) and len(value) > 0:
        if all(is_int(v) for v in value):
            return tuple(int(v) for v in value)
        if all(isinstance(v, Sequence) and len(v) > 0 and all(is_int(x) for x in v) for v in value):
            rows = tuple(tuple(int(x) for x in v) for v in value)
            if len({len(r) for r in rows}) != 1:
                raise invalid_field(
                    "offsets", value, "explicit offset rows must all have the same length"
                )
            return rows
    raise invalid_field(
        "offsets",
        value,
        f"use one of {OFFSET_MODES}, an int, a [kv_head] or [layer, kv_head] sequence/tensor "
        "of ints",
    )


def check_compression_acts(c: Any, n_ctx: int, offsets: set[int]) -> None:
    """Refuse a compression that could never change the model in ``n_ctx`` positions: no
    query ever reads a block, or ``route``/``evict`` always keep every block. Such a model
    would silently be the dense one. ``c``: a checked ``CompressionConfig``; ``offsets``: the
    grid offsets the layers can have."""
    if c.window >= n_ctx and c.block_scope != "all":
        raise ValueError(
            f"CompressionConfig.window={c.window} is invalid with n_ctx={n_ctx}: the raw window "
            "already holds every past token of every query, so nothing would be compressed; "
            "allowed window < n_ctx (or block_scope='all')"
        )
    reach = [
        last_query_blocks(n_ctx, c.stride, c.block_len, c.window, c.visibility, o, c.block_scope)
        for o in sorted(offsets)
    ]
    if max(used for used, _ in reach) == 0:
        raise ValueError(
            f"CompressionConfig.stride={c.stride} is invalid with n_ctx={n_ctx} "
            f"(visibility={c.visibility!r}, offsets={c.offsets!r}): no chunk closes early "
            "enough for any query to read it, so nothing would be compressed; use a stride "
            "below n_ctx"
        )
    ranked = max(r for _, r in reach)
    if c.design in SELECTING_DESIGNS and c.top_k is not None and c.top_k >= ranked:
        fix = f"allowed top_k < {ranked}" if ranked > 1 else "use a smaller window or stride"
        raise ValueError(
            f"CompressionConfig.top_k={c.top_k} is invalid with n_ctx={n_ctx}: a query has at "
            f"most {ranked} block(s) to choose from, so {c.design!r} would keep them all (the "
            f"dense model); {fix}"
        )
