"""FSDP2 (``fully_shard``) for GLM-5.3-Flash: sharding plan, fp32-kept parameters, sharded (DCP) checkpoints.

Sources: torch 2.13 ``torch/distributed/fsdp/_fully_shard``; accelerate 1.15 ``utils/fsdp_utils.py``
(``fsdp2_prepare_model``); transformers 5.24 ``_keep_in_fp32_modules_strict`` matching (``core_model_loading.py``).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass, field

import torch
from torch import nn

#: Module classes (by name) that anchor the fp32 units. Every fp32-kept parameter must
#: lie under one of them, else :func:`apply_fsdp2` raises.
FP32_ANCHOR_CLASSES = ("Glm53FlashHyperConnection", "Glm53FlashTopkRouter", "Glm53FlashLinearAttention")

_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class Fsdp2Plan:
    """What :func:`apply_fsdp2` / :func:`shard_fp32_kept_units` sharded (qualified names): the ``_no_split_modules``
    ``blocks``, the ``fp32_units`` and the ``low_precision_units`` nested in them, the ``fp32_parameters`` and the
    compute ``param_dtype`` (``None``: the masters')."""

    blocks: list[str] = field(default_factory=list)
    fp32_units: list[str] = field(default_factory=list)
    low_precision_units: list[str] = field(default_factory=list)
    fp32_parameters: list[str] = field(default_factory=list)
    extra_fp32_parameters: list[str] = field(default_factory=list)
    param_dtype: torch.dtype | None = None


def fp32_kept_parameter_names(model: nn.Module, param_dtype: torch.dtype | None = torch.bfloat16) -> list[str]:
    """Names, in ``named_parameters()`` order, of the parameters kept in fp32 under ``param_dtype`` (transformers'
    ``_keep_in_fp32_modules_strict`` / ``_keep_in_fp32_modules`` rule; none for ``None`` / fp32 / fp64).
    """
    if param_dtype not in _LOW_PRECISION:
        return []
    patterns = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    if param_dtype == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    if not patterns:
        return []
    regex = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in sorted(set(patterns))))
    return [name for name, _ in model.named_parameters() if regex.search(name)]


def no_split_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost instances of ``model._no_split_modules`` classes (by class name, as accelerate), outermost first.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    out: list[tuple[str, nn.Module]] = []
    for qual, module in model.named_modules():
        if type(module).__name__ in names and not any(qual.startswith(b + ".") for b, _ in out):
            out.append((qual, module))
    return out


def _anchor_name(param_name: str, modules: dict[str, nn.Module]) -> str | None:
    """Qualified name of the innermost :data:`FP32_ANCHOR_CLASSES` module containing ``param_name``."""
    parts = param_name.split(".")[:-1]
    for i in range(len(parts), -1, -1):
        qual = ".".join(parts[:i])
        if type(modules[qual]).__name__ in FP32_ANCHOR_CLASSES:
            return qual
    return None


def _low_precision_children(module: nn.Module, prefix: str, kept: set[int]) -> list[tuple[str, nn.Module]]:
    """Maximal submodules of ``module`` that hold parameters and no fp32-kept one (recursing into the others)."""
    out = []
    for name, child in module.named_children():
        qual = f"{prefix}.{name}" if prefix else name
        params = list(child.parameters())
        if not params:
            continue
        if any(id(p) in kept for p in params):
            out += _low_precision_children(child, qual, kept)
        else:
            out.append((qual, child))
    return out


def _default_mesh():
    """A 1-D mesh over the default process group on the current accelerator (CPU when there is none)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("FSDP2 needs an initialised process group: call torch.distributed.init_process_group "
                           "(torchrun / accelerate launch do) or pass mesh=...")
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    device_type = acc.type if acc is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def process_mesh(size: int, names: tuple[str, str], option: str):
    """``init_device_mesh`` of shape ``(world // size, size)`` named ``names`` over the default group (CUDA when
    available, else CPU).

    Raises:
        ValueError: no process group is initialised, or ``size`` does not divide the world size (naming ``option``,
            ``size`` and the world size).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{option}={size} needs an initialised process group (accelerate launch / torchrun); none is")
    world = dist.get_world_size()
    if size < 1 or world % size:
        raise ValueError(f"{option}={size} must divide the world size {world}")
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world // size, size), mesh_dim_names=names)


