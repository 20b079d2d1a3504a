"""``glm53flash-export SRC OUT``: make a published GLM-5.3-Flash checkpoint folder loadable as remote code.

SRC is a local checkpoint folder in the published layout: a release download, a folder written by
transformers' built-in ``Glm5NextForConditionalGeneration.save_pretrained``, by ``glm53flash-make-tiny`` or
``glm53flash-crop``. OUT receives:

* ``config.json``: SRC's config with ``auto_map`` entries for every Auto class this package serves
  (``modeling_glm53flash.AUTO_MAP``; SRC's other entries are kept);
* the package's modules the remote code needs: each module named in ``auto_map`` and every module it imports
  relatively (transformers' ``get_relative_import_files``, the same list ``save_pretrained`` copies);
* links to SRC's weight files (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``) and their ``*.index.json``,
  so nothing large is copied: symbolic links by default; where the file system refuses them, hard links, then
  copies, each fallback with a warning;
* copies of every other file (tokenizer, generation config, chat template, processor configs, ...); files of
  SRC named like our modules are replaced by ours. Hidden entries (``.cache``, ``.git``) are skipped.

Then ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` loads the package's model, while
loading OUT without ``trust_remote_code`` still uses transformers' built-in ``glm5_next``. Nothing is downloaded.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import warnings

from ..checkpoint import atomic_save
from . import check_output_folder, docstring_parser

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
LINK_MODES = ("symlink", "hardlink", "copy")


def _warn(message: str) -> None:
    from transformers.utils import logging

    logging.get_logger(__name__).warning(message)


def remote_code_files() -> list[str]:
    """Absolute paths of the package modules the remote code needs: every module named in
    ``modeling_glm53flash.AUTO_MAP`` plus, recursively, the modules they import with ``from .x import y``."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from ..modeling_glm53flash import AUTO_MAP, Glm53FlashForCausalLM

    package_dir = os.path.dirname(os.path.abspath(inspect.getfile(Glm53FlashForCausalLM)))
    files: list[str] = []
    for module in sorted({ref.split(".")[0] for ref in AUTO_MAP.values()}):
        entry = os.path.join(package_dir, module + ".py")
        if not os.path.isfile(entry):
            raise FileNotFoundError(f"AUTO_MAP names module {module!r} but {entry} does not exist")
        for path in [entry] + list(get_relative_import_files(entry)):
            path = os.path.abspath(path)
            if path not in files:
                files.append(path)
    return files


def is_weight_file(name: str) -> bool:
    """True for the files :func:`export` links instead of copying (weights and their shard indexes)."""
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")


def link_file(src: str, dst: str, mode: str = "symlink") -> str:
    """Make ``dst`` refer to ``src`` without copying when possible; return the method used.

    ``mode="symlink"`` tries a symbolic link (to the absolute ``src``), then a hard link, then a copy;
    ``"hardlink"`` starts at the hard link; ``"copy"`` copies. Every fallback logs a warning naming the file and
    the error. Raises ``OSError`` only when the copy fails too.
    """
    if mode not in LINK_MODES:
        raise ValueError(f"link mode must be one of {LINK_MODES}; got {mode!r}")
    if mode == "symlink":
        try:
            os.symlink(os.path.abspath(src), dst)
            return "symlink"
        except OSError as error:
            _warn(f"could not symlink {dst} -> {src} ({error}); trying a hard link")
    if mode in ("symlink", "hardlink"):
        try:
            os.link(os.path.realpath(src), dst)
            return "hardlink"
        except OSError as error:
            _warn(f"could not hard-link {dst} -> {src} ({error}); copying the file")
    shutil.copy2(os.path.realpath(src), dst)
    return "copy"


def _read_config(src: str) -> dict:
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SRC={src!r} has no config.json; pass a local checkpoint folder")
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from error
    if config.get("model_type") != "glm5_next":
        raise ValueError(f"{path}: model_type={config.get('model_type')!r}; expected 'glm5_next' (GLM-5.3-Flash)")
    return config


