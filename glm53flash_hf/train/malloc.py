"""Process-wide heap policy for CPU training: keep freed large blocks for reuse instead of returning them to the OS.

The ``"reuse"`` policy sets the ``mallopt`` parameters of :data:`REUSE_SETTINGS` (glibc only; elsewhere nothing
changes and a warning says so once); the cost is resident memory. Why: ``docs/design.md``, "FSDP2 and fine-tuning".
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
    """The C library as a ``ctypes.CDLL`` when it is glibc with ``mallopt``, else ``None``."""
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
    """Apply ``policy`` (``"reuse"`` or ``"default"``: change nothing) to this process.

    Returns ``True`` when ``"reuse"`` was applied (now or earlier); ``False`` for ``"default"`` and when it cannot
    apply (then a ``RuntimeWarning``, once per process). Raises ``ValueError`` for a policy not in
    :data:`MALLOC_POLICIES`.
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
