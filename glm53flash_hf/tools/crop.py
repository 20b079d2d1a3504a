"""``glm53flash-crop``: keep the first N main layers (+ the MTP layers) of a GLM-5.3-Flash checkpoint folder.

Written to OUT: embeddings, final norm, ``lm_head``, vision tower and main layers ``0..N-1`` bit for bit (key
prefixes as found); MTP layers ``layers.{H+i}`` renamed to ``layers.{N+i}``; FP8 weights dequantized to
``--dtype`` (:func:`glm53flash_hf.fp8_blockwise.dequantize_fp8_blockwise`), scales dropped; ``config.json`` with the
schedule fields cut to N and ``quantization_config`` removed (it must validate as
:class:`.configuration_glm53flash.Glm53FlashConfig`); sharded safetensors with an index; the non-weight files
(tokenizer, templates, processor configs, ``*.py``). One source shard is read at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import re
import shutil
import sys
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..checkpoint_checks import SCALE_SUFFIX, fp8_block_size, inspect_checkpoint
from ..checkpoint_io import SAFETENSORS_INDEX, SAFETENSORS_SINGLE, atomic_save, open_shard, read_config_json
from ..fp8_blockwise import dequantize_fp8_blockwise
from . import check_output_folder

COPY_PATTERNS = ("tokenizer*", "*.jinja", "*processor*config.json", "generation_config.json", "special_tokens_map.json",
                 "added_tokens.json", "chat_template.json", "*.py")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_LAYER_KEY = re.compile(r"^(?P<prefix>model\.language_model\.|language_model\.|model\.|)"
                        r"layers\.(?P<idx>\d+)\.(?P<rest>.+)$")
_INDEXED_SPELLINGS = ("deepseek_sparse_attention", "full_attention")


@dataclass
class KeyAction:
    """What happens to one source tensor: ``source`` name, ``target`` name (None when dropped or an FP8 scale),
    ``action`` (``"keep"``, ``"rename"``, ``"drop"``, ``"scale"``), ``dequantize`` (FP8, written dequantized).
    """

    source: str
    target: str | None
    action: str
    dequantize: bool = False


@dataclass
class CropPlan:
    """Everything :func:`run_crop` will do, computed from the headers and ``config.json`` only."""

    src: str
    layers: int  # N, the main layers kept
    dtype: torch.dtype  # of dequantized FP8 weights
    weight_map: dict[str, str]  # the source's index and shard headers
    dtypes: dict[str, str]
    shapes: dict[str, list[int]]
    actions: list[KeyAction]  # one per source tensor
    config_in: dict
    config_out: dict
    schedule_changes: dict = field(default_factory=dict)  # {field: (old, new)}
    copy_files: list[str] = field(default_factory=list)  # non-weight files copied to OUT
    mtp_layers: int = 0  # MTP layers found
    block: tuple[int, int] = (128, 128)  # FP8 block size

    def counts(self) -> dict[str, int]:
        """Number of source tensors per action, plus ``dequantize``."""
        out = dict.fromkeys(("keep", "rename", "drop", "scale"), 0) | Counter(a.action for a in self.actions)
        return out | {"dequantize": sum(a.dequantize for a in self.actions)}


def _text_config(config: dict) -> dict:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _filter_layer_list(name: str, values: list[int], layer_types: list[str], wanted: str, n: int) -> list[int]:
    """Keep the entries of a ``linear_attn_config`` layer list in the first ``n`` layers (numbered as ``layer_types``).
    """
    positions = {i for i, t in enumerate(layer_types) if t == wanted}
    for base in (0, 1):
        if {v - base for v in values} == positions:
            return [v for v in values if v - base < n]
    raise ValueError(f"linear_attn_config.{name}={values} matches neither 0- nor 1-based numbering of the {wanted!r} "
                     f"layers of layer_types ({sorted(positions)})")


def rewrite_config(config: dict, layers: int, mtp_layers: int) -> tuple[dict, dict]:
    """The cropped ``config.json`` dict and ``{field: (old, new)}`` of what changed; ``ValueError`` for ``layers`` out
    of range, a schedule list of the wrong length, a ``shared`` indexer layer without its ``full`` partner among the
    kept layers, or a config that no longer validates."""
    from ..configuration_glm53flash import Glm53FlashConfig

    out = json.loads(json.dumps(config))
    text = _text_config(out)
    n_src = text.get("num_hidden_layers")
    if not isinstance(n_src, int):
        raise ValueError(f"config.json has no integer num_hidden_layers (got {n_src!r})")
    if not 1 <= layers <= n_src:
        raise ValueError(f"--layers must be in [1, num_hidden_layers={n_src}]; got {layers}")
    changes: dict = {"num_hidden_layers": (n_src, layers)}
    text["num_hidden_layers"] = layers
    resolved = None
    for name in ("layer_types", "mlp_layer_types", "indexer_types"):
        values = text.get(name)
        if values is None:  # the config class derives it from num_hidden_layers: write the source's explicitly
            if resolved is None:  # the source's text config with Glm53FlashConfig's defaults filled in
                resolved = Glm53FlashConfig(**_config_kwargs(config)).get_text_config(decoder=True)
            values = list(getattr(resolved, name))
        if len(values) != n_src:
            raise ValueError(f"text_config.{name} has {len(values)} entries but num_hidden_layers={n_src}")
        text[name] = list(values[:layers])
        changes[name] = (values, text[name])
    src_types = [("indexed_attention" if t in _INDEXED_SPELLINGS else t) for t in changes["layer_types"][0]]
    layer_types, indexer_types = src_types[:layers], text["indexer_types"]
    for i, kind in enumerate(indexer_types):
        if kind == "shared" and layer_types and layer_types[i] == "indexed_attention":
            if i == 0 or layer_types[i - 1] != "indexed_attention" or indexer_types[i - 1] != "full":
                raise ValueError(f"indexer_types[{i}]='shared' but layer {i - 1} is not a kept indexed_attention layer "
                                 "with a 'full' indexer; a shared layer stores no indexer weights, so it cannot be "
                                 "made 'full'")
    if text.get("first_k_dense_replace") is not None:
        old = text["first_k_dense_replace"]
        text["first_k_dense_replace"] = min(old, layers)
        changes["first_k_dense_replace"] = (old, text["first_k_dense_replace"])
    lac = text.get("linear_attn_config")
    if isinstance(lac, dict):
        for name, wanted in (("kda_layers", "linear_attention"), ("full_attn_layers", "indexed_attention")):
            if name in lac and lac[name] is not None:
                old = lac[name]
                lac[name] = _filter_layer_list(name, old, src_types, wanted, layers)
                changes[f"linear_attn_config.{name}"] = (old, lac[name])
    old_mtp = text.get("num_nextn_predict_layers")
    text["num_nextn_predict_layers"] = mtp_layers
    if old_mtp != mtp_layers:
        changes["num_nextn_predict_layers"] = (old_mtp, mtp_layers)
    for holder in (out, text):
        if holder.pop("quantization_config", None) is not None:
            changes["quantization_config"] = ("present", "removed")
    try:
        Glm53FlashConfig(**_config_kwargs(out))
    except Exception as e:
        raise ValueError(f"the cropped config does not validate: {e}") from e
    return out, changes


def _config_kwargs(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("auto_map", "transformers_version", "architectures")}


def plan_crop(src: str, layers: int, dtype: torch.dtype = torch.bfloat16) -> CropPlan:
    """Work out the crop from ``src``'s ``config.json``, index and shard headers (no tensor data is read).
    ``ValueError`` for missing config or weights, what :func:`.checkpoint_checks.inspect_checkpoint` refuses (a
    corrupt shard, FP8 weights and scales not paired or not tiling), ``layers`` out of range, MTP layer numbering that
    does not follow the main stack, or an invalid cropped config."""
    config = read_config_json(src)
    if config is None:
        raise ValueError(f"{src}: no config.json")
    ckpt = inspect_checkpoint(src, for_transformers=False)
    if ckpt is None:
        raise ValueError(f"{src}: no {SAFETENSORS_INDEX} or {SAFETENSORS_SINGLE}")
    weight_map = ckpt.weight_map
    text = _text_config(config)
    n_src = text.get("num_hidden_layers")
    layer_ids = {int(m["idx"]) for k in weight_map if (m := _LAYER_KEY.match(k))}
    mtp_ids = sorted(i for i in layer_ids if isinstance(n_src, int) and i >= n_src)
    if mtp_ids and mtp_ids != list(range(n_src, n_src + len(mtp_ids))):
        raise ValueError(f"MTP layers must follow the main stack at layers.{n_src}..; found layers {mtp_ids}")
    declared = text.get("num_nextn_predict_layers")
    if declared is not None and declared != len(mtp_ids):
        raise ValueError(f"config num_nextn_predict_layers={declared} but the checkpoint has {len(mtp_ids)} layers "
                         f"after layers.{n_src - 1} ({mtp_ids})")
    config_out, changes = rewrite_config(config, layers, len(mtp_ids))
    actions = []
    for key in weight_map:
        m = _LAYER_KEY.match(key)
        idx = int(m["idx"]) if m else -1  # -1: not a layer tensor, kept
        fp8 = key in ckpt.fp8_weights
        if key.endswith(SCALE_SUFFIX):
            actions.append(KeyAction(key, None, "scale"))
        elif idx < layers:
            actions.append(KeyAction(key, key, "keep", fp8))
        elif idx < n_src:
            actions.append(KeyAction(key, None, "drop", fp8))
        else:
            actions.append(KeyAction(key, f"{m['prefix']}layers.{layers + idx - n_src}.{m['rest']}", "rename", fp8))
    copy_files = sorted(name for name in os.listdir(src) if os.path.isfile(os.path.join(src, name))
                        and any(fnmatch.fnmatch(name, p) for p in COPY_PATTERNS))
    return CropPlan(
        src=src, layers=layers, dtype=dtype, weight_map=weight_map, dtypes=ckpt.dtypes, shapes=ckpt.shapes,
        actions=actions, config_in=config, config_out=config_out, schedule_changes=changes, copy_files=copy_files,
        mtp_layers=len(mtp_ids), block=fp8_block_size(ckpt.quantization_config),
    )  # fmt: skip


def describe(plan: CropPlan, list_keys: bool = False) -> str:
    """Human-readable summary of a plan (what ``--dry-run`` prints)."""
    c = plan.counts()
    n_src = _text_config(plan.config_in)["num_hidden_layers"]
    dropped = f"layers {plan.layers}..{n_src - 1} dropped: {c['drop']} tensors" if plan.layers < n_src else None
    lines = [f"source: {plan.src} ({len(set(plan.weight_map.values()))} shards, {len(plan.weight_map)} tensors)",
             f"main layers: {n_src} -> {plan.layers} ({dropped or 'none dropped'})"]
    lines += [f"MTP layer: layers.{n_src + i}.* -> layers.{plan.layers + i}.*" for i in range(plan.mtp_layers)]
    lines.append(f"tensors written: {c['keep'] + c['rename']} ({c['keep']} kept, {c['rename']} renamed)")
    if c["dequantize"] or c["scale"]:
        kept_fp8 = sum(a.dequantize for a in plan.actions if a.target is not None)
        lines.append(f"FP8: {kept_fp8} written weights dequantized to {str(plan.dtype).removeprefix('torch.')} "
                     f"({plan.block[0]}x{plan.block[1]} blocks); {c['scale']} scale tensors not written")
    lines.append("config.json changes:")
    lines += [f"  {name}: {old} -> {new}" for name, (old, new) in plan.schedule_changes.items()]
    lines.append(f"files copied: {', '.join(plan.copy_files) if plan.copy_files else '(none)'}")
    if list_keys:
        lines.append("tensors:")
        for a in plan.actions:
            tag = a.action + ("+dequantize" if a.dequantize and a.target else "")
            lines.append(f"  {tag:18s} {a.source}" + (f" -> {a.target}" if a.action == "rename" else ""))
    return "\n".join(lines)


class _ShardReaders:
    """``safe_open`` handles for scale look-ups in other shards (a few kept open; scales are tiny)."""

    def __init__(self, src: str, keep: int = 4):
        self.src, self.keep = src, keep
        self.handles: OrderedDict = OrderedDict()

    def get(self, fname: str, key: str) -> torch.Tensor:
        if fname not in self.handles:
            if len(self.handles) >= self.keep:
                _, (ctx, _h) = self.handles.popitem(last=False)
                ctx.__exit__(None, None, None)
            ctx = open_shard(os.path.join(self.src, fname))
            self.handles[fname] = (ctx, ctx.__enter__())
        self.handles.move_to_end(fname)
        return self.handles[fname][1].get_tensor(key)

    def close(self):
        for ctx, _h in self.handles.values():
            ctx.__exit__(None, None, None)
        self.handles.clear()


def run_crop(plan: CropPlan, out: str, max_shard_size: int | None = None, progress: bool = True) -> dict:
    """Write the crop ``plan`` into ``out`` atomically, flushing output shards at ``max_shard_size`` bytes (default: the
    largest source shard); returns ``{"shards": n, "tensors": n, "total_size": bytes}``. ``ValueError`` for a
    ``max_shard_size`` that is not a positive integer, ``out`` not empty or overlapping the source folder, a corrupt
    shard (named)."""
    if max_shard_size is not None and (isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int)
                                       or max_shard_size <= 0):
        raise ValueError(f"max_shard_size={max_shard_size!r}; expected a positive number of bytes or None")
    check_output_folder(out, plan.src)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ValueError(f"output folder {out} exists and is not empty")
    result: dict = {}
    atomic_save(out, lambda folder: result.update(_write_crop(plan, folder, max_shard_size, progress)))
    return result


def _write_crop(plan: CropPlan, out: str, max_shard_size: int | None, progress: bool) -> dict:
    """The body of :func:`run_crop`, writing into the empty folder ``out``."""
    # default: the largest source shard (max_shard_size is a positive int or None)
    limit = max_shard_size or max(os.path.getsize(os.path.join(plan.src, f)) for f in set(plan.weight_map.values()))
    by_file: dict[str, list[KeyAction]] = {}
    for a in plan.actions:
        if a.target is not None:
            by_file.setdefault(plan.weight_map[a.source], []).append(a)
    by_file = dict(sorted(by_file.items()))
    parts: list[tuple[str, list[str]]] = []
    buffer: dict[str, torch.Tensor] = {}
    buffer_bytes = total_size = 0

    def flush():
        nonlocal buffer, buffer_bytes
        if not buffer:
            return
        tmp = f"part-{len(parts):05d}.safetensors.tmp"
        save_file(buffer, os.path.join(out, tmp), metadata={"format": "pt"})
        parts.append((tmp, list(buffer)))
        buffer, buffer_bytes = {}, 0

    bar = tqdm(total=sum(map(len, by_file.values())), desc="Cropping", unit="tensor", disable=not progress)
    with bar, contextlib.closing(_ShardReaders(plan.src)) as scales:
        for fname, acts in by_file.items():
            bar.set_postfix_str(fname)
            with open_shard(os.path.join(plan.src, fname)) as f:
                for a in acts:
                    tensor = f.get_tensor(a.source)
                    if a.dequantize:
                        scale_key = a.source + SCALE_SUFFIX
                        scale = scales.get(plan.weight_map[scale_key], scale_key)
                        tensor = dequantize_fp8_blockwise(tensor, scale, plan.dtype, block=plan.block)
                    nbytes = tensor.numel() * tensor.element_size()
                    if buffer and buffer_bytes + nbytes > limit:
                        flush()
                    buffer[a.target] = tensor
                    buffer_bytes += nbytes
                    total_size += nbytes
                    bar.update(1)
        flush()
    n = len(parts)
    weight_map = {}
    for i, (tmp, keys) in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(out, tmp), os.path.join(out, name))
        weight_map.update(dict.fromkeys(keys, name))
    with open(os.path.join(out, SAFETENSORS_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(plan.config_out, f, indent=2)
        f.write("\n")
    for name in plan.copy_files:
        shutil.copy2(os.path.join(plan.src, name), os.path.join(out, name))
    return {"shards": n, "tensors": len(weight_map), "total_size": total_size}


def build_parser() -> argparse.ArgumentParser:
    """The ``glm53flash-crop`` argument parser."""
    from transformers.utils.hub import convert_file_size_to_int

    def size(value: str) -> int:
        try:
            n = int(value) if value.isdigit() else convert_file_size_to_int(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a size: {value!r} (use e.g. 5GB, 500MB or a byte count)") from e
        if n <= 0:
            raise argparse.ArgumentTypeError(f"not a size: {value!r} is {n} bytes; expected a positive size")
        return n

    p = argparse.ArgumentParser(prog="glm53flash-crop", description=(
        "Keep the first N main layers of a GLM-5.3-Flash checkpoint folder, plus the MTP layer(s) (renumbered from "
        "layers.{num_hidden_layers+i} to layers.{N+i}), the embeddings, final norm, lm_head and vision tower. FP8 "
        "weights are dequantized and quantization_config is dropped. The schedule fields of config.json are "
        "rewritten. Works one source shard at a time."))
    p.add_argument("src", metavar="SRC", help="source checkpoint folder (config.json + safetensors shards and index)")
    p.add_argument("out", metavar="OUT", help="output folder; must not exist or be empty (not created with --dry-run)")
    p.add_argument("--layers", type=int, required=True, metavar="N",
                   help="number of main layers to keep (1..num_hidden_layers)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be written (tensors kept / renamed / dropped, dequantized weights, new "
                        "schedule, copied files) and write nothing")
    p.add_argument("--list-keys", action="store_true",
                   help="with the summary, list every source tensor and what happens to it")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="dtype of dequantized FP8 weights (default: bf16); every other tensor is copied in its own "
                        "dtype")
    p.add_argument("--max-shard-size", type=size, default=None,
                   help="largest output shard (e.g. 5GB, 500MB, bytes); default: the size of the largest source shard "
                        "file")
    p.add_argument("--no-progress", action="store_true", help="hide the tqdm progress bar (shown by default)")
    return p


def main(argv=None) -> int:
    """Console entry point ``glm53flash-crop SRC OUT --layers N [--dry-run] [--dtype bf16]``; returns 0 (errors exit 2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        plan = plan_crop(args.src, args.layers, DTYPES[args.dtype])
        if args.dry_run or args.list_keys:
            print(describe(plan, list_keys=args.list_keys))
        if args.dry_run:
            print(f"dry run: nothing written to {args.out}")
            return 0
        result = run_crop(plan, args.out, args.max_shard_size, progress=not args.no_progress)
    except ValueError as e:
        parser.exit(2, f"glm53flash-crop: error: {e}\n")
    print(f"wrote {result['tensors']} tensors ({result['total_size'] / 2**20:.1f} MiB) in {result['shards']} shards "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
