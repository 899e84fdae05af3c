"""A run folder on disk: atomic checkpoints, their restore, stale temporaries, the metrics
log, and loading a trained model back.

A run is a folder::

    RUN/train_config.json            the TrainConfig (a resumed run must match it)
    RUN/metrics.jsonl                one JSON line per evaluation (and the final summary)
    RUN/checkpoints/step_000200/     config.json + model.safetensors (PhaseTransformer.save),
                                     trainer.pt (optimizer, scheduler, torch RNG), trainer.json

A checkpoint folder is written under a temporary name and renamed into place, so a folder named
``step_*`` is always complete.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from phasemech.core.device import move, resolve_device
from phasemech.model.transformer import PhaseTransformer
from phasemech.training.config import TrainConfig

CONFIG_NAME = "train_config.json"
TMP_CKPT_PREFIX = ".tmp-step_"  # + step + "-" + pid: a checkpoint being written
METRICS_NAME = "metrics.jsonl"
CKPT_DIR = "checkpoints"
STATE_FILE = "trainer.pt"
INFO_FILE = "trainer.json"


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def save_checkpoint(
    run_dir: Path, step: int, model: PhaseTransformer, opt, sched, info: dict[str, Any]
) -> Path:
    """Write checkpoint ``step`` under a temporary name, then rename it into place. A write that
    fails (full or read-only disk) removes its temporary folder and raises one ``OSError`` that
    names the checkpoints folder and the operating system's error."""
    root = run_dir / CKPT_DIR
    final = root / f"step_{step:06d}"
    tmp = root / f"{TMP_CKPT_PREFIX}{step:06d}-{os.getpid()}"
    state = {
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "step": step,
    }
    # serialised in memory, written with plain file writes: a full disk then surfaces as the OS
    # error it is, not as torch's "unexpected pos" from inside its zip writer
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        model.save(tmp)
        (tmp / STATE_FILE).write_bytes(buffer.getvalue())
        (tmp / INFO_FILE).write_text(json.dumps({"step": step, **info}, indent=2))
        if final.exists():  # re-saving the same step (e.g. early stop at a checkpoint step)
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic: readers see no folder or a complete one
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(
            f"{root}: could not write checkpoint {final.name} ({err.strerror or err})"
        ) from err
    return final


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Remove the temporary folders of checkpoint writes that were killed (``kill -9``, power
    loss): ``.tmp-step_<step>-<pid>`` whose process is gone, or is this very process (a PID
    reused after a restart; this process writes none before it trains). A folder of another
    live process is kept: it may be writing it now. Returns the removed folders."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    removed = []
    for path in root.glob(f"{TMP_CKPT_PREFIX}*"):
        pid = path.name.rsplit("-", 1)[-1]
        if path.is_dir() and pid.isdigit() and not _other_live_process(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _other_live_process(pid: int) -> bool:
    if pid == os.getpid():
        return False
    if os.name != "posix":  # os.kill(pid, 0) would send a signal there: keep the folder
        return True
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except (ProcessLookupError, OverflowError):  # gone, or no valid PID at all
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def load_checkpoint(ckpt: Path, model: PhaseTransformer, opt, sched) -> int:
    """Restore weights, optimizer, scheduler and RNG from ``ckpt``; return its step."""
    loaded = PhaseTransformer.load(ckpt)
    try:
        model.load_state_dict(loaded.state_dict(), strict=True)
    except RuntimeError as err:
        raise ValueError(f"{ckpt} does not match this run's model: {err}") from err
    state_file = ckpt / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{state_file} is missing: not a phasemech training checkpoint")
    try:
        # CPU first: the optimizer moves its state onto the parameters' device when it loads
        state = torch.load(state_file, weights_only=True, map_location="cpu")
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["step"])
    except Exception as err:  # pickle/zip errors, missing keys, shape mismatches
        raise ValueError(f"{state_file} could not be restored: {err}") from err


def resolve_checkpoint(path: str | Path) -> tuple[Path, TrainConfig | None]:
    """A model folder from a run folder (its last checkpoint), a checkpoint or a saved model;
    plus the run's :class:`TrainConfig` when one is found."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    run_dir = None
    if (path / CONFIG_NAME).is_file():
        run_dir = path
        ckpts = checkpoint_dirs(path)
        if not ckpts:
            raise FileNotFoundError(f"{path} is a run folder without checkpoints ({CKPT_DIR}/)")
        path = ckpts[-1]
    elif path.parent.name == CKPT_DIR and (path.parent.parent / CONFIG_NAME).is_file():
        run_dir = path.parent.parent
    cfg = None if run_dir is None else TrainConfig.load(run_dir / CONFIG_NAME)
    return path, cfg


def load_trained(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[PhaseTransformer, TrainConfig | None, Path]:
    """``(model in eval mode on ``device``, its TrainConfig or None, the model folder)`` from a
    run folder, a checkpoint or a saved model (see :func:`resolve_checkpoint`)."""
    dev = resolve_device(device)
    model_dir, cfg = resolve_checkpoint(path)
    model = move(PhaseTransformer.load(model_dir), dev)
    model.eval()
    return model, cfg, model_dir


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluation lines of a run's ``metrics.jsonl``."""
    path = Path(run_dir) / METRICS_NAME
    if not path.is_file():
        return []
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [r for r in rows if r.get("event") != "done"]
