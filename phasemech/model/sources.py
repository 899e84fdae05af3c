"""Where an audited model comes from, and how long a context it was trained for.

Axes: none (models and their metadata).

A model spec is one of: a bundled name (:data:`phasemech.model.pretrained.LOCAL`, read from an
installed package: no network); a local Hugging Face model folder (``config.json`` and weights);
a local ``.gguf`` file; or a TransformerLens model name (downloaded: needs a reachable hub).
A local folder or GGUF file may hold any family of :data:`phasemech.model.families.FAMILIES`
(GPT-2, Pythia, Llama/SmolLM, Mistral, Qwen2/3, Gemma-2/3, Phi-3, OLMo-2): it is loaded with
``transformers`` and converted by TransformerLens' own conversion for its architecture.
:func:`describe` resolves the spec and reads the trained context WITHOUT loading weights, so
every bad input fails in one line before any forward; :func:`load` then loads it.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformer_lens import HookedTransformer

from phasemech.core.config import layers_of_kind
from phasemech.model.families import hooked_model
from phasemech.model.gguf_cache import cached_folder
from phasemech.model.pretrained import LOCAL, gguf_path, hf_from


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: ``kind`` is ``bundled``, ``folder``, ``gguf`` or ``hub``."""

    spec: str
    kind: str
    path: str | None
    max_context: int  # the context the model was trained for
    architecture: str
    n_layers: int
    positional: str  # TransformerLens' positional_embedding_type
    n_heads: int = 0  # query heads per layer (a head-partitioned design's budget needs it)
    #: ``local`` (sliding-window) or ``global`` per layer (empty: every layer global)
    layer_types: tuple[str, ...] = ()
    #: prompts start with BOS: a local model whose tokenizer puts BOS in front of any text
    #: (the bundled SmolLM2's does not; hub models keep phasemech's earlier no-BOS prompts)
    prepend_bos: bool = False

    def layers(self, spec: str) -> tuple[int, ...]:
        """The layers ``global``, ``local`` or ``all`` names on this model; a one-line
        ``ValueError`` where none are."""
        return layers_of_kind(
            self.layer_types or ("global",) * self.n_layers, spec, repr(self.spec)
        )


def _hf_config(path: Path):
    """The model's config: from a folder, or from a GGUF file's converted folder where it
    exists, else from the file's metadata (a check never converts a model)."""
    from transformers import AutoConfig

    folder = path if path.is_dir() else cached_folder(path)
    kw = {} if folder is not None else dict(gguf_file=path.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoConfig.from_pretrained(folder or path.parent, **kw)


def _from_config(spec: str, kind: str, path: Path, cfg) -> ModelSource:
    if kind != "bundled":
        from phasemech.core.config import layer_types
        from phasemech.model.families import prepends_bos, tl_config, trained_context

        n_ctx = trained_context(cfg)
        tl = tl_config(cfg, n_ctx, spec=spec)  # the family is checked here, in one line
        arch, pos, heads = tl.original_architecture, tl.positional_embedding_type, tl.n_heads
        types = tuple(layer_types(tl))
        src = ModelSource(spec, kind, str(path), n_ctx, arch, tl.n_layers, pos, heads, types)
        return dataclasses.replace(src, prepend_bos=prepends_bos(tokenizer(src)))
    arch = (getattr(cfg, "architectures", None) or [type(cfg).__name__])[0]
    n_ctx, n_layers = int(cfg.max_position_embeddings), int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    return ModelSource(spec, kind, str(path), n_ctx, arch, n_layers, "rotary", heads)


def describe(spec: str) -> ModelSource:
    """Resolve ``spec`` and read its trained context; a one-line ``ValueError`` (or
    ``ConnectionError`` for an unreachable hub) naming the alternatives otherwise."""
    if spec in LOCAL:
        path = gguf_path(spec)
        return _from_config(spec, "bundled", path, _hf_config(path))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {spec!r} has no config.json: not a Hugging Face model")
        return _from_config(spec, "folder", path, _hf_config(path))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model file {spec!r} does not exist")
        return _from_config(spec, "gguf", path, _hf_config(path))
    return _hub(spec)


def _hub(spec: str) -> ModelSource:
    from transformer_lens.loading_from_pretrained import (
        OFFICIAL_MODEL_NAMES,
        get_official_model_name,
    )

    try:
        name = get_official_model_name(spec)
    except ValueError:
        raise ValueError(
            f"model {spec!r} is unknown: allowed a bundled model ({', '.join(LOCAL)}), a local "
            "Hugging Face folder, a .gguf file, or a TransformerLens name (e.g. gpt2, "
            f"EleutherAI/pythia-70m; {len(OFFICIAL_MODEL_NAMES)} known)"
        ) from None
    from transformer_lens.loading_from_pretrained import get_pretrained_model_config

    try:
        if not os.environ.get("HF_HUB_OFFLINE"):  # fail in seconds, not after hub retries
            socket.create_connection(("huggingface.co", 443), timeout=5).close()
        cfg = get_pretrained_model_config(name)
    except OSError as err:  # no network, no local HF cache
        raise ConnectionError(
            f"model {spec!r} needs the Hugging Face hub, which cannot be reached "
            f"({type(err).__name__}); use a bundled model ({', '.join(LOCAL)}), a local folder "
            "or a .gguf file"
        ) from None
    from phasemech.core.config import layer_types

    arch = cfg.original_architecture or ""
    pos, types = cfg.positional_embedding_type, tuple(layer_types(cfg))
    return ModelSource(
        spec, "hub", name, int(cfg.n_ctx), arch, int(cfg.n_layers), pos, int(cfg.n_heads), types
    )


def tokenizer(source: ModelSource):
    """The model's tokenizer alone (no weights): prompts are checked before any load."""
    from transformers import AutoTokenizer

    if source.kind == "hub":
        return AutoTokenizer.from_pretrained(source.path)
    path = Path(source.path)
    folder = path if source.kind == "folder" else cached_folder(path)
    if folder is None:  # a GGUF not converted yet: its own metadata (no model is loaded)
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(folder)


def load(source: ModelSource, n_ctx: int, device: str | torch.device = "cpu") -> HookedTransformer:
    """The model as an uncompressed ``HookedTransformer`` in eval mode on ``device``, allocating
    ``n_ctx`` positions (at most the trained context)."""
    from phasemech.model.pretrained import load_pretrained

    if source.kind in ("bundled", "hub"):
        return load_pretrained(source.spec, n_ctx=n_ctx, device=device)
    hf, tok = hf_from(Path(source.path))
    model = hooked_model(hf.eval(), tok, n_ctx, source.spec)
    return model.to(str(device), print_details=False)


__all__ = ["ModelSource", "describe", "load", "tokenizer"]