def _check_masters(model: nn.Module, param_dtype: torch.dtype | None) -> None:
    """Raise unless, with a low-precision ``param_dtype``, every trainable parameter is an fp32 master."""
    if param_dtype is not None and param_dtype not in _LOW_PRECISION + (torch.float32,):
        raise ValueError(f"param_dtype must be None, torch.float32, torch.bfloat16 or torch.float16; got {param_dtype}")
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
    dtypes = sorted({str(p.dtype) for _, p in trainable})
    if param_dtype in _LOW_PRECISION:
        bad = [f"{n} ({p.dtype})" for n, p in trainable if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"param_dtype={param_dtype} keeps fp32 master weights: every trainable parameter must be "
                             f"float32 (cast with model.float()); got {len(bad)} others, e.g. {bad[:3]}")
    elif len(dtypes) > 1:
        raise ValueError(f"FSDP2 needs one dtype for the trainable parameters when param_dtype={param_dtype}; got "
                         f"{dtypes} (cast with model.float(), or pass param_dtype=torch.bfloat16 to keep fp32 masters)")


def shard_fp32_kept_units(model: nn.Module, *, mesh=None, param_dtype: torch.dtype = torch.bfloat16,
                          reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True
                          ) -> Fsdp2Plan:
    """Shard the fp32 anchor units and the ``param_dtype`` units nested in them (call before ``accelerator.prepare``).

    ``model``: unsharded, fp32 trainable parameters; ``mesh``: 1-D (default: the default group); ``param_dtype``:
    bf16 or fp16. Returns an :class:`Fsdp2Plan` (blocks empty).

    Raises:
        ValueError: ``param_dtype`` not bf16/fp16; a non-fp32 trainable parameter; an fp32-kept parameter outside every
            :data:`FP32_ANCHOR_CLASSES` module; nested anchors; an anchor already sharded (each naming the parameter
            or module).
        RuntimeError: no process group and no ``mesh``.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if param_dtype not in _LOW_PRECISION:
        raise ValueError(f"shard_fp32_kept_units needs param_dtype bf16 or fp16; got {param_dtype}")
    _check_masters(model, param_dtype)
    plan = Fsdp2Plan(param_dtype=param_dtype)
    kept_names = fp32_kept_parameter_names(model, param_dtype)
    if not kept_names:
        return plan
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    anchors: dict[str, list[str]] = {}
    for name in kept_names:
        anchor = _anchor_name(name, modules)
        if anchor is None:
            raise ValueError(f"fp32-kept parameter {name} is not inside any of {FP32_ANCHOR_CLASSES}; add the class "
                             "of the smallest module whose forward uses it to FP32_ANCHOR_CLASSES")
        anchors.setdefault(anchor, []).append(name)
    mesh = mesh if mesh is not None else _default_mesh()
    low = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    keep = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    kept_ids = {id(params[n]) for n in kept_names}
    nested = [(a, b) for a in anchors for b in anchors if a != b and a.startswith(b + ".")]
    if nested:
        raise ValueError(f"fp32 anchor modules must not nest; got {nested[0][0]} inside {nested[0][1]}")
    for anchor in anchors:
        module = modules[anchor]
        if isinstance(module, FSDPModule):
            raise ValueError(f"{anchor} is already an FSDP unit; call shard_fp32_kept_units once, before any other "
                             "sharding")
        children = _low_precision_children(module, anchor, kept_ids)
        for qual, child in children:
            if not isinstance(child, FSDPModule):
                fully_shard(child, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=low)
                plan.low_precision_units.append(qual)
        covered = tuple(q + "." for q, _ in children)
        for pname, _ in module.named_parameters(prefix=anchor):
            if not pname.startswith(covered):
                plan.fp32_parameters.append(pname)
                if pname not in kept_names:
                    plan.extra_fp32_parameters.append(pname)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=keep)
        plan.fp32_units.append(anchor)
    return plan


def apply_fsdp2(model: nn.Module, *, mesh=None, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True) -> Fsdp2Plan:
    """Shard ``model`` in place with FSDP2 (fp32 units under a low-precision ``param_dtype``, one unit per
    ``_no_split_modules`` block, then the root); parameters become ``Shard(0)`` DTensors on ``mesh``.

    ``model``: trainable parameters in one dtype (fp32 under bf16/fp16); ``mesh``: 1-D (default: the default group on
    the current accelerator); ``param_dtype``: compute dtype (``None``: the masters'). Returns an :class:`Fsdp2Plan`.

    Raises:
        ValueError: bad ``param_dtype``; mixed trainable dtypes; see :func:`shard_fp32_kept_units`.
        RuntimeError: no process group and no ``mesh``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _check_masters(model, param_dtype)
    if param_dtype == torch.float32:
        param_dtype = None
    mesh = mesh if mesh is not None else _default_mesh()
    if param_dtype in _LOW_PRECISION:
        plan = shard_fp32_kept_units(model, mesh=mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                     reshard_after_forward=reshard_after_forward)
    else:
        plan = Fsdp2Plan(param_dtype=param_dtype)
    block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for qual, block in reversed(no_split_blocks(model)):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=block_policy)
        plan.blocks.append(qual)
    plan.blocks.reverse()
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=True)
    fully_shard(model, mesh=mesh, mp_policy=root_policy)
    return plan


