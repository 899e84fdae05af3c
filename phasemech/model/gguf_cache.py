"""A GGUF file converted once into a Hugging Face folder (``config.json``, the tokenizer's
files, ``model.safetensors`` in float32), so every later read is a fast safetensors load.

Reading a GGUF through ``transformers`` parses its metadata (tens of thousands of vocabulary
entries) on every call: the config, the tokenizer and the weights each parse it again, which
made loading SmolLM2-135M take 20-80 s per process. The folder holds what that read produces
(the dequantised float32 weights, the converted tokenizer and config) under
``$PHASEMECH_CACHE`` (default ``$XDG_CACHE_HOME/phasemech``, else ``~/.cache/phasemech``),
keyed by the file's name, size and modification time, the ``transformers`` and ``gguf``
versions and :data:`FORMAT`.

Only a model load converts (:func:`gguf_folder`); a config or tokenizer read takes the folder
where it exists and the GGUF's metadata otherwise (:func:`cached_folder`), so checking a
spec never dequantises a model. One process converts a file at a time (a lock file per key):
the others wait and read its folder. The folder is written under a temporary name and renamed
into place, so no reader sees a partial one; a temporary left by a killed process is removed by
the next conversion. Where the cache cannot be written (a read-only home), the GGUF is read
directly, with one warning.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

#: the environment variable naming the cache's root folder
CACHE_ENV = "PHASEMECH_CACHE"
#: the layout of a converted folder (a change makes a new key)
FORMAT = 1


def cache_root() -> Path:
    """Where converted models are kept (``$PHASEMECH_CACHE``, else the user's cache folder)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "phasemech"


def cache_key(path: Path) -> str:
    """The converted folder's name of the GGUF file ``path``."""
    from importlib.metadata import version

    st = path.stat()  # the gguf package dequantises, transformers converts: both versions
    versions = f"tf{version('transformers')}-gguf{version('gguf')}-f{FORMAT}"
    return f"{path.stem}-{st.st_size}-{st.st_mtime_ns}-{versions}"


def cached_folder(path: str | os.PathLike) -> Path | None:
    """The converted folder of the GGUF file ``path`` where one exists, else ``None``."""
    path = Path(path).resolve()
    folder = cache_root() / "gguf" / cache_key(path)
    return folder if (folder / "config.json").is_file() else None


def gguf_folder(path: str | os.PathLike) -> Path | None:
    """The converted folder of the GGUF file ``path``, converting it on first use; ``None``
    (one warning) where the cache cannot be written: read the GGUF itself then."""
    path = Path(path).resolve()
    folder = cache_root() / "gguf" / cache_key(path)
    if (folder / "config.json").is_file():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = open(folder.parent / f".{folder.name}.lock", "w")  # noqa: SIM115
    except OSError as err:  # a read-only home or cache: no conversion, the file itself
        msg = f"{folder.parent} is not writable ({err.strerror}): reading {path.name} directly"
        warnings.warn(f"{msg} (slow); set {CACHE_ENV} to a writable folder", stacklevel=2)
        return None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter per key; released when it closes
        if not (folder / "config.json").is_file():  # another process may have finished
            _build(path, folder)
    return folder


def _build(path: Path, folder: Path) -> None:
    for stale in folder.parent.glob(f".{folder.name}.*.tmp"):  # a killed conversion's
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        _convert(path, tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        os.replace(tmp, folder)
    except OSError:  # a filesystem without locks: another node's complete copy came first
        if not (folder / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert(path: Path, out: Path) -> None:
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one dequantisation bar per process is noise
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    # transformers refuses to save a model it read from GGUF: the float32 weights (shared
    # tensors once, as save_model keeps tied embeddings) and the config without the GGUF marker
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    tok.save_pretrained(out)
    for f in out.iterdir():
        f.chmod(0o644)


__all__ = ["CACHE_ENV", "FORMAT", "cache_key", "cache_root", "cached_folder", "gguf_folder"]
