"""Process-wide heap policy for CPU training: how glibc's malloc serves and returns the large blocks of a step.

* ``"reuse"``: the ``mallopt`` parameters of :data:`REUSE_SETTINGS` keep freed large blocks in the heap for the next
  allocation (no page faults in later steps); the cost is resident memory, since the heap fragments (up to about
  2x the peak of live tensors).
* ``"bounded"``: :data:`BOUNDED_SETTINGS` serve every block of 2 MiB or more with its own ``mmap``, returned on free,
  so resident memory stays close to the live tensors; every large block of a step is mapped and zero-filled again.
* ``"default"``: change nothing.

Both ``"reuse"`` and ``"bounded"`` also set ``THP_MEM_ALLOC_ENABLE=1`` (torch's CPU allocator then aligns blocks of
2 MiB or more to transparent huge pages and ``madvise``s them), unless the variable is already set or the kernel's
THP mode is ``never``; torch reads it at its first such allocation, so the policy has to be set before the model is
built. glibc only; elsewhere nothing changes and a warning says so once. Why and the measurements: ``docs/design.md``,
"FSDP2 and fine-tuning".
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

__all__ = ["BOUNDED_SETTINGS", "MALLOC_POLICIES", "REUSE_SETTINGS", "current_malloc_policy", "set_malloc_policy"]

MALLOC_POLICIES = ("default", "reuse", "bounded")

# (name, glibc mallopt parameter number, value) of the "reuse" policy
REUSE_SETTINGS = (
    ("M_MMAP_MAX", -4, 0),
    ("M_TRIM_THRESHOLD", -1, 2**31 - 1),
    ("M_TOP_PAD", -2, 64 << 20),
)
# ... and of the "bounded" one: a fixed M_MMAP_THRESHOLD also stops glibc from raising it as blocks are freed;
# M_MMAP_MAX and M_TOP_PAD at glibc's defaults undo "reuse" when a process switches
BOUNDED_SETTINGS = (
    ("M_MMAP_MAX", -4, 65536),
    ("M_MMAP_THRESHOLD", -3, 2 << 20),
    ("M_TRIM_THRESHOLD", -1, 32 << 20),
    ("M_TOP_PAD", -2, 128 << 10),
)
_SETTINGS = {"reuse": REUSE_SETTINGS, "bounded": BOUNDED_SETTINGS}
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"

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


def _thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always`` / ``madvise`` / ``never``), or None where unknown."""
    try:
        with open(_THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def _enable_huge_pages() -> None:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` for torch's CPU allocator when the kernel offers THP and it is unset."""
    if "THP_MEM_ALLOC_ENABLE" not in os.environ and _thp_mode() in ("always", "madvise"):
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"


def set_malloc_policy(policy: str) -> bool:
    """Apply ``policy`` (one of :data:`MALLOC_POLICIES`; ``"default"`` changes nothing) to this process.

    Returns ``True`` when ``policy`` is ``"reuse"`` or ``"bounded"`` and in force (now or earlier; a later call with
    the other one switches to it); ``False`` for ``"default"`` and when it cannot apply (then a ``RuntimeWarning``,
    once per process).

    Raises:
        ValueError: ``policy`` not in :data:`MALLOC_POLICIES` (names the value).
    """
    if policy not in MALLOC_POLICIES:
        raise ValueError(f"policy must be one of {MALLOC_POLICIES}; got policy={policy!r}")
    if policy == "default":
        return False
    if _state["policy"] == policy:
        return True
    libc = _glibc()
    if libc is None:
        _warn_once(f"malloc policy {policy!r} needs glibc (Linux); this C library ({sys.platform}) keeps its default")
        return False
    refused = [name for name, param, value in _SETTINGS[policy] if libc.mallopt(param, value) != 1]
    if refused:
        _warn_once(f"malloc policy {policy!r}: mallopt refused {', '.join(refused)}; the heap policy is incomplete")
        return False
    _enable_huge_pages()
    _state["policy"] = policy
    return True


def current_malloc_policy() -> str:
    """The policy :func:`set_malloc_policy` last put in force in this process (``"default"`` before any)."""
    return _state["policy"]