def _check_checkpoint_dir(checkpoint_dir) -> str:
    path = os.fspath(checkpoint_dir)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"checkpoint_dir={path!r} is not a torch.distributed.checkpoint folder (no .metadata "
                                "file)")
    return path


# Globals a torch.distributed.checkpoint ``.metadata`` pickles besides the classes of
# ``torch.distributed.checkpoint.metadata`` (``StorageMeta.checkpoint_id`` is a path; ``TensorProperties`` encodes
# its layout through ``torch.serialization._get_layout``); ``torch.<dtype>`` names are allowed as well.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(("pathlib", cls) for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class UnsafeCheckpointError(ValueError):
    """A DCP folder holds a pickle that would build something other than checkpoint metadata or plain values."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler of a DCP ``.metadata`` that builds only :data:`_METADATA_GLOBALS`."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        found = None
        if "." not in name and ((module, name) in _METADATA_GLOBALS or module in (_METADATA_MODULE, "torch")):
            try:
                found = super().find_class(module, name)
            except AttributeError:
                found = None
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == _METADATA_MODULE and isinstance(found, type) and found.__module__ == module
        ) or (module == "torch" and isinstance(found, torch.dtype))
        if not allowed:
            raise UnsafeCheckpointError(f"{self.path}: refusing to unpickle {module}.{name}; a "
                                        "torch.distributed.checkpoint .metadata holds only "
                                        "torch.distributed.checkpoint metadata classes, so this folder's metadata is "
                                        "not one written by torch and loading it could run code from the folder")
        return found


def _safe_dcp_reader(path: str):
    """A ``FileSystemReader`` of ``path`` whose ``read_metadata`` uses :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(metadata_path, "rb") as file:
                metadata = _MetadataUnpickler(file, os.fspath(metadata_path)).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(path)


def _safe_dcp_planner(path: str):
    """A ``DefaultLoadPlanner`` reading non-tensor items with ``torch.load(weights_only=True)``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                raise UnsafeCheckpointError(
                    f"{path}: the item {read_item.dest_index.fqn!r} pickles objects other than plain values; "
                    f"refusing to load it (it could run code from the folder): {e}"
                ) from e
            plain = io.BytesIO()  # the parent's torch.load(weights_only=False) only sees the value loaded safely
            torch.save(obj, plain)
            plain.seek(0)
            super().load_bytes(read_item, plain)

    return SafeLoadPlanner()


def read_sharded_metadata(checkpoint_dir):
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of a DCP folder, built only from DCP metadata classes.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` has no ``.metadata`` (naming it).
        UnsafeCheckpointError (a ``ValueError``): the ``.metadata`` pickles anything else (naming the file and the
            refused global).
    """
    return _safe_dcp_reader(_check_checkpoint_dir(checkpoint_dir)).read_metadata()


