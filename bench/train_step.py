"""One training step of a ``PhaseTransformer`` beside a plain-PyTorch model of the same size and
the same compression rule, on the same batch, side by side in one run (one thread each).

The plain model is written here from the rule alone (2 attention-only layers with pre-LN and
learned positions; layer 2 attends its raw window of W tokens and one pooled entry per
complete block outside it, in one softmax; mean or scalar-gated pooling), as a user of plain
PyTorch would write it: fused QKV, SDPA for the dense layer, dense masks. A third column times
the ``PhaseTransformer`` step with a hook attached to every ``hook_pattern`` (the path that
feeds hooks), to show what hooks cost when they are used.

    .venv/bin/python bench/train_step.py               # gated and mean, H = 2 and 4
    .venv/bin/python bench/train_step.py --design gated --heads 2 --repeats 9
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import typer

from phasemech.core.config import CompressionConfig
from phasemech.data.tasks import MQARTask, training_batch
from phasemech.measure.readout import answer_logits
from phasemech.training.config import ModelSpec, TrainConfig


class PlainCompressed(nn.Module):
    """Layer 2: raw window ``W`` plus pooled blocks ``[c*d, c*d + d - 1]`` ending at or before
    ``t - W``, one softmax."""

    def __init__(self, m: int, h: int, seq: int, d: int, window: int, gated: bool):
        super().__init__()
        self.h, self.d, self.gated = h, d, gated
        self.qkv, self.o = nn.Linear(m, 3 * m), nn.Linear(m, m)
        self.w_gate = nn.Parameter(torch.zeros(h, m)) if gated else None
        self.bias = nn.Parameter(torch.zeros(h, d)) if gated else None
        t = torch.arange(seq)[:, None]
        ends = torch.arange(seq // d) * d + d - 1
        raw = (torch.arange(seq)[None] <= t) & (torch.arange(seq)[None] > t - window)
        self.register_buffer("mask", torch.cat([ends[None] <= t - window, raw], 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, seq, m = x.shape
        h, d, nb = self.h, self.d, seq // self.d
        q, k, v = self.qkv(x).view(b, seq, 3, h, m // h).permute(2, 0, 3, 1, 4)
        if self.gated:
            logits = (
                torch.einsum("btm,hm->bht", x, self.w_gate).view(b, h, nb, d)
                + self.bias[None, :, None]
            )
            a = logits.softmax(-1)[..., None]
        else:
            a = torch.full((1, 1, 1, d, 1), 1.0 / d)
        kb = (a * k[:, :, : nb * d].reshape(b, h, nb, d, -1)).sum(3)
        vb = (a * v[:, :, : nb * d].reshape(b, h, nb, d, -1)).sum(3)
        scores = q @ torch.cat([kb, k], 2).transpose(-1, -2) / math.sqrt(m // h)
        p = scores.masked_fill(~self.mask, float("-inf")).softmax(-1)
        z = p @ torch.cat([vb, v], 2)
        return self.o(z.transpose(1, 2).reshape(b, seq, m))


class PlainDense(nn.Module):
    def __init__(self, m: int, h: int):
        super().__init__()
        self.h, self.qkv, self.o = h, nn.Linear(m, 3 * m), nn.Linear(m, m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, seq, m = x.shape
        q, k, v = self.qkv(x).view(b, seq, 3, self.h, m // self.h).permute(2, 0, 3, 1, 4)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(z.transpose(1, 2).reshape(b, seq, m))


class PlainModel(nn.Module):
    def __init__(self, vocab: int, seq: int, m: int, h: int, d: int, window: int, design: str):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, m), nn.Embedding(seq, m)
        self.norms = nn.ModuleList([nn.LayerNorm(m), nn.LayerNorm(m)])
        second = PlainCompressed(m, h, seq, d, window, design == "gated")
        self.layers = nn.ModuleList([PlainDense(m, h), second])
        self.final, self.out = nn.LayerNorm(m), nn.Linear(m, vocab)

    def forward(self, tokens: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for norm, layer in zip(self.norms, self.layers, strict=True):
            x = x + layer(norm(x))
        picked = x.gather(1, query_pos[..., None].expand(-1, -1, x.shape[-1]))
        return self.out(self.final(picked))


def _step(forward, params, batch) -> None:
    tokens, qp, ans = batch
    opt = _step.opts.setdefault(id(params), torch.optim.AdamW(params, lr=1e-3))
    loss = F.cross_entropy(forward(tokens, qp).flatten(0, 1), ans.flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


_step.opts = {}


def _time(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1000


def compare(design: str, heads: int, stride: int, repeats: int, steps: int) -> dict:
    """Best-of-``repeats`` ms per step of the three, interleaved so load hits them alike."""
    task = MQARTask(stride=stride)
    cfg = TrainConfig(
        task=task,
        model=ModelSpec(n_heads=heads),
        compression=CompressionConfig(design, stride=stride, window=2 * stride, layers=(1,)),
    )
    pm = cfg.build_model()
    plain = PlainModel(64, task.seq_len, 64, heads, stride, 2 * stride, design)
    batch = training_batch(task, cfg.batch_size, 0, 0)
    params_pm, params_plain = list(pm.parameters()), list(plain.parameters())

    def hooked_step():
        with pm.hooks(fwd_hooks=[(lambda n: n.endswith("hook_pattern"), lambda t, hook: t)]):
            _step(lambda x, qp: answer_logits(pm, x, qp), params_pm, batch)

    runs = {
        "phasemech": lambda: _step(lambda x, qp: answer_logits(pm, x, qp), params_pm, batch),
        "plain": lambda: _step(plain, params_plain, batch),
        "phasemech_hooked": hooked_step,
    }
    best = {k: math.inf for k in runs}
    for fn in runs.values():
        _time(fn, 3)  # warm-up
    for _ in range(repeats):
        for k, fn in runs.items():
            best[k] = min(best[k], _time(fn, steps))
    return best


def main(
    design: str = "gated,mean",
    heads: str = "2,4",
    stride: int = 4,
    repeats: int = 7,
    steps: int = 10,
) -> None:
    torch.set_num_threads(1)
    print("design heads | phasemech ms | plain ms | ratio | phasemech with hooks ms")
    for dsg in design.split(","):
        for h in map(int, heads.split(",")):
            r = compare(dsg, h, stride, repeats, steps)
            print(
                f"{dsg:6s} {h:5d} | {r['phasemech']:12.1f} | {r['plain']:8.1f} | "
                f"{r['phasemech'] / r['plain']:5.2f} | {r['phasemech_hooked']:.1f}"
            )


if __name__ == "__main__":
    typer.run(main)
