"""Where per-sample work runs: a device name resolved against what torch sees on this machine (the
batched engine's ``device``, a client's ``training.device``)."""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device of ``device``: ``"cpu"``, ``"cuda"`` / ``"cuda:N"`` (an error saying so
    where torch sees no such GPU), or ``"auto"`` (the first GPU if torch sees one, else the CPU)."""
    if isinstance(device, torch.device):
        dev = device
    elif device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except RuntimeError as err:
            raise ValueError(
                f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto'. Found {device!r}.") from err
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto'. Found {str(dev)!r}.")
    if dev.type == "cuda" and (not torch.cuda.is_available()
                               or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(
            f"device {str(dev)!r} was asked for, but torch sees {torch.cuda.device_count()} CUDA "
                         f"device(s) (torch {torch.__version__}, CUDA build: "
                         f"{torch.version.cuda or 'no'}). Use "
                         "device 'cpu' or 'auto', or install a CUDA build of torch on a machine "
                         "with a GPU.")
    return dev
