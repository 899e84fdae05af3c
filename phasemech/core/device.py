"""Where tensors live. ``auto`` takes CUDA where present, else the CPU; the CPU is the tested
default of the library (results on a GPU agree with the CPU's to float tolerance, not bit for
bit). Every entry point that runs a model takes ``device=`` and checks it before any work."""

from __future__ import annotations

from typing import Any

import torch

DEVICES = ("auto", "cpu", "cuda")


def check_device_name(device: Any) -> str:
    """The device's name if it is one of the allowed forms (``auto``, ``cpu``, ``cuda``,
    ``cuda:N``), whether or not this machine has it (a cluster's workers may)."""
    if isinstance(device, torch.device):
        device = str(device)
    kind, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    ok = device in ("auto", "cpu") or (kind == "cuda" and (not index or index.isdigit()))
    if not ok:
        raise ValueError(f"device={device!r} is invalid: allowed auto, cpu, cuda or cuda:N")
    return device


def resolve_device(device: Any = "cpu") -> torch.device:
    """``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device`` -> the device to
    use; a one-line ``ValueError`` names a bad or unavailable one."""
    device = check_device_name(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    index = device.partition(":")[2]
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} is invalid: CUDA is not available on this machine "
            "(torch.cuda.is_available() is False); use cpu or auto"
        )
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(
            f"device={device!r} is invalid: this machine has {torch.cuda.device_count()} CUDA "
            "device(s)"
        )
    return torch.device(device)


def move(model: Any, device: torch.device) -> Any:
    """``model`` on ``device``. A TransformerLens model is moved by the device's full name
    (its ``cfg.device`` must keep a ``cuda:N`` index: its forward moves activations there) and
    without its "Moving model to device" line."""
    if hasattr(model, "cfg") and hasattr(model.cfg, "device"):
        return model.to(str(device), print_details=False)
    return model.to(device)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


__all__ = ["DEVICES", "check_device_name", "model_device", "move", "resolve_device"]
