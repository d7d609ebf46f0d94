"""The public surface: what `import bicodec_shm` offers, and the error tree."""

from __future__ import annotations

import ast
import pathlib

import bicodec_shm
from bicodec_shm import errors

PACKAGE = pathlib.Path(bicodec_shm.__file__).parent


def test_all_is_sorted_and_every_name_resolves():
    assert bicodec_shm.__all__ == sorted(bicodec_shm.__all__)
    for name in bicodec_shm.__all__:
        assert getattr(bicodec_shm, name) is not None


def test_every_public_error_is_exported_and_documented():
    exported = set(bicodec_shm.__all__)
    for name in dir(errors):
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == errors.__name__:
            assert name in exported, name
            assert obj.__doc__ and obj.__doc__.strip(), name


def test_error_tree_shape():
    assert issubclass(errors.CheckpointError, ValueError)
    assert issubclass(errors.DecodeTimeoutError, TimeoutError)
    assert issubclass(errors.DecodeTimeoutError, errors.ServerUnavailableError)
    for cls in (errors.DecodeError, errors.ServerUnavailableError, errors.SegmentError,
                errors.ServerAlreadyRunningError, errors.SharedMemoryFullError):  # fmt: skip
        assert issubclass(cls, errors.BiCodecShmError)


def test_nothing_read_from_shared_memory_is_unpickled_or_executed():
    """Every module of the package, not a list that a new module could slip past."""
    forbidden = {"pickle", "marshal", "shelve", "dill", "cloudpickle"}
    modules = sorted(PACKAGE.rglob("*.py"))
    names = {path.relative_to(PACKAGE).as_posix() for path in modules}
    assert {"protocol/attachment.py", "protocol/slot_io.py", "protocol/group.py", "protocol/segment.py",
            "model/weights.py"} <= names
    for path in modules:
        where = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not forbidden & {n.split(".")[0] for n in imported}, (where, imported)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"eval", "exec", "__import__"}, where
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                # Loaders that unpickle unless told not to.
                call, flags = ast.unparse(node.func), {k.arg: ast.unparse(k.value) for k in node.keywords}
                if call == "torch.load":
                    assert flags.get("weights_only") == "True", (where, ast.unparse(node))
                if call in {"np.load", "numpy.load"}:
                    assert flags.get("allow_pickle", "False") == "False", (where, ast.unparse(node))
                assert call not in {"yaml.load", "yaml.unsafe_load"}, (where, ast.unparse(node))
