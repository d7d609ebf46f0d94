"""Check a device string against the torch that is installed, with one-line errors.

Moving a model to ``cuda`` on a CPU-only build of torch ends in a long AssertionError from deep
inside torch ("Torch not compiled with CUDA enabled"); these checks say what to install instead.
"""

from __future__ import annotations

import torch

DEVICE_TYPES = ("cpu", "cuda", "mps")
TORCH_INSTALL_URL = "https://pytorch.org/get-started/locally/"


def resolve_device(device: str | torch.device) -> torch.device:
    """``"cuda:0"`` -> ``torch.device("cuda:0")``, after checking that this torch can use it.

    Raises:
        ValueError: an unknown device string, a device type other than cpu, cuda or mps, CUDA
            with a CPU-only torch or without a visible GPU, or a GPU index that does not exist.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"unknown device {device!r}: use one of {', '.join(DEVICE_TYPES)}, e.g. cpu or cuda:0"
        ) from None
    if dev.type not in DEVICE_TYPES:
        raise ValueError(f"device {device!r} is not supported: use one of {', '.join(DEVICE_TYPES)}")
    if dev.type == "cuda":
        _check_cuda(str(device), dev)
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: this torch ({torch.__version__}) or machine has no MPS")
    return dev


def _check_cuda(text: str, dev: torch.device) -> None:
    if torch.version.cuda is None:
        raise ValueError(
            f"device {text!r} needs a CUDA build of torch, but torch {torch.__version__} is CPU-only: "
            f"install a CUDA build (pip install torch --index-url ..., see {TORCH_INSTALL_URL})"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {text!r}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU; "
            "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device {text!r}: torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}")
