"""descript-audio-codec's own model code, importable without descript-audiotools' dependencies.

``import dac`` runs ``import audiotools``, whose ``__init__`` imports torchaudio, librosa,
tensorboard and a dozen more; torchaudio pins its own torch release (pip would swap this
project's torch for a multi-GB CUDA build). CI therefore installs ``descript-audio-codec`` and
``descript-audiotools`` with ``--no-deps`` (plus ``einops``, in the test extra), and this module
loads upstream's files as they are, without either package's ``__init__``:

- ``dac.nn.layers``, ``dac.nn.quantize``, ``dac.model.base`` and ``dac.model.dac``: the model,
  its quantizer and its decoder, executed unchanged;
- ``audiotools.ml.BaseModel``: audiotools' real ``ml/layers/base.py``, whose ``save`` and ``load``
  write and read the published ``weights.pth`` format;
- ``audiotools.AudioSignal``: an empty stand-in class, which dac uses only in type hints and in
  ``compress``/``decompress`` (audio files), never on the decode path.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from pathlib import Path
from typing import Any

_LOADED: dict[str, Any] = {}


def _package(name: str, path: Path) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    module.__file__ = None
    sys.modules[name] = module
    return module


def _root(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # finds the package without running its __init__
    if spec is None or spec.origin is None:
        raise ImportError(
            f"{package} is not installed: pip install --no-deps descript-audio-codec==1.0.0 "
            "descript-audiotools==0.7.2 (see the README's test command)"
        )
    return Path(spec.origin).parent


def upstream() -> types.SimpleNamespace:
    """``DAC`` (the model class) and ``BaseModel`` of the installed descript-audio-codec."""
    if not _LOADED:
        dac_root, audiotools_root = _root("dac"), _root("audiotools")
        if "dac" in sys.modules or "audiotools" in sys.modules:
            raise RuntimeError("dac or audiotools was imported already: load them through this module")
        audiotools = _package("audiotools", audiotools_root)

        class AudioSignal:
            """Stand-in for audiotools.AudioSignal: dac's decode path never makes one."""

        audiotools.AudioSignal = AudioSignal
        audiotools.ml = _package("audiotools.ml", audiotools_root / "ml")
        _package("audiotools.ml.layers", audiotools_root / "ml" / "layers")
        base = importlib.import_module("audiotools.ml.layers.base")
        audiotools.ml.BaseModel = base.BaseModel
        dac = _package("dac", dac_root)
        dac.nn = _package("dac.nn", dac_root / "nn")
        dac.model = _package("dac.model", dac_root / "model")
        with warnings.catch_warnings():
            # dac wraps its Snake in torch.jit.script, which warns since torch 2.10.
            warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated", DeprecationWarning)
            model = importlib.import_module("dac.model.dac")
        _LOADED.update(DAC=model.DAC, BaseModel=base.BaseModel, version=_version())
    return types.SimpleNamespace(**_LOADED)


def _version() -> str:
    from importlib.metadata import version

    return version("descript-audio-codec")


def make_dac(**kwargs: Any) -> Any:
    """``dac.DAC(**kwargs)`` in eval mode; its weight_norm's deprecation warning silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.nn.utils.weight_norm` is deprecated", FutureWarning)
        return upstream().DAC(**kwargs).eval()


def load_dac(path: str) -> Any:
    """``dac.DAC.load(path)``, upstream's own reading of a weights file, in eval mode."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.nn.utils.weight_norm` is deprecated", FutureWarning)
        return upstream().DAC.load(path).eval()
