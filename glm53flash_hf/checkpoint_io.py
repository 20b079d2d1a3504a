"""Checkpoint folders on disk: reading (JSON files, the safetensors index, shards) and the save that a kill cannot
destroy (:func:`atomic_save`: a swap by ``renameat2(RENAME_EXCHANGE)``, a two-rename fallback, a journal for folders
that cannot be renamed, recovery of what a killed save left) with its file locks (:class:`FileLock`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import sys
import tempfile

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

def local_folder(path, subfolder: str = "") -> str | None:
    """``path / subfolder`` when it is an existing local folder, else None (a Hub id, a file, not a path)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    folder = os.path.join(os.fspath(path), subfolder) if subfolder else os.fspath(path)
    return folder if os.path.isdir(folder) else None


def checkpoint_keys(path: str) -> list[str] | None:
    """All tensor names of a local checkpoint folder, or None when ``path`` is not a local folder with safetensors."""
    folder = local_folder(path)
    if folder is None:
        return None
    weight_map = read_weight_map(folder)
    return None if weight_map is None else list(weight_map)


def read_json(path: str, *, unique_keys: bool = False):
    """The parsed JSON file ``path``; ``ValueError`` naming the file when it is unreadable, invalid, or (with
    ``unique_keys``) gives a name twice in one object."""

    def unique(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"{path}: {key!r} is listed twice ({out[key]!r} and {value!r})")
            out[key] = value
        return out

    try:
        with open(path) as f:
            return json.load(f, object_pairs_hook=unique if unique_keys else None)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({type(e).__name__}: {e})") from e


def write_json(data, path: str, sort_keys: bool = False) -> None:
    """Write ``data`` to ``path`` as JSON indented by 2, with a final newline."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=sort_keys)
        f.write("\n")


def read_weight_map(folder: str) -> dict[str, str] | None:
    """``{tensor name: shard file name}`` of a local folder (index or single ``model.safetensors``), or None;
    ``ValueError`` naming the file for both present, an invalid index (or a tensor listed twice), a corrupt file."""
    index = os.path.join(folder, SAFETENSORS_INDEX)
    single = os.path.join(folder, SAFETENSORS_SINGLE)
    if os.path.isfile(index) and os.path.isfile(single):
        raise ValueError(
            f"{folder} holds both {SAFETENSORS_SINGLE} and {SAFETENSORS_INDEX}: transformers would load "
            f"{single} and ignore the index and its shards; one of them is stale. Remove the one that is not meant"
        )
    if os.path.isfile(index):
        content = read_json(index, unique_keys=True)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(
                f"{index}: 'weight_map' must be an object {{tensor name: shard file name}}; got "
                f"{type(weight_map).__name__}"
            )
        bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
        if bad:
            raise ValueError(f"{index}: weight_map[{bad[0]!r}] must be a file name; got {weight_map[bad[0]]!r}")
        return dict(weight_map)
    if os.path.isfile(single):
        with open_shard(single) as f:
            return dict.fromkeys(f.keys(), SAFETENSORS_SINGLE)
    return None


@contextlib.contextmanager
def open_shard(path: str):
    """``safetensors.safe_open(path, framework="pt")`` raising ``ValueError`` naming a missing or damaged file."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise ValueError(f"{path}: checkpoint shard not found")
    try:
        handle = safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises SafetensorError (an Exception subclass) or OSError
        raise ValueError(
            f"{path}: corrupt or truncated safetensors file ({type(e).__name__}: {e}); "
            "re-download or re-write this shard"
        ) from e
    with handle as f:
        yield f


