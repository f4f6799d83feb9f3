"""Loads UCX's libraries before the binding, so ``kvxfer._kvxfer`` finds its ``libucp.so.0``
without a system UCX.

The binding built with UCX links ``libucp.so.0``. The dynamic loader satisfies that from a
library of the same soname already in the process, so the one loaded here is the one the
binding uses. First found wins:

1. ``KVXFER_UCX_HOME=<prefix>``: the UCX installed there (``lib/``, ``lib64/`` or the
   multiarch ``lib/x86_64-linux-gnu/``), e.g. one with InfiniBand transports that a site
   built itself (``/usr`` for the system's). It must be the major.minor the binding was
   built against (:func:`kvxfer.ucx_info`); otherwise UCX is refused with both versions
   named, and ``transport="auto"`` falls back to TCP. A prefix without libucp is reported
   (``load_problem``) and the next source tried.
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
import sysconfig
from typing import Dict, List, Optional

#: Where UCX came from, once :func:`load` ran: ``source`` ("KVXFER_UCX_HOME", "libucx wheel"
#: or "search path"), ``path`` (the libucp file, where known) and ``problem`` (why the
#: chosen source could not be loaded, else None).
LOADED: Dict[str, Optional[str]] = {"source": None, "path": None, "problem": None}

# libucp's dependencies first: each is found by soname once loaded. libucm comes in as
# libucs's own dependency (libucm alone cannot load: it calls back into libucs).
_LIBRARIES = ("libucs.so.0", "libuct.so.0", "libucp.so.0")
_handles: List[ctypes.CDLL] = []


def _load_home(home: str) -> str:
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    for sub in ("lib", "lib64", os.path.join("lib", multiarch)):
        lib = os.path.join(home, sub)
        if os.path.isfile(os.path.join(lib, "libucp.so.0")):
            for name in _LIBRARIES:
                path = os.path.join(lib, name)
                if os.path.isfile(path):
                    # As libucx does: in the loader's list by soname, no symbols made global.
                    _handles.append(ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL))
            return os.path.join(lib, "libucp.so.0")
    raise OSError(f"KVXFER_UCX_HOME={home} has no libucp.so.0 in lib/, lib64/ or lib/{multiarch}/")


def load() -> None:
    """Loads UCX as described above (once; later calls do nothing)."""
    if LOADED["source"] is not None:
        return
    problems = []
    home = os.environ.get("KVXFER_UCX_HOME")
    if home:
        try:
            LOADED["path"] = _load_home(home)
            LOADED["source"] = "KVXFER_UCX_HOME"
            return
        except OSError as e:
            # Said, and the wheel's UCX tried next: a wrong variable must not break the import.
            problems.append(f"KVXFER_UCX_HOME: {e}")
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError:
        problems.append("no libucx package (pip install libucx-cu12)")
        libucx = None
    if libucx is not None:
        try:
            loaded = [h for h in libucx.load_library() if h is not None]
        except OSError as e:
            loaded = []
            problems.append(f"libucx.load_library(): {e}")
        if loaded:
            _handles.extend(loaded)
            LOADED["source"] = "libucx wheel"
            LOADED["path"] = getattr(loaded[-1], "_name", None)
        elif not problems:
            problems.append("libucx.load_library() loaded nothing")
    if LOADED["source"] is None:
        LOADED["source"] = "search path"
    LOADED["problem"] = "; ".join(problems) or None


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
