"""``glm53flash-export SRC OUT``: make a published GLM-5.3-Flash checkpoint folder loadable as remote code.

SRC is a local checkpoint folder in the published layout. OUT receives ``config.json`` with this package's
``auto_map``, the package modules the remote code needs (byte-equal), links to SRC's weight files and indexes
(symlink, else hardlink, else copy, each fallback warned), and copies of the other files. SRC's Python files are
not copied and every other ``auto_map`` in its JSON files is replaced by this package's, so OUT runs no code of
SRC. Nothing is downloaded.
"""

from __future__ import annotations

import collections
import filecmp
import inspect
import json
import os
import re
import shutil
import warnings

from transformers.utils import logging

from ..checkpoint_io import atomic_save, checkpoint_keys, read_json, write_json
from . import check_output_folder, docstring_parser

logger = logging.get_logger(__name__)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
CODE_SUFFIXES = (".py", ".pyc")  # the Python files of SRC, which export() never copies
LINK_MODES = ("symlink", "hardlink", "copy")


def processor_auto_map() -> dict[str, str]:
    """The ``auto_map`` the package's processor writes into its JSON files."""
    from ..processing_glm53flash import Glm53FlashProcessor

    module = Glm53FlashProcessor.__module__.rsplit(".", 1)[-1]
    return {Glm53FlashProcessor._auto_class: f"{module}.{Glm53FlashProcessor.__name__}"}


def remote_code_files() -> list[str]:
    """Absolute paths of the package modules the remote code needs (those of the ``auto_map`` entries and, recursively,
    their relative imports).
    """
    from transformers.dynamic_module_utils import get_relative_import_files

    from ..modeling_glm53flash import AUTO_MAP, Glm53FlashForCausalLM

    package_dir = os.path.dirname(os.path.abspath(inspect.getfile(Glm53FlashForCausalLM)))
    files: dict[str, None] = {}  # in first-seen order
    refs = list(AUTO_MAP.values()) + list(processor_auto_map().values())
    for module in sorted({ref.split(".")[0] for ref in refs}):
        entry = os.path.join(package_dir, module + ".py")
        if not os.path.isfile(entry):
            raise FileNotFoundError(f"AUTO_MAP names module {module!r} but {entry} does not exist")
        files.update(dict.fromkeys(os.path.abspath(path) for path in [entry, *get_relative_import_files(entry)]))
    return list(files)


def link_file(src: str, dst: str, mode: str = "symlink") -> str:
    """Make ``dst`` refer to ``src`` by ``mode`` (``"symlink"``, then hard link, then copy; ``"hardlink"``; ``"copy"``),
    warning at every fallback; return the method used. ``ValueError`` for another ``mode``; ``OSError`` only when the
    copy fails too."""
    if mode not in LINK_MODES:
        raise ValueError(f"link mode must be one of {LINK_MODES}; got {mode!r}")
    if mode == "symlink":
        try:
            os.symlink(os.path.abspath(src), dst)
            return "symlink"
        except OSError as error:
            logger.warning(f"could not symlink {dst} -> {src} ({error}); trying a hard link")
    if mode in ("symlink", "hardlink"):
        try:
            os.link(os.path.realpath(src), dst)
            return "hardlink"
        except OSError as error:
            logger.warning(f"could not hard-link {dst} -> {src} ({error}); copying the file")
    shutil.copy2(os.path.realpath(src), dst)
    return "copy"


def _plan(src: str, skip_names: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """``(relative path, "link" | "copy")`` per non-hidden, non-code file of ``src``, and the code files' paths."""
    plan, code = [], []
    for root, dirs, files in os.walk(src, followlinks=True):
        code += [os.path.relpath(os.path.join(root, d), src) for d in sorted(dirs) if d == "__pycache__"]
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), src)
            if name.startswith(".") or rel in skip_names:
                continue
            if name.endswith(CODE_SUFFIXES):
                code.append(rel)
                continue
            is_weight = name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")  # linked, not copied
            plan.append((rel, "link" if is_weight else "copy"))
    return plan, code