def read_config_json(folder: str) -> dict | None:
    """The parsed ``folder/config.json`` or None; ``ValueError`` naming it when it is not a JSON object."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object; got {type(config).__name__}")
    return config


# The folder entries a save replaces as a whole: weights, indexes, config, generation config.
_REPLACED_NAMES = re.compile(
    r"^(?:(?:model|pytorch_model)(?:[.-].*)?\.(?:safetensors|bin)|.+\.(?:safetensors|bin)\.index\.json"
    r"|config\.json|generation_config\.json)$"
)


# Names of what a save leaves while it runs: siblings ``.{name}.tmp-*`` (the new folder being written; after the
# swap, the old content awaiting deletion) and ``.{name}.old-*`` (the old folder moved aside by the two-rename
# fallback); inside the folder, journal folders ``.glm53flash-save.tmp-*`` (staged, uncommitted) and
# ``.glm53flash-save.commit-*`` (committed, holding the new entries not yet moved into place).
_JOURNAL_TMP = ".glm53flash-save.tmp-"
_JOURNAL_COMMIT = ".glm53flash-save.commit-"
_JOURNAL_MANIFEST = ".glm53flash-save.manifest.json"
_JOURNAL_PREFIXES = (_JOURNAL_TMP, _JOURNAL_COMMIT)
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False when unavailable,
    ``OSError`` naming both paths on any other failure (``EBUSY`` / ``EXDEV``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), a, None, b)


class FileLock:
    """An exclusive ``flock`` on ``path``, held from :meth:`acquire` to :meth:`release`: a folder held by a running
    save (a missing one counts as acquired) or, with ``create=True``, a lock file made when missing (``fd`` is then
    open read-write for the holder's own notes). Without ``fcntl``, or on a file system without locks, nothing is
    locked and :meth:`acquire` returns True.

    Raises:
        OSError: with ``create=True``, the lock file cannot be created or opened.
    """

    def __init__(self, path: str, *, create: bool = False):
        self.path = path
        self.create = create
        self.fd = None

    def acquire(self, wait: bool = True) -> bool:
        """Take the lock (``wait=False``: False at once when another holder has it)."""
        try:
            import fcntl
        except ImportError:
            return True
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT if self.create else os.O_RDONLY, 0o644)
        except OSError:
            if self.create:
                raise
            return True  # gone already
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            self.release()
            return False
        except OSError:
            pass  # no locks on this file system
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _remove(path: str) -> None:
    """Delete a file, link or folder tree (a link is removed, never followed)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _link_copy(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` as hard links (a real copy without hard links), folders recursively, links as links."""
    def link(a, b):
        try:
            os.link(a, b, follow_symlinks=False)
        except OSError:
            shutil.copy2(a, b, follow_symlinks=False)

    if os.path.isdir(src) and not os.path.islink(src):
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    else:
        link(src, dst)


def link_or_copy_entries(src: str, dst: str) -> list[str]:
    """Put every entry of the folder ``src`` into the existing folder ``dst`` as hard links, copied where a link
    fails (``dst`` on another file system, ``EXDEV``, or no hard links there); folders recursively, symbolic links as
    links. ``src`` is left as it was, so a failure part-way loses nothing of it. Returns the entry names.

    Raises:
        OSError: an entry could be neither linked nor copied (e.g. ``dst`` full); ``dst`` may hold part of ``src``.
    """
    names = sorted(os.listdir(src))
    for name in names:
        _link_copy(os.path.join(src, name), os.path.join(dst, name))
    return names


def _roll_forward(target: str, journal: str) -> None:
    """Finish the committed journal ``journal`` inside ``target`` (idempotent)."""
    manifest = os.path.join(journal, _JOURNAL_MANIFEST)
    if os.path.isfile(manifest):
        with open(manifest) as f:
            written = json.load(f)
        for entry in sorted(os.listdir(target)):
            if _REPLACED_NAMES.match(entry) and entry not in written:
                _remove(os.path.join(target, entry))
        for entry in written:
            src, dst = os.path.join(journal, entry), os.path.join(target, entry)
            if not os.path.lexists(src):
                continue  # moved by an earlier run
            if os.path.lexists(dst) and (os.path.isdir(src) or (os.path.isdir(dst) and not os.path.islink(dst))):
                trash = os.path.join(journal, ".trash-" + entry)
                _remove(trash)
                os.rename(dst, trash)
            os.replace(src, dst)
        os.unlink(manifest)
    _remove(journal)


def recover_interrupted_save(save_directory, subfolder: str = "") -> None:
    """Undo or finish what a killed :func:`atomic_save` of ``save_directory`` (``/ subfolder``) left; non-paths are
    ignored. Raises ``OSError`` when a rename needed to restore or finish the folder fails."""
    if not isinstance(save_directory, (str, os.PathLike)):
        return
    target = os.path.realpath(os.path.abspath(os.path.join(os.fspath(save_directory), subfolder or "")))
    parent, name = os.path.split(target)
    if os.path.isdir(target):
        for entry in sorted(os.listdir(target)):
            if entry.startswith(_JOURNAL_PREFIXES):
                path = os.path.join(target, entry)
                lock = FileLock(path)
                if not lock.acquire(wait=False):
                    continue
                try:
                    _roll_forward(target, path) if entry.startswith(_JOURNAL_COMMIT) else _remove(path)
                finally:
                    lock.release()
    try:
        siblings = sorted(s for s in os.listdir(parent) if s.startswith((f".{name}.tmp-", f".{name}.old-")))
    except OSError:
        return
    locks = [FileLock(os.path.join(parent, s)) for s in siblings]
    try:
        if not all(lock.acquire(wait=False) for lock in locks):
            return  # a save of this folder is running
        if not os.path.lexists(target):
            olds = [os.path.join(parent, s) for s in siblings if s.startswith(f".{name}.old-")]
            olds = [p for p in olds if os.path.isdir(p) and os.listdir(p)]
            if olds:
                os.rename(max(olds, key=lambda p: os.stat(p).st_ctime), target)
        for s in siblings:
            _remove(os.path.join(parent, s))
    finally:
        for lock in locks:
            lock.release()


def _journal_save(target: str, write=None, staged: str | None = None) -> None:
    """Save into ``target`` in place through a journal (for a ``target`` that cannot be renamed, e.g. a mount point)."""
    journal = tempfile.mkdtemp(prefix=_JOURNAL_TMP, dir=target)
    lock = FileLock(journal)
    lock.acquire()
    try:
        if staged is None:
            write(journal)
        else:
            for entry in os.listdir(staged):
                shutil.move(os.path.join(staged, entry), os.path.join(journal, entry))
        written = sorted(os.listdir(journal))
        with open(os.path.join(journal, _JOURNAL_MANIFEST), "w") as f:
            json.dump(written, f)
        committed = os.path.join(target, _JOURNAL_COMMIT + os.path.basename(journal)[len(_JOURNAL_TMP):])
        os.rename(journal, committed)
    except BaseException:
        _remove(journal)
        raise
    finally:
        lock.release()
    _roll_forward(target, committed)


def atomic_save(save_directory, write) -> str:
    """Fill an empty folder with ``write(tmp)`` and swap it in at ``save_directory`` once ``write`` returned.

    ``save_directory`` (parent created when missing) always holds the complete old or new folder, also across
    ``kill -9`` (not power loss); the old folder's non-checkpoint entries and a link to the folder are kept. Returns
    the absolute path written. ``ValueError`` when ``save_directory`` is an existing file; whatever ``write`` raises
    propagates (the old folder is kept)."""
    target = os.path.realpath(os.path.abspath(os.fspath(save_directory)))
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"save_directory={os.fspath(save_directory)!r} is a file; expected a folder")
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    recover_interrupted_save(target)
    if os.path.isdir(target) and os.path.ismount(target):
        _journal_save(target, write)
        return target
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    lock = FileLock(tmp)
    lock.acquire()
    mode = os.stat(target).st_mode if os.path.isdir(target) else None
    carried: list[str] = []
    backup = None
    try:
        write(tmp)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)
        else:
            os.chmod(tmp, mode & 0o7777)
        if not os.path.isdir(target):
            os.rename(tmp, target)
            return target
        written = set(os.listdir(tmp))
        for entry in sorted(os.listdir(target)):
            if entry not in written and not _REPLACED_NAMES.match(entry) and not entry.startswith(_JOURNAL_PREFIXES):
                _link_copy(os.path.join(target, entry), os.path.join(tmp, entry))
                carried.append(entry)
        try:
            if not exchange_paths(tmp, target):
                backup = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
                os.rename(target, backup)  # replaces the empty backup folder
                try:
                    os.rename(tmp, target)
                except BaseException:
                    os.rename(backup, target)
                    raise
                tmp, backup = backup, None
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.EXDEV):
                raise
            for entry in carried:  # the folder cannot be renamed (a mount point): save into it through a journal
                _remove(os.path.join(tmp, entry))
            _journal_save(target, staged=tmp)
    finally:
        lock.release()
        _remove(tmp)  # the unfinished new folder, or the old content after the swap
        if backup is not None and os.path.isdir(backup) and not os.listdir(backup):
            os.rmdir(backup)
    return target
