"""Process-wide heap policy for CPU training: how glibc's malloc serves and returns the large blocks of a step.

* ``"bounded"`` (:data:`BOUNDED_SETTINGS`): every block of 2 MiB or more gets its own ``mmap``, returned on free, so
  resident memory stays close to the peak of live tensors; every step maps and zero-fills its large blocks again.
* ``"reuse"`` (:data:`REUSE_SETTINGS`): freed large blocks stay in the heap for the next allocation (no page faults in
  later steps); the heap fragments, and resident memory reaches up to about 2x the peak of live tensors.
* ``"default"``: change nothing. glibc's dynamic mmap threshold rises to 32 MiB as blocks are freed: smaller blocks
  stay in a heap that fragments, larger ones are faulted in every step.

``"reuse"`` and ``"bounded"`` set ``THP_MEM_ALLOC_ENABLE=1`` when it is unset and the kernel's transparent-huge-page
mode is ``always`` or ``madvise``: torch reads it once, at the process's first CPU tensor allocation, and then
``madvise``s its blocks of 2 MiB or more (a page fault covers 2 MiB); :func:`huge_pages_in_use` reports whether it
took. glibc only; elsewhere nothing changes and a warning says so once. Why and the measurements: ``docs/design.md``,
"FSDP2 and fine-tuning".
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

__all__ = ["BOUNDED_SETTINGS", "MALLOC_POLICIES", "REUSE_SETTINGS", "current_malloc_policy", "huge_pages_in_use",
           "set_malloc_policy"]

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
    """The kernel's transparent-huge-page mode where it offers THP (``always`` / ``madvise``), else None."""
    try:
        with open(_THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return None
    mode = text[text.index("[") + 1:text.index("]")] if "[" in text else None
    return mode if mode in ("always", "madvise") else None


def huge_pages_in_use() -> bool | None:
    """Whether torch's large CPU blocks get transparent huge pages in this process.

    Allocates and fills one 4 MiB tensor and reads the ``AnonHugePages`` of its mapping in ``/proc/self/smaps``.
    Returns ``None`` where the kernel offers no THP (no ``/sys/kernel/mm/transparent_hugepage``, or mode ``never``)
    or ``smaps`` cannot be read; else ``True`` when part of the block is backed by huge pages.
    """
    if _thp_mode() is None:
        return None
    import torch

    block = torch.empty(4 << 20, dtype=torch.uint8)
    block.fill_(1)
    ptr, inside = block.data_ptr(), False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= ptr < hi
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) > 0
    except (OSError, ValueError):
        return None
    return None


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
    if _thp_mode() is not None:  # torch's CPU allocator reads it at its first allocation
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    _state["policy"] = policy
    return True


def current_malloc_policy() -> str:
    """The policy :func:`set_malloc_policy` last put in force in this process (``"default"`` before any)."""
    return _state["policy"]
