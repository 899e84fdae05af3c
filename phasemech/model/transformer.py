"""``PhaseTransformer``: a TransformerLens ``HookedTransformer`` with chunked KV compression.

Axes: ``batch, pos, head, kv_head, block, slot, phase``.

The model is built as a plain ``HookedTransformer`` (same initialisation, same parameter names),
then the attention module of every compressed layer is swapped for the design's compressed module
(``phasemech.attention``) with the same weights, and ``setup()`` is re-run so the new hook points
are named. Uncompressed layers are TransformerLens' own modules, untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import Tensor
from transformer_lens import HookedTransformer, HookedTransformerConfig

from phasemech.attention import DESIGN_CLASSES, CompressedAttentionMixin, make_attention_class
from phasemech.core.config import CompressionConfig, PhaseTransformerConfig
from phasemech.core.io import atomic_write
from phasemech.model.fast import use_fast_modules

CONFIG_FILE = "config.json"
#: compressed-layer hooks without a position axis (no ``pos_slice`` when caching)
POSITIONLESS_HOOKS = ("hook_grid_offset", "hook_k_block", "hook_v_block", "hook_block_weights")
WEIGHTS_FILE = "model.safetensors"


@contextlib.contextmanager
def quiet_tl_deprecation() -> Iterator[None]:
    """Silence TL 3.9's HookedTransformer DeprecationWarning where we construct models."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="HookedTransformer is deprecated", category=DeprecationWarning
        )
        yield


class GridState:
    """Per-forward grid shifts shared by a model's compressed layers (a plain object, not a module).

    ``random`` offsets draw one shift per sequence per training forward (torch's global RNG, so
    ``torch.manual_seed`` makes them reproducible), shared by every layer of that forward.
    """

    def __init__(self, compression: CompressionConfig):
        self.compression = compression
        self.user_shift: int | Tensor | None = None
        self.training = False
        self._drawn: Tensor | None = None

    def begin_forward(self, training: bool) -> None:
        self.training = training
        self._drawn = None

    def shift(self, batch: int, device: torch.device) -> Int[Tensor, "batch"]:
        c = self.compression
        out = torch.zeros(batch, dtype=torch.long, device=device)
        if c.offsets == "random":
            if self.training:
                if self._drawn is None or self._drawn.shape[0] != batch:
                    self._drawn = torch.randint(0, c.stride, (batch,))
                out = out + self._drawn.to(device)
            else:
                out = out + c.eval_offset
        if self.user_shift is not None:
            user = torch.as_tensor(self.user_shift, dtype=torch.long, device=device)
            if user.ndim == 1 and user.shape[0] != batch:
                raise ValueError(
                    f"shift_grid got {user.shape[0]} shifts for a batch of {batch}: "
                    "give one int or one per sequence"
                )
            out = out + user
        return out


def _as_phase_config(cfg: Any) -> PhaseTransformerConfig:
    if isinstance(cfg, PhaseTransformerConfig):
        return cfg
    if isinstance(cfg, dict):
        return PhaseTransformerConfig(**cfg)
    if isinstance(cfg, HookedTransformerConfig):
        return PhaseTransformerConfig(**_tl_fields(cfg))
    raise ValueError(
        f"cfg={type(cfg).__name__} is invalid: expected a PhaseTransformerConfig, a "
        "HookedTransformerConfig or a dict"
    )


def _tl_fields(cfg: HookedTransformerConfig) -> dict[str, Any]:
    return {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(HookedTransformerConfig) if f.init
    }