def _plan(src: str, skip_names: set[str]) -> list[tuple[str, str]]:
    """(relative path, "link" | "copy") for every non-hidden file under ``src`` except ``skip_names`` at top level."""
    plan = []
    for root, dirs, files in os.walk(src, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel_root = os.path.relpath(root, src)
        for name in sorted(files):
            rel = name if rel_root == "." else os.path.join(rel_root, name)
            if name.startswith(".") or rel in skip_names:
                continue
            plan.append((rel, "link" if is_weight_file(name) else "copy"))
    return plan


def export(src: str, out: str, link: str = "symlink", overwrite: bool = False, show_progress: bool = True) -> dict:
    """Write the remote-code folder ``out`` for the checkpoint folder ``src`` (see the module docstring).

    Args:
        src: local checkpoint folder with a ``glm5_next`` ``config.json`` and safetensors weights.
        out: destination folder; created; must be empty unless ``overwrite``. Written atomically
            (:func:`glm53flash_hf.checkpoint.atomic_save`): the folder is built beside ``out`` and swapped in when
            complete; with ``overwrite`` the previous folder's weights, indexes and configs are dropped, its other
            entries kept.
        link: ``"symlink"`` (default), ``"hardlink"`` or ``"copy"`` for the weight files (see :func:`link_file`).
        overwrite: allow a non-empty ``out``.
        show_progress: tqdm progress bar.

    Returns:
        ``{relative path: "symlink" | "hardlink" | "copy" | "code" | "config"}`` for every file written.

    Raises:
        FileNotFoundError: ``src`` is not a folder, or lacks ``config.json`` / weights.
        ValueError: ``model_type`` is not ``glm5_next``, the config does not validate, ``out`` is, lies inside,
            holds or (without ``overwrite``) links into ``src`` (:func:`glm53flash_hf.tools.output_conflict`), or
            ``out`` is not empty without ``overwrite``.
    """
    from tqdm.auto import tqdm

    from ..configuration_glm53flash import Glm53FlashConfig
    from ..modeling_glm53flash import AUTO_MAP

    if link not in LINK_MODES:
        raise ValueError(f"link must be one of {LINK_MODES}; got link={link!r}")
    if not os.path.isdir(src):
        raise FileNotFoundError(f"SRC={src!r} is not a local folder")
    check_output_folder(out, src, allow_links=overwrite)
    config = _read_config(src)
    try:
        Glm53FlashConfig.from_dict(dict(config))
    except Exception as error:  # the message names the field; keep the type visible
        raise ValueError(
            f"{os.path.join(src, 'config.json')} does not validate: {type(error).__name__}: {error}"
        ) from error

    code = remote_code_files()
    code_names = {os.path.basename(p) for p in code}
    plan = _plan(src, skip_names={"config.json"} | code_names)
    if not any(kind == "link" and rel.endswith(".safetensors") for rel, kind in plan):
        raise FileNotFoundError(f"SRC={src!r} has no *.safetensors weight files")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"OUT={out!r} exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ValueError(f"OUT={out!r} is not empty; pass --overwrite to replace it")
    config["auto_map"] = dict(config.get("auto_map") or {}, **AUTO_MAP)
    _drop_absent_mtp(src, config)
    written: dict[str, str] = {}

    def write(folder: str) -> None:
        for rel, kind in tqdm(plan, desc="glm53flash-export", unit="file", disable=not show_progress):
            dst = os.path.join(folder, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if kind == "link":
                written[rel] = link_file(os.path.join(src, rel), dst, link)
            else:
                shutil.copy2(os.path.join(src, rel), dst)
                written[rel] = "copy"
        for path in code:
            shutil.copy2(path, os.path.join(folder, os.path.basename(path)))
            written[os.path.basename(path)] = "code"
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
        written["config.json"] = "config"

    atomic_save(out, write)
    return written


def _drop_absent_mtp(src: str, config: dict) -> None:
    """Set ``num_nextn_predict_layers`` to 0 (with a warning) when the config declares MTP layers but the weights
    have none — transformers' built-in ``Glm5NextForConditionalGeneration.save_pretrained`` drops them."""
    from ..checkpoint import checkpoint_keys

    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    n_mtp = int(text.get("num_nextn_predict_layers") or 0)
    n_layers = text.get("num_hidden_layers")
    keys = checkpoint_keys(src)
    if not n_mtp or n_layers is None or keys is None:
        return
    if not any(re.search(rf"layers\.{n_layers + i}\.", k) for k in keys for i in range(n_mtp)):
        warnings.warn(  # noqa: B028 (the warning is about the user's checkpoint, raised from this line)
            f"{src}: config.json declares num_nextn_predict_layers={n_mtp} but the weights hold no MTP layer "
            f"(layers.{n_layers}.*; transformers' built-in class drops it when saving); the exported config sets "
            "num_nextn_predict_layers=0"
        )
        text["num_nextn_predict_layers"] = 0


def main(argv=None) -> int:
    """Command-line entry point of ``glm53flash-export``; returns the exit status."""
    parser = docstring_parser("glm53flash-export", __doc__)
    parser.add_argument(
        "src", metavar="SRC", help="local checkpoint folder (config.json with model_type glm5_next, safetensors)"
    )
    parser.add_argument("out", metavar="OUT", help="folder to write (created; must be empty unless --overwrite)")
    parser.add_argument(
        "--link",
        choices=LINK_MODES,
        default="symlink",
        help="how weight files and indexes reach OUT: symlink (default; falls back to hardlink, then copy, with a "
        "warning), hardlink (falls back to copy) or copy",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty OUT (its old weights, indexes and configs are dropped, its other files kept)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    args = parser.parse_args(argv)
    try:
        written = export(args.src, args.out, link=args.link, overwrite=args.overwrite, show_progress=not args.quiet)
    except (ValueError, FileNotFoundError) as error:  # user mistakes: one clean line, no traceback
        parser.error(str(error))
    if not args.quiet:
        counts: dict[str, int] = {}
        for kind in written.values():
            counts[kind] = counts.get(kind, 0) + 1
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        print(f"wrote {os.path.abspath(args.out)} ({summary})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
