"""``kpool``: pools of consecutive tokens scored by their best token (a post-hoc stand-in for
GLM-5.3's k-pool indexer).

Axes: ``batch, head, kv_head, pos, row, block, slot``. The blocks of the grid are the pools (``d``
consecutive tokens; ``block_len > d`` makes them overlap); a pool's score for query ``q`` is
``max_j q . k_j`` over its real tokens' post-RoPE keys, with the model's own query heads (the
real system scores with a small learned indexer; this rule needs no training). The ``top_k``
best candidate pools are kept and attended raw with the raw window
(:mod:`phasemech.attention.selection`). Scoring touches every key (``O(T^2)`` products, like
dense attention's score pass), in row chunks, so its memory stays ``O(chunk x T)``. No
parameters. Selection has no gradient.
"""

from __future__ import annotations

from phasemech.attention.selection import ROW_CHUNK, SelectingAttention


class KPoolAttention(SelectingAttention):
    design = "kpool"

    def row_chunk(self, seq: int) -> int:
        # scores of a chunk hold [row, key] (and the same again gathered per slot)
        return max(16, min(ROW_CHUNK, (ROW_CHUNK * 1024) // max(seq, 1)))

    def block_scores(self, summary, q, rows, k, geo):
        return self._slot_scores(q, rows, k, geo).amax(-1)