class PhaseTransformer(HookedTransformer):
    """A ``HookedTransformer`` whose chosen layers compress their KV cache in fixed-stride chunks.

    Example::

        cfg = PhaseTransformerConfig(n_layers=2, d_model=64, n_ctx=64, d_head=16, d_vocab=64,
                                     attn_only=True, act_fn=None, seed=0,
                                     compression=CompressionConfig("gated", stride=4))
        model = PhaseTransformer(cfg)
        logits, cache = model.run_with_cache(tokens)
        cache["blocks.1.attn.hook_k_block"]  # [batch, block, kv_head, d_head]
    """

    cfg: PhaseTransformerConfig

    def __init__(
        self,
        cfg: PhaseTransformerConfig | HookedTransformerConfig | dict,
        tokenizer: Any = None,
        move_to_device: bool = True,
        default_padding_side: Any = None,
    ):
        cfg = _as_phase_config(cfg)
        with quiet_tl_deprecation():
            super().__init__(cfg, tokenizer, move_to_device, default_padding_side)
        self.grid_state = GridState(cfg.compression)
        self._swap_attention()
        # fused LayerNorm and dense attention while their extra hooks are free (model/fast.py)
        use_fast_modules(self)
        self.setup()

    # ------------------------------------------------------------------ construction
    def _swap_attention(self) -> None:
        comp = self.cfg.compression
        # state-dict keys a plain TL model lacks (the compressors): from_hooked must not expect them
        self.compressor_keys: set[str] = set()
        if not comp.enabled:
            return
        base = comp.base_offsets(self.cfg.n_layers, self.cfg.n_kv_heads)
        grouped = self.cfg.n_key_value_heads is not None
        cls = make_attention_class(DESIGN_CLASSES[comp.design], grouped)
        for i in comp.compressed_layers(self.cfg.n_layers):
            block = self.blocks[i]
            old = block.attn
            device = old.W_Q.device
            new = cls(self.cfg, old.attn_type, i)
            missing, unexpected = new.load_state_dict(old.state_dict(), strict=False)
            if unexpected:
                raise RuntimeError(f"layer {i}: unexpected attention weights {unexpected}")
            self.compressor_keys |= {f"blocks.{i}.attn.{k}" for k in missing}
            new.to(device)
            new.base_offset.copy_(torch.as_tensor(base[i], dtype=torch.long))
            new._grid_state = self.grid_state
            block.attn = new

    @classmethod
    def from_hooked(
        cls, model: HookedTransformer, compression: CompressionConfig
    ) -> PhaseTransformer:
        """The same model (same weights, tokenizer, device) with ``compression`` applied post hoc.

        ``mean``, ``route`` and ``evict`` have no parameters, so the result runs as is; ``gated``
        and ``mlp`` get freshly initialised compressors (``gated`` starts close to mean pooling).
        """
        if not isinstance(compression, CompressionConfig):
            raise ValueError(
                f"compression={compression!r} is invalid: expected a CompressionConfig"
            )
        fields = _tl_fields(model.cfg)
        init_weights = fields["init_weights"]
        fields["init_weights"] = False  # weights come from `model`: skip a wasted init
        cfg = PhaseTransformerConfig(**fields, compression=compression)
        new = cls(cfg, tokenizer=model.tokenizer, move_to_device=False)
        missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
        if unexpected or set(missing) - new.compressor_keys:
            raise RuntimeError(
                f"weights do not match: missing {sorted(set(missing) - new.compressor_keys)}, "
                f"unexpected {unexpected}"
            )
        new.cfg.init_weights = init_weights
        device = next(model.parameters()).device
        if next(new.parameters()).device != device:
            # by full name: TransformerLens keeps cfg.device, and moves activations there
            new.to(str(device), print_details=False)
        return new

    # ------------------------------------------------------------------ switches
    def set_use_token_pattern(self, use_token_pattern: bool) -> None:
        """Compute ``hook_token_pattern`` on every forward (``O(T^2)`` memory per layer)."""
        self.cfg.use_token_pattern = use_token_pattern

    @contextlib.contextmanager
    def shift_grid(self, shift: int | Tensor) -> Iterator[None]:
        """Shift every compressed layer's grid by ``shift`` (an int, or one per sequence) inside
        the ``with`` block: same tokens, different phases (the cleanest phase contrast)."""
        if isinstance(shift, Tensor):
            if shift.is_floating_point() or shift.ndim > 1:
                raise ValueError(
                    f"shift_grid: shift has dtype {shift.dtype} and {shift.ndim} dims: "
                    "expected an int or a 1-D integer tensor [batch]"
                )
        elif isinstance(shift, bool) or not isinstance(shift, int):
            raise ValueError(f"shift_grid: shift={shift!r} is invalid: expected an int or tensor")
        previous = self.grid_state.user_shift
        self.grid_state.user_shift = shift
        try:
            yield
        finally:
            self.grid_state.user_shift = previous

    def compressed_layers(self) -> list[int]:
        return self.cfg.compression.compressed_layers(self.cfg.n_layers)

    @contextlib.contextmanager
    def keep_every_block(self, on: bool = True) -> Iterator[None]:
        """Inside the ``with`` block (when ``on``), the selecting layers keep every candidate
        block instead of their top-k: dense attention over the candidates (training's
        ``selection_warmup``, DSA's dense warm-up)."""
        layers = [b.attn for b in self.blocks if hasattr(b.attn, "keep_all")]
        previous = [a.keep_all for a in layers]
        for a in layers:
            a.keep_all = on or a.keep_all
        try:
            yield
        finally:
            for a, was in zip(layers, previous, strict=True):
                a.keep_all = was

    def auxiliary_loss(self) -> Tensor | None:
        """The sum of the auxiliary losses the last training forward left on its layers (a
        learned selector's own objective: ``dsa``'s indexer KL), or ``None``. Training adds it
        to the task loss."""
        terms = [getattr(b.attn, "aux_loss", None) for b in self.blocks]
        terms = [t for t in terms if t is not None]
        return sum(terms[1:], terms[0]) if terms else None

    # ------------------------------------------------------------------ forward
    def _check_tokens(self, tokens: Any) -> None:
        if not isinstance(tokens, Tensor):
            return  # strings: TransformerLens tokenizes them
        if tokens.is_floating_point() or tokens.dtype == torch.bool or tokens.is_complex():
            raise ValueError(
                f"tokens have dtype {tokens.dtype}: expected integer token ids "
                "(to feed residual activations, pass start_at_layer)"
            )
        if tokens.ndim not in (1, 2):
            raise ValueError(
                f"tokens have shape {tuple(tokens.shape)}: expected [batch, pos] or [pos]"
            )
        if tokens.numel() == 0:
            raise ValueError(
                f"tokens have shape {tuple(tokens.shape)}: need at least one sequence and one "
                "position"
            )
        seq = tokens.shape[-1]
        if seq > self.cfg.n_ctx:
            raise ValueError(f"tokens have {seq} positions: at most n_ctx={self.cfg.n_ctx} allowed")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.cfg.d_vocab):
            raise ValueError(
                f"token ids span [{int(tokens.min())}, {int(tokens.max())}]: allowed "
                f"0..{self.cfg.d_vocab - 1}"
            )

    @staticmethod
    def _check_attention_mask(mask: Any, tokens: Any) -> None:
        """``attention_mask``: 0/1 integers or bools, ``[batch, pos]`` like the tokens. A value
        such as 2 would otherwise pass as "attend" while shifting the grid and positions."""
        if not isinstance(mask, Tensor):
            raise ValueError(
                f"attention_mask is a {type(mask).__name__}: expected a [batch, pos] tensor of 0/1"
            )
        if mask.is_floating_point() or mask.is_complex():
            raise ValueError(
                f"attention_mask has dtype {mask.dtype}: expected 0/1 integers or bools "
                "(1 = real token, 0 = hidden)"
            )
        if mask.dtype != torch.bool and mask.numel() and ((mask != 0) & (mask != 1)).any():
            bad = sorted({int(v) for v in mask.unique().tolist()} - {0, 1})
            raise ValueError(f"attention_mask holds {bad[:5]}: allowed values are 0 and 1")
        if isinstance(tokens, Tensor):
            # TransformerLens runs 1-D tokens as one sequence [1, pos]; its mask must say so
            want = (1, *tokens.shape) if tokens.ndim == 1 else tuple(tokens.shape)
            if tuple(mask.shape) != want:
                raise ValueError(
                    f"attention_mask has shape {tuple(mask.shape)}: expected {want} for tokens "
                    f"of shape {tuple(tokens.shape)}"
                )

    def forward(self, input: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A002
        if kwargs.get("start_at_layer") is None:
            self._check_tokens(input)
        if kwargs.get("attention_mask") is not None:
            tokens = input if kwargs.get("start_at_layer") is None else None
            self._check_attention_mask(kwargs["attention_mask"], tokens)
        self.grid_state.begin_forward(self.training)
        return super().forward(input, *args, **kwargs)

    def run_with_cache(self, *model_args: Any, names_filter: Any = None, **kwargs: Any) -> Any:
        """TransformerLens' ``run_with_cache``; ``hook_token_pattern`` (``O(T^2)`` per layer) is
        cached only when switched on (``set_use_token_pattern``) or named in ``names_filter``,
        as TransformerLens does for ``hook_result``."""
        if names_filter is None and not self.cfg.use_token_pattern:
            names_filter = _not_token_pattern
        return super().run_with_cache(*model_args, names_filter=names_filter, **kwargs)

    def get_caching_hooks(
        self,
        names_filter: Any = None,
        incl_bwd: bool = False,
        device: Any = None,
        remove_batch_dim: bool = False,
        cache: dict | None = None,
        pos_slice: Any = None,
    ) -> tuple[dict, list, list]:
        """TransformerLens' caching hooks, except that hooks with no position axis
        (``hook_grid_offset``, ``hook_k_block``, ``hook_v_block``, ``hook_block_weights``) are
        never position-sliced: TL would cut their head, batch or block axis instead."""
        cache, fwd, bwd = super().get_caching_hooks(
            names_filter, incl_bwd, device, remove_batch_dim, cache, pos_slice
        )

        def save(tensor: Tensor, hook: Any, is_backward: bool = False) -> None:
            value = tensor.detach().to(device)
            cache[hook.name + ("_grad" if is_backward else "")] = (
                value[0] if remove_batch_dim else value
            )

        def patch(hooks: list, is_backward: bool) -> list:
            return [
                (name, functools.partial(save, is_backward=is_backward))
                if name.endswith(POSITIONLESS_HOOKS)
                else (name, fn)
                for name, fn in hooks
            ]

        return cache, patch(fwd, False), patch(bwd, True)

    # ------------------------------------------------------------------ save / load
    def config_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self.cfg):
            if not f.init:
                continue
            value = getattr(self.cfg, f.name)
            if isinstance(value, CompressionConfig):
                value = value.to_dict()
            elif isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif isinstance(value, torch.device):
                value = str(value)
            out[f.name] = value
        return out

    def save(self, path: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` under folder ``path`` (atomically)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.config_dict(), indent=2, sort_keys=True)
        atomic_write(path / CONFIG_FILE, lambda tmp: Path(tmp).write_text(text))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        # bytes written by Python, not by safetensors' own writer: a full or read-only disk
        # then raises the OSError it is (with its errno), not an opaque SafetensorError
        data = safetensors_bytes(state)
        atomic_write(path / WEIGHTS_FILE, lambda tmp: Path(tmp).write_bytes(data))
        return path

    @classmethod
    def load(cls, path: str | Path, device: str | None = None) -> PhaseTransformer:
        """Load a model written by :meth:`save`. Errors name the file and what is wrong."""
        path = Path(path)
        cfg_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
        for f in (cfg_file, weights_file):
            if not f.is_file():
                raise FileNotFoundError(f"{f} is missing: not a phasemech model folder")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{cfg_file} is not valid JSON: {err}") from err
        if not isinstance(raw, dict):
            raise ValueError(f"{cfg_file} must hold a JSON object, got {type(raw).__name__}")
        if isinstance(raw.get("dtype"), str):
            dtype = getattr(torch, raw["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{cfg_file}: dtype={raw['dtype']!r} is not a torch dtype")
            raw["dtype"] = dtype
        if device is not None:
            raw["device"] = device
        init_weights = raw.get("init_weights", True)
        raw["init_weights"] = False
        try:
            model = cls(PhaseTransformerConfig(**raw))
        except (TypeError, ValueError) as err:  # unknown fields, invalid or mistyped values
            raise ValueError(f"{cfg_file} holds an invalid config: {err}") from err
        model.cfg.init_weights = init_weights
        try:
            state = load_file(str(weights_file), device=str(model.cfg.device))
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{weights_file} could not be read: {err}") from err
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ValueError(f"{weights_file} does not match {cfg_file}: {err}") from err
        return model


def _not_token_pattern(name: str) -> bool:
    return not name.endswith("hook_token_pattern")


__all__ = ["CompressedAttentionMixin", "GridState", "PhaseTransformer", "quiet_tl_deprecation"]
