"""Loads UCX's libraries before the binding, so ``kvxfer._kvxfer`` finds its ``libucp.so.0``
without a system UCX.

The binding built with UCX links ``libucp.so.0``. The dynamic loader satisfies that from a
library of the same soname already in the process, so the one loaded here is the one the
binding uses. First found wins:

1. ``KVXFER_UCX_HOME=<prefix>``: the UCX installed there (``lib/`` or ``lib64/``), e.g. one
   with InfiniBand transports that a site built itself. It must be the major.minor the
   binding was built against (:func:`kvxfer.ucx_info`); otherwise UCX is refused with both
   versions named, and ``transport="auto"`` falls back to TCP.
2. the ``libucx`` package (the ``libucx-cu12`` wheel, a dependency of the ``kvxfer`` wheel,
   which is built against it): its ``load_library()``, as RAPIDS' ucxx does.
3. nothing: the loader's search path (``LD_LIBRARY_PATH``, the system UCX) decides.

``import kvxfer`` never fails here: a problem is kept in :data:`LOADED` and reported by
:func:`kvxfer.ucx_info` (and, if the binding then finds no ``libucp.so.0`` at all, by the
import error :mod:`kvxfer` raises).
"""

from __future__ import annotations

import ctypes
import os
from typing import Dict, List, Optional

#: Where UCX came from, once :func:`load` ran: ``source`` ("KVXFER_UCX_HOME", "libucx wheel"
#: or "search path"), ``path`` (the libucp file, where known) and ``problem`` (why the
#: chosen source could not be loaded, else None).
LOADED: Dict[str, Optional[str]] = {"source": None, "path": None, "problem": None}

# libucp's dependencies first: each is found by soname once loaded.
_LIBRARIES = ("libucs.so.0", "libucm.so.0", "libuct.so.0", "libucp.so.0")
_handles: List[ctypes.CDLL] = []


def _load_home(home: str) -> str:
    for sub in ("lib", "lib64"):
        lib = os.path.join(home, sub)
        if os.path.isfile(os.path.join(lib, "libucp.so.0")):
            for name in _LIBRARIES:
                path = os.path.join(lib, name)
                if os.path.isfile(path):
                    _handles.append(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
            return os.path.join(lib, "libucp.so.0")
    raise OSError(f"KVXFER_UCX_HOME={home} has no lib/libucp.so.0 or lib64/libucp.so.0")


def load() -> None:
    """Loads UCX as described above (once; later calls do nothing)."""
    if LOADED["source"] is not None:
        return
    home = os.environ.get("KVXFER_UCX_HOME")
    if home:
        LOADED["source"] = "KVXFER_UCX_HOME"
        try:
            LOADED["path"] = _load_home(home)
        except OSError as e:
            LOADED["problem"] = str(e)
        return
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError:
        LOADED["source"] = "search path"
        return
    LOADED["source"] = "libucx wheel"
    try:
        _handles.extend(h for h in libucx.load_library() if h is not None)
        LOADED["path"] = os.path.join(os.path.dirname(os.path.abspath(libucx.__file__)), "lib", "libucp.so")
    except OSError as e:
        LOADED["problem"] = f"libucx.load_library(): {e}"


def mapped_libucp() -> Optional[str]:
    """The libucp file this process has mapped (``/proc/self/maps``), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip() if line.count(" ") >= 5 else ""
                if os.path.basename(path).startswith("libucp.so"):
                    return path
    except OSError:
        return None
    return None
