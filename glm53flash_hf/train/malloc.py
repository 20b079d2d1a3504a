"""Process-wide heap policy for CPU training: keep freed large blocks for reuse instead of returning them to the OS.

The ``"reuse"`` policy sets three ``mallopt`` parameters (glibc ``malloc.h``; ``mallopt(3)``):

* ``M_MMAP_MAX = 0``: no block is served by ``mmap``; large blocks come from the heap like small ones;
* ``M_TRIM_THRESHOLD = 2**31 - 1``: freed memory at the top of the heap is kept (up to 2 GiB), not trimmed;
* ``M_TOP_PAD = 64 MiB``: the heap grows in steps of at least 64 MiB.

The cost is resident memory: the process keeps the high-water mark of its heap (plus fragmentation). The parameters
only change later allocations. Other C libraries (musl, macOS): nothing is changed and a warning says so once. Why
(glibc's mmap threshold, measurements): ``docs/design.md``, "FSDP2 and fine-tuning".
"""

from __future__ import annotations

import ctypes
import sys
import warnings

__all__ = ["MALLOC_POLICIES", "REUSE_SETTINGS", "current_malloc_policy", "set_malloc_policy"]

MALLOC_POLICIES = ("default", "reuse")

# (name, glibc mallopt parameter number, value) of the "reuse" policy
REUSE_SETTINGS = (
    ("M_MMAP_MAX", -4, 0),
    ("M_TRIM_THRESHOLD", -1, 2**31 - 1),
    ("M_TOP_PAD", -2, 64 << 20),
)

_state = {"policy": "default", "warned": False}


def _glibc():
    """The C library as a ``ctypes.CDLL`` when it is glibc (has ``gnu_get_libc_version`` and ``mallopt``), else
    ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: the process's own C library
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc


def _warn_once(message: str) -> None:
    if not _state["warned"]:
        _state["warned"] = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def set_malloc_policy(policy: str) -> bool:
    """Apply a heap policy to this process (see the module docstring).

    Args:
        policy: ``"reuse"`` (the three ``mallopt`` settings of :data:`REUSE_SETTINGS`) or ``"default"`` (change
            nothing: the opt-out).

    Returns:
        ``True`` when ``"reuse"`` was applied (now or by an earlier call); ``False`` for ``"default"`` and when it
        cannot apply (not glibc, or ``mallopt`` refused a setting): then a ``RuntimeWarning`` is issued, once per
        process.

    Raises:
        ValueError: ``policy`` not in :data:`MALLOC_POLICIES`.
    """
    if policy not in MALLOC_POLICIES:
        raise ValueError(f"policy must be one of {MALLOC_POLICIES}; got policy={policy!r}")
    if policy == "default":
        return False
    if _state["policy"] == "reuse":
        return True
    libc = _glibc()
    if libc is None:
        _warn_once(f"malloc policy 'reuse' needs glibc (Linux); this C library ({sys.platform}) keeps its default")
        return False
    refused = [name for name, param, value in REUSE_SETTINGS if libc.mallopt(param, value) != 1]
    if refused:
        _warn_once(f"malloc policy 'reuse': mallopt refused {', '.join(refused)}; the heap policy is incomplete")
        return False
    _state["policy"] = "reuse"
    return True


def current_malloc_policy() -> str:
    """``"reuse"`` once :func:`set_malloc_policy` applied it in this process, else ``"default"``."""
    return _state["policy"]
