"""The C++ suffix tree every index replica is built of (the seam to arctic-inference's tree).

arctic-inference's ``speculate`` walks the tree from the root once per match length and
drafts at every length: O(window^2) node visits per call, most of them cache misses on a
large tree. The index queries up to three trees per request per engine step, so that walk
was most of the drafter's time. ``csrc/`` holds arctic's tree (Apache-2.0, unchanged) plus
``speculate_longest_first``, which returns the same draft bit for bit with a binary search
for the longest useful match and a score bound that stops early (the proof is in
``csrc/suffix_tree.cc``). ``tests/test_suffix_tree_backend.py`` checks the equality
against arctic's own compiled tree on random trees.

The extension is compiled on first use (a few seconds; ``scripts/install.sh`` does it at
install) with the system's C++ compiler (``$CXX``, else ``c++``; C++20) against pybind11's
headers (the ``pybind11`` package, else the copy torch ships), and cached per source hash
under ``$WAR_EXTENSION_DIR`` (default ``~/.cache/war_openrlhf/extensions``). Concurrent
builds (several engine processes starting at once) each write a private file and rename it
into place, so a reader never sees a partial library.

``WAR_SUFFIX_TREE`` picks the process's tree, ``SuffixIndexConfig.suffix_tree`` one index's
(nothing is built before an index asks for the ``war`` tree):
``war`` (default: this extension; a failed build raises with the compiler's output) or
``arctic`` (arctic-inference's own ``_C.SuffixTree``: the same drafts, the slower speculate;
for a node without a compiler).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["SuffixTree", "TreeBuildError", "default_backend", "load_extension", "tree_class"]

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("suffix_tree.cc", "bindings.cc")
HEADERS = ("suffix_tree.h", "int32_map.h")
MODULE_NAME = "_war_suffix_tree"
BACKENDS = ("war", "arctic")


class TreeBuildError(RuntimeError):
    """The extension could not be compiled or loaded (the message carries the compiler's output)."""


def _pybind11_include() -> str:
    try:
        import pybind11  # type: ignore[import-not-found]

        return pybind11.get_include()
    except ImportError:
        pass
    spec = importlib.util.find_spec("torch")  # torch ships pybind11's headers; not imported here
    if spec is not None and spec.origin:
        include = Path(spec.origin).parent / "include"
        if (include / "pybind11" / "pybind11.h").is_file():
            return str(include)
    raise TreeBuildError("no pybind11 headers: install the `pybind11` package (or torch, which ships them), "
                         "or set WAR_SUFFIX_TREE=arctic")


def _source_hash(compiler: str) -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(f"{compiler}|{sys.version_info[:2]}|{sysconfig.get_config_var('EXT_SUFFIX')}".encode())
    return h.hexdigest()[:16]


def extension_dir() -> Path:
    return Path(os.environ.get("WAR_EXTENSION_DIR") or Path.home() / ".cache" / "war_openrlhf" / "extensions")


def _build(target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    cmd = [compiler, "-O3", "-DNDEBUG", "-std=c++20", "-shared", "-fPIC", "-fvisibility=hidden",
           f"-I{CSRC}", f"-I{_pybind11_include()}", f"-I{sysconfig.get_paths()['include']}",
           *(str(CSRC / s) for s in SOURCES), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        os.unlink(tmp)
        raise TreeBuildError(f"cannot run the C++ compiler {compiler!r} ({e}); set CXX, or WAR_SUFFIX_TREE=arctic") from e
    if done.returncode != 0:
        os.unlink(tmp)
        raise TreeBuildError(f"building the suffix tree extension failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    os.replace(tmp, target)  # atomic: concurrent builders each rename a complete library


def load_extension() -> ModuleType:
    """The compiled tree module, built first if this source version is not cached."""
    compiler = os.environ.get("CXX") or "c++"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = extension_dir() / f"{MODULE_NAME}-{_source_hash(compiler)}{suffix}"
    if not target.is_file():
        _build(target, compiler)
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(target))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(target), loader=loader)
    if spec is None:
        raise TreeBuildError(f"cannot load {target}")
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as e:
        raise TreeBuildError(f"cannot load {target} ({e}); delete it to rebuild") from e
    return module


_classes: dict[str, Any] = {}


def default_backend() -> str:
    """``$WAR_SUFFIX_TREE`` (checked), else ``war``."""
    backend = os.environ.get("WAR_SUFFIX_TREE", "war").strip().lower() or "war"
    if backend not in BACKENDS:
        raise ValueError(f"WAR_SUFFIX_TREE: must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def tree_class(backend: str | None = None) -> Any:
    """The tree class of ``backend`` (``war`` | ``arctic``; None: :func:`default_backend`)."""
    backend = default_backend() if backend is None else backend
    cls = _classes.get(backend)
    if cls is None:
        if backend == "arctic":
            from arctic_inference.suffix_decoding._C import SuffixTree as cls
        elif backend == "war":
            cls = load_extension().SuffixTree
        else:
            raise ValueError(f"suffix tree backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        _classes[backend] = cls
    return cls


#: what every tree class here provides (arctic's ``_C.SuffixTree`` surface); for annotations
SuffixTree = Any
