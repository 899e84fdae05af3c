"""A GGUF file converted once into a Hugging Face folder (``config.json``, the tokenizer's
files, ``model.safetensors`` in float32), so every later read is a fast safetensors load.

Reading a GGUF through ``transformers`` parses its metadata (tens of thousands of vocabulary
entries) on every call: the config, the tokenizer and the weights each parse it again, which
made loading SmolLM2-135M take 20-80 s per process. The folder holds what that read produces,
bit for bit (the dequantised float32 weights, the converted tokenizer), under
``$PHASEMECH_CACHE`` (default ``$XDG_CACHE_HOME/phasemech``, else ``~/.cache/phasemech``),
keyed by the file's name, size and modification time and the ``transformers`` version. It is
written into a temporary folder and renamed into place, so concurrent workers never read a
half-written one (the first rename wins; the others' copies are dropped).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

#: the environment variable naming the cache's root folder
CACHE_ENV = "PHASEMECH_CACHE"


def cache_root() -> Path:
    """Where converted models are kept (``$PHASEMECH_CACHE``, else the user's cache folder)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "phasemech"


def gguf_folder(path: str | os.PathLike) -> Path:
    """The Hugging Face folder of the GGUF file ``path``, converted on first use."""
    import transformers

    path = Path(path).resolve()
    st = path.stat()
    key = f"{path.stem}-{st.st_size}-{st.st_mtime_ns}-tf{transformers.__version__}"
    folder = cache_root() / "gguf" / key
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=folder.parent))
    try:
        _convert(path, tmp)
        os.replace(tmp, folder)  # atomic; fails if another process's copy is already there
    except OSError:
        if not (folder / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _convert(path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one dequantisation bar per process is noise
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    from safetensors.torch import save_model

    # transformers refuses to save a model it read from GGUF: the float32 weights (shared
    # tensors once, as save_model keeps tied embeddings) and the config without the GGUF marker
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    tok.save_pretrained(out)


__all__ = ["CACHE_ENV", "cache_root", "gguf_folder"]
