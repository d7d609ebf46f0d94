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


def exact_cuda_math() -> None:
    """Set the process-wide CUDA math flags that every decode here runs with (the server, the
    CUDA graphs, every system of ``bicodec-shm bench``, bench_model.py and the gpu tests):

    - TF32 off in cuDNN convolutions and cuBLAS matmuls: TF32 rounds float32 inputs to 10-bit
      mantissas, and cuDNN picks kernels by shape, so a batched row would no longer equal its
      lone decode to float32 precision; a benchmark system left at cuDNN's TF32 default would
      also be faster for that alone, and every ratio against it spuriously low;
    - cuDNN deterministic, no autotuning: only deterministic engines, chosen the same way every
      time, so a shape decodes to the same bits in every run and a graph replays the eager
      kernels (ConvTranspose1d runs cuDNN's backward-data kernels, some of which add with
      atomics in an order that varies from run to run).

    Cheap and idempotent; without CUDA the flags are set and have no effect.
    """
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def uses_exact_cuda_math() -> bool:
    """Whether :func:`exact_cuda_math`'s flags are all in force."""
    b = torch.backends
    return (not b.cudnn.allow_tf32 and not b.cuda.matmul.allow_tf32 and b.cudnn.deterministic
            and not b.cudnn.benchmark)  # fmt: skip