def load_dcp(state: dict, checkpoint_dir) -> None:
    """``torch.distributed.checkpoint.load(state, checkpoint_id=checkpoint_dir)`` that runs no code from the folder;
    collective.

    Raises:
        FileNotFoundError: no ``.metadata`` (naming the folder).
        UnsafeCheckpointError (a ``ValueError``): ``.metadata`` or an item pickles anything else.
        RuntimeError: keys of ``state`` missing in the checkpoint (from ``torch.distributed.checkpoint``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = _check_checkpoint_dir(checkpoint_dir)
    read_sharded_metadata(path)  # raises here; inside dcp.load the error would reach the caller as text only
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=_safe_dcp_reader(path), planner=_safe_dcp_planner(path))
    except CheckpointException as error:  # a BaseException carrying each rank's exception
        refused = [exc for exc, _ in error.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from error
        raise


def _model_optimizer_state(model: nn.Module, optimizer) -> dict:
    """``{"model": ...}`` and, with an ``optimizer``, ``"optimizer"``: DCP's state dicts of both."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def _keep_saved_optimizer_state(state: dict, path: str) -> list[str]:
    """Drop from ``state["optimizer"]`` the parameters the checkpoint at ``path`` has no state for; return them."""
    # get_state_dict creates a state for every parameter of a fresh optimizer; parameters that never had a gradient
    # (the DSA indexer: top-k selection only) have none in the saved optimizer. Drop exactly those (the loaded
    # optimizer then has no state for them either, as the saved one); any other missing key still raises.
    if "optimizer" not in state:
        return []
    saved = {
        key[len("optimizer.state."):].rsplit(".", 1)[0]
        for key in read_sharded_metadata(path).state_dict_metadata
        if key.startswith("optimizer.state.")
    }
    osd = state["optimizer"]
    stateless = [fqn for fqn in osd["state"] if fqn not in saved]
    osd["state"] = {fqn: value for fqn, value in osd["state"].items() if fqn in saved}
    return stateless


def _set_loaded_state(model: nn.Module, optimizer, state: dict, stateless: list[str]) -> None:
    """Put the loaded ``state`` into ``model`` (and ``optimizer``)."""
    # strict=False only lets set_state_dict accept the stateless parameters (every model key was loaded)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(strict=not stateless))


def save_sharded_checkpoint(checkpoint_dir, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save model (and optimizer, unless ``None``) state as a sharded DCP folder ``checkpoint_dir`` (created, shared
    by the ranks) with keys ``"model"`` and ``"optimizer"``; collective."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_model_optimizer_state(model, optimizer), checkpoint_id=os.fspath(checkpoint_dir))


def load_sharded_checkpoint(checkpoint_dir, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a folder written by :func:`save_sharded_checkpoint` into ``model`` (and ``optimizer``) in place; collective.

    DCP reshards on load; a fresh optimizer gets its state created first. No code from the folder runs
    (:func:`load_dcp`).

    Raises:
        FileNotFoundError: ``checkpoint_dir`` has no DCP ``.metadata`` (naming it).
        UnsafeCheckpointError (a ``ValueError``): ``.metadata`` or a non-tensor item pickles anything else.
        RuntimeError: keys missing in the checkpoint (e.g. an optimizer requested from a weights-only checkpoint).
    """
    path = _check_checkpoint_dir(checkpoint_dir)
    state = _model_optimizer_state(model, optimizer)
    stateless = _keep_saved_optimizer_state(state, path)
    load_dcp(state, path)  # raises on any requested key the checkpoint lacks
    _set_loaded_state(model, optimizer, state, stateless)


__all__ = ["FP32_ANCHOR_CLASSES", "Fsdp2Plan", "UnsafeCheckpointError", "apply_fsdp2", "fp32_kept_parameter_names",
           "load_dcp", "load_sharded_checkpoint", "no_split_blocks", "read_sharded_metadata", "save_sharded_checkpoint",
           "shard_fp32_kept_units"]