def _replace_auto_maps(data, auto_map: dict) -> bool:
    """Set every ``"auto_map"`` inside the JSON value ``data`` to ``auto_map``; return whether anything changed."""
    if not isinstance(data, (dict, list)):
        return False
    changed = isinstance(data, dict) and data.get("auto_map", auto_map) != auto_map
    if changed:
        data["auto_map"] = dict(auto_map)
    for value in [v for k, v in data.items() if k != "auto_map"] if isinstance(data, dict) else data:
        changed = _replace_auto_maps(value, auto_map) or changed
    return changed


def _with_our_auto_map(path: str):
    """The JSON content of ``path`` with every ``auto_map`` replaced, or None (not JSON, or no other ``auto_map``)."""
    if not path.endswith(".json"):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if b'"auto_map"' not in raw:
            return None
        data = json.loads(raw)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if _replace_auto_maps(data, processor_auto_map()) else None


def export(src: str, out: str, link: str = "symlink", overwrite: bool = False, show_progress: bool = True) -> dict:
    """Write the remote-code folder ``out`` for the checkpoint folder ``src``.

    ``src``: a local folder with a ``glm5_next`` ``config.json`` and safetensors weights; ``out`` is written atomically
    and must be empty unless ``overwrite``; ``link``: how weight files are placed (:func:`link_file`). Returns
    ``{relative path: "symlink" | "hardlink" | "copy" | "code" | "config"}`` for every file written.

    ``FileNotFoundError`` when ``src`` is not a folder or lacks ``config.json`` / weights; ``ValueError`` when
    ``model_type`` is not ``glm5_next``, the config does not validate, ``out`` overlaps ``src``
    (:func:`glm53flash_hf.tools.output_conflict`), or ``out`` is not empty without ``overwrite``.
    """
    from tqdm.auto import tqdm

    from ..configuration_glm53flash import Glm53FlashConfig
    from ..modeling_glm53flash import AUTO_MAP

    if link not in LINK_MODES:
        raise ValueError(f"link must be one of {LINK_MODES}; got link={link!r}")
    if not os.path.isdir(src):
        raise FileNotFoundError(f"SRC={src!r} is not a local folder")
    check_output_folder(out, src, allow_links=overwrite)
    config_path = os.path.join(src, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"SRC={src!r} has no config.json; pass a local checkpoint folder")
    config = read_json(config_path)
    if config.get("model_type") != "glm5_next":
        raise ValueError(f"{config_path}: model_type={config.get('model_type')!r}; expected 'glm5_next' "
                         "(GLM-5.3-Flash)")
    try:
        Glm53FlashConfig.from_dict(dict(config))
    except Exception as error:  # the message names the field; keep the type visible
        raise ValueError(f"{config_path} does not validate: {type(error).__name__}: {error}") from error

    code = remote_code_files()
    plan, src_code = _plan(src, skip_names={"config.json"})
    if not any(kind == "link" and rel.endswith(".safetensors") for rel, kind in plan):
        raise FileNotFoundError(f"SRC={src!r} has no *.safetensors weight files")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"OUT={out!r} exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ValueError(f"OUT={out!r} is not empty; pass --overwrite to replace it")
    dropped_entries = sorted(k for k, v in (config.get("auto_map") or {}).items() if AUTO_MAP.get(k) != v)
    _replace_auto_maps(config, AUTO_MAP)  # nested ones too
    config["auto_map"] = dict(AUTO_MAP)
    _drop_absent_mtp(src, config)
    written: dict[str, str] = {}

    def write(folder: str) -> None:
        for rel, kind in tqdm(plan, desc="glm53flash-export", unit="file", disable=not show_progress):
            dst = os.path.join(folder, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if kind == "link":
                written[rel] = link_file(os.path.join(src, rel), dst, link)
            elif (data := _with_our_auto_map(os.path.join(src, rel))) is None:  # no foreign auto_map
                shutil.copy2(os.path.join(src, rel), dst)
                written[rel] = "copy"
            else:
                write_json(data, dst)
                written[rel] = "config"
        for path in code:
            shutil.copy2(path, os.path.join(folder, os.path.basename(path)))
            written[os.path.basename(path)] = "code"
        write_json(config, os.path.join(folder, "config.json"), sort_keys=True)
        written["config.json"] = "config"

    atomic_save(out, write)
    kept = _scrub_kept_entries(out, written)
    ours = {os.path.basename(p): p for p in code}
    notes = (
        ("SRC's code files not copied", [rel for rel in src_code if rel not in ours]),
        ("SRC's modules replaced by the package's", [
            rel for rel in src_code if rel in ours and not filecmp.cmp(os.path.join(src, rel), ours[rel], shallow=False)
        ]),
        ("config.json auto_map entries replaced or dropped", dropped_entries),
        ("auto_map replaced by the package's processor entry in",
         sorted(rel for rel, kind in written.items() if kind == "config" and rel != "config.json")),
        ("removed or rewritten among OUT's previous files", kept),
    )
    parts = [f"{what}: {', '.join(names)}" for what, names in notes if names]
    if parts:
        logger.warning(f"glm53flash-export {src} -> {out}: OUT carries only this package's code; " + "; ".join(parts))
    return written


def _drop_absent_mtp(src: str, config: dict) -> None:
    """Set ``num_nextn_predict_layers`` to 0, with a warning, when the config declares MTP layers the weights lack."""
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


def _scrub_kept_entries(out: str, written: dict) -> list[str]:
    """Apply SRC's rules (no code, our ``auto_map``) to the entries of ``out`` kept from before; return those changed.
    """
    changed = []
    for root, dirs, files in os.walk(out):
        for d in [d for d in dirs if d == "__pycache__"]:
            path = os.path.join(root, d)
            os.unlink(path) if os.path.islink(path) else shutil.rmtree(path)
            changed.append(os.path.relpath(path, out))
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in files:
            path = os.path.join(root, name)
            if os.path.relpath(path, out) in written or name.startswith("."):
                continue
            if name.endswith(CODE_SUFFIXES):
                os.unlink(path)
                changed.append(os.path.relpath(path, out))
            elif (data := _with_our_auto_map(path)) is not None:
                tmp = os.path.join(root, f".{name}.export-tmp")
                write_json(data, tmp)
                os.replace(tmp, path)  # replaces a link, never writes through it
                changed.append(os.path.relpath(path, out))
    return changed


def main(argv=None) -> int:
    """Command-line entry point of ``glm53flash-export``; returns the exit status."""
    parser = docstring_parser("glm53flash-export", __doc__)
    parser.add_argument("src", metavar="SRC",
                        help="local checkpoint folder (config.json with model_type glm5_next, safetensors)")
    parser.add_argument("out", metavar="OUT", help="folder to write (created; must be empty unless --overwrite)")
    parser.add_argument("--link", choices=LINK_MODES, default="symlink",
                        help="how weight files and indexes reach OUT: symlink (default; falls back to hardlink, then "
                             "copy, with a warning), hardlink (falls back to copy) or copy")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty OUT (its old weights, indexes and configs are dropped, its other "
                             "files kept)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary line")
    args = parser.parse_args(argv)
    try:
        written = export(args.src, args.out, link=args.link, overwrite=args.overwrite, show_progress=not args.quiet)
    except (ValueError, FileNotFoundError) as error:  # user mistakes: one clean line, no traceback
        parser.error(str(error))
    if not args.quiet:
        counts = collections.Counter(written.values())
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        print(f"wrote {os.path.abspath(args.out)} ({summary})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
