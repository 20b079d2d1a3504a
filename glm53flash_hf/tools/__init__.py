"""The command-line tools (``glm53flash-finetune``, ``-make-tiny``, ``-crop``, ``-export``, ``-demo``, ``-plan``) and
their helpers; not part of the remote code a checkpoint carries.
"""

import argparse as _argparse
import os as _os
import re as _re


def docstring_parser(prog: str, doc: str) -> _argparse.ArgumentParser:
    """An ``ArgumentParser`` for ``prog``: description the first paragraph of ``doc``, epilog the rest, as plain text.
    """

    def plain(text: str) -> str:
        return _re.sub(r":(?:meth|func|data|class|mod):`~?\.?([^`]*)`", r"\1", text).replace("``", "")

    return _argparse.ArgumentParser(
        prog=prog,
        description=plain(doc.split("\n\n")[0]),
        epilog=plain(doc.split("\n\n", 1)[1]),
        formatter_class=_argparse.RawDescriptionHelpFormatter,
    )


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(_os.sep) + _os.sep)


def output_conflict(out: str, source: str, *, allow_links: bool = False) -> str | None:
    """Why the output folder ``out`` must not be written for the input ``source`` (a folder or file), or None.

    Conflicts (links resolved): ``out`` is ``source``, lies inside it or holds it; unless ``allow_links``, an entry of
    an existing ``out`` is a symbolic link into ``source`` or a hard link to one of its files. A ``source`` that does
    not exist locally conflicts only when it resolves to ``out``.

    Returns:
        a sentence naming both paths, or None.
    """
    real_out, real_src = _os.path.realpath(out), _os.path.realpath(source)
    if real_out == real_src:
        return f"is the input {source!r} (both resolve to {real_src!r})"
    if not _os.path.exists(source):
        return None
    if _inside(real_out, real_src):
        return f"lies inside the input {source!r} ({real_out!r} is under {real_src!r})"
    if _inside(real_src, real_out):
        return f"holds the input {source!r} ({real_src!r} is under {real_out!r})"
    if allow_links or not _os.path.isdir(out):
        return None
    inodes = set()
    for root, _dirs, files in _os.walk(real_src):
        for name in files:
            try:
                st = _os.stat(_os.path.join(root, name))
            except OSError:
                continue
            inodes.add((st.st_dev, st.st_ino))
    for root, dirs, files in _os.walk(out):
        for name in dirs + files:
            path = _os.path.join(root, name)
            if _os.path.islink(path) and _inside(_os.path.realpath(path), real_src):
                return f"links into the input {source!r} ({path!r} -> {_os.path.realpath(path)!r})"
        for name in files:
            path = _os.path.join(root, name)
            try:
                st = _os.stat(path)
            except OSError:
                continue
            if st.st_nlink > 1 and (st.st_dev, st.st_ino) in inodes:
                return f"links into the input {source!r} ({path!r} is a hard link to one of its files)"
    return None


def check_output_folder(out: str, source: str, *, out_name: str = "OUT", source_name: str = "SRC",
                        allow_links: bool = False) -> None:
    """Raise ``ValueError`` naming both arguments when :func:`output_conflict` finds a conflict."""
    why = output_conflict(out, source, allow_links=allow_links)
    if why is not None:
        raise ValueError(
            f"{out_name}={out!r} {why}; {out_name} must differ from {source_name} (a folder apart from it, not "
            "linking into it)"
        )
