"""Expert parallelism (EP) for GLM-5.3-Flash training: routed experts sharded over the ``"ep"`` dimension of a
``(dp, ep)`` ``DeviceMesh``, all-to-all dispatch / combine, gradients reduced over each parameter's replica group.

Sources: transformers ``distributed/expert_parallel.py`` (``AllToAllEP``), DeepSeek-V3 technical report §3.2,
GShard, torch ``fully_shard`` (``set_gradient_divide_factor``), ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..moe_ops import combine_rows, routing_metadata

MOE_CLASS_NAME = "Glm53FlashMoE"
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _all_to_all(x, output_splits, input_splits, group):
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Autograd all-to-all of rows, ``apply(x, output_splits, input_splits, group)``: ``x [sum(input_splits), ...]`` ->
    ``[sum(output_splits), ...]``; the backward is the reverse all-to-all.
    """

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


class ExpertDispatcher:
    """Token dispatch and combine of one MoE block under EP; collective over the ep group (any ``T``, including 0).

    Called as ``dispatcher(experts, hidden [T, H], top_k_index int [T, k] (global ids), top_k_weights fp32 [T, k])``
    -> ``[T, H]`` in ``hidden.dtype``, combined in the one-process order (:func:`.moe_ops.combine_rows`);
    ``num_experts`` is the global ``E``, ``group`` the ep process group.
    """

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int, group):
        self.num_experts, self.ep_size, self.ep_rank, self.group = num_experts, ep_size, ep_rank, group
        self.num_local_experts = num_experts // ep_size

    def __call__(self, experts, hidden_states, top_k_index, top_k_weights):
        E, ep, n_local = self.num_experts, self.ep_size, self.num_local_experts
        sorted_ids, token_of_row, offsets, row_weights = routing_metadata(top_k_index, top_k_weights, E)
        counts = torch.diff(offsets.to(torch.int64), prepend=offsets.new_zeros(1, dtype=torch.int64))
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [ep * n_local]: from each rank, per expert
        send_sizes = counts.view(ep, n_local).sum(1).tolist()
        recv_sizes = recv_counts.view(ep, n_local).sum(1).tolist()
        rows = hidden_states.index_select(0, token_of_row)
        received = AllToAll.apply(rows, recv_sizes, send_sizes, self.group)
        local_ids = torch.arange(n_local, device=received.device).repeat(ep)
        local_ids = local_ids.repeat_interleave(recv_counts, output_size=received.shape[0]).unsqueeze(1)
        unit = torch.ones(local_ids.shape, dtype=torch.float32, device=received.device)
        out = experts(received, local_ids, unit)  # rows of the received order, top-1, weight 1
        back = AllToAll.apply(out, send_sizes, recv_sizes, self.group)
        out_rows = back * row_weights.unsqueeze(-1)
        return combine_rows(out_rows, token_of_row, top_k_index.shape[1]).to(hidden_states.dtype)


@dataclass
class ExpertParallelPlan:
    """What :func:`apply_expert_parallel` did: the ``("dp", "ep")`` mesh and its flattened ``flat_mesh``, the global
    ``num_experts``, sizes and coordinates, the sharded ``moe_modules``, ``all_ranks``, ``dp_ranks`` (an expert's
    replicas), ``ep_ranks`` (the all-to-all group), ``reduction_groups`` (the ranks each non-FSDP gradient is reduced
    over)."""

    mesh: object
    dp_size: int
    ep_size: int
    dp_rank: int
    ep_rank: int
    moe_modules: list[str] = field(default_factory=list)
    all_ranks: list[int] = field(default_factory=list)
    dp_ranks: list[int] = field(default_factory=list)
    ep_ranks: list[int] = field(default_factory=list)
    reduction_groups: dict[str, list[int]] = field(default_factory=dict)
    flat_mesh: object = None
    num_experts: int = 0
    _groups: dict = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.dp_size * self.ep_size

    def is_expert_parameter(self, name: str) -> bool:
        """Whether parameter ``name`` (PEFT prefixes allowed) lives under a sharded experts module."""
        return any(f".{moe}.experts." in f".{name}" for moe in self.moe_modules)

    def replica_ranks(self, name: str) -> list[int]:
        """The ranks holding a replica of parameter ``name``: ``dp_ranks`` for expert parameters, else all ranks."""
        return self.dp_ranks if self.is_expert_parameter(name) else self.all_ranks

    def group(self, ranks: list[int]):
        """The process group of ``ranks``."""
        key = tuple(ranks)
        if key not in self._groups:
            raise ValueError(f"no process group for ranks {list(ranks)}; expected one of {list(self._groups)}")
        return self._groups[key]


def find_moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """``{qualified name: module}`` of every ``Glm53FlashMoE`` in ``model`` (decoder layers and the MTP layer)."""
    return {name: m for name, m in model.named_modules() if type(m).__name__ == MOE_CLASS_NAME}


def apply_expert_parallel(model: nn.Module, mesh) -> ExpertParallelPlan:
    """Shard the routed experts of every MoE block over ``mesh["ep"]`` in place (each keeps ``E/ep`` experts:
    ``gate_up_proj [E/ep, 2I, H]``, ``down_proj [E/ep, H, I]``) and install :class:`ExpertDispatcher`; call it on the
    full model, before PEFT and FSDP.

    ``mesh``: a ``DeviceMesh`` with dims ``("dp", "ep")`` over the process group. Returns an
    :class:`ExpertParallelPlan` (``reduction_groups`` empty).

    Raises:
        ValueError: a mesh without those dimensions; ``n_routed_experts`` not divisible by the ep size; no MoE block;
            experts already sharded or wrapped.
    """
    if tuple(mesh.mesh_dim_names or ()) != ("dp", "ep"):
        raise ValueError("mesh must have mesh_dim_names ('dp', 'ep') (dp may be 1); got "
                         f"mesh_dim_names={mesh.mesh_dim_names}")
    dp_size, ep_size = mesh["dp"].size(), mesh["ep"].size()
    dp_rank, ep_rank = mesh["dp"].get_local_rank(), mesh["ep"].get_local_rank()
    blocks = find_moe_blocks(model)
    if not blocks:
        raise ValueError(f"model={type(model).__name__} has no {MOE_CLASS_NAME} block to shard")
    all_ranks = sorted(mesh.mesh.flatten().tolist())
    ep_ranks, dp_ranks = (sorted(mesh[dim].mesh.flatten().tolist()) for dim in ("ep", "dp"))
    plan = ExpertParallelPlan(mesh, dp_size, ep_size, dp_rank, ep_rank, list(blocks), all_ranks, dp_ranks, ep_ranks)
    plan.flat_mesh = mesh["ep"] if dp_size == 1 else mesh._flatten("dp_ep")
    plan._groups[tuple(ep_ranks)] = mesh["ep"].get_group()
    plan._groups[tuple(dp_ranks)] = mesh["dp"].get_group()
    plan._groups[tuple(all_ranks)] = plan.flat_mesh.get_group()
    for name, moe in blocks.items():
        experts = moe.experts
        if type(experts).__name__ != "Glm53FlashExperts" or hasattr(experts, "expert_offset"):
            raise ValueError(f"{name}.experts must be an unsharded Glm53FlashExperts (apply EP before PEFT and FSDP); "
                             f"got {type(experts).__name__}")
        num_experts = experts.gate_up_proj.shape[0]
        if num_experts % ep_size:
            raise ValueError(f"n_routed_experts={num_experts} must be divisible by the ep size; got ep={ep_size} "
                             f"({name})")
        n_local = num_experts // ep_size
        lo = ep_rank * n_local
        for attr in EXPERT_WEIGHTS:
            full = getattr(experts, attr)
            local = nn.Parameter(full.detach()[lo : lo + n_local].clone(), requires_grad=full.requires_grad)
            setattr(experts, attr, local)
        experts.num_experts, experts.expert_offset, experts.num_global_experts = n_local, lo, num_experts
        plan.num_experts = num_experts
        moe.token_dispatch = ExpertDispatcher(num_experts, ep_size, ep_rank, mesh["ep"].get_group())
    return plan


def replicate_reduction_groups(model: nn.Module, plan: ExpertParallelPlan) -> None:
    """Replicated (no FSDP) training: give every trainable parameter its replica group as reduction group, then
    :func:`check_reduction_groups`; call :func:`reduce_gradients` after each backward.
    """
    for name, p in model.named_parameters():
        if p.requires_grad:
            plan.reduction_groups[name] = plan.replica_ranks(name)
    check_reduction_groups(model, plan)


def reduction_ranks(name: str, param: torch.Tensor, plan: ExpertParallelPlan) -> list[int] | None:
    """The ranks parameter ``name``'s gradient is reduced over (a DTensor's mesh, else ``plan.reduction_groups``; None).
    """
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return sorted(param.device_mesh.mesh.flatten().tolist())
    return plan.reduction_groups.get(name)


def check_reduction_groups(model: nn.Module, plan: ExpertParallelPlan) -> None:
    """Refuse a setup where a trainable parameter's gradient is not reduced over exactly its replica group.

    Raises:
        ValueError: naming the first such parameter, its reduction group and its replica group.
    """
    if plan.world_size == 1:
        return
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        expected = plan.replica_ranks(name)
        actual = reduction_ranks(name, p, plan)
        if actual is None and len(expected) == 1:
            continue
        if actual != expected:
            missing = sorted(set(expected) - set(actual or []))
            extra = sorted(set(actual or []) - set(expected))
            raise ValueError(f"parameter {name}: its gradient would be reduced over ranks {actual} but its replicas "
                             f"are on ranks {expected} (missing replicas {missing}, ranks without a replica {extra}); "
                             "expected reduction group = replica group")


@torch.no_grad()
def reduce_gradients(model: nn.Module, plan: ExpertParallelPlan) -> None:
    """Replicated training: sum each gradient over its reduction group and divide by the world size; collective."""
    buckets: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is None or name not in plan.reduction_groups:
            continue
        buckets.setdefault(tuple(plan.reduction_groups[name]), []).append(p.grad)
    for ranks in sorted(buckets, key=lambda r: (len(r), r), reverse=True):
        grads = buckets[ranks]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if len(ranks) > 1:
            dist.all_reduce(flat, group=plan.group(list(ranks)))
        flat /= plan.world_size
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def apply_fsdp2_ep(model: nn.Module, plan: ExpertParallelPlan, **fsdp_kwargs):
    """FSDP2 under EP: each ``experts`` (with PEFT wrappers) a unit on the ``dp`` mesh with divide factor ``W``, the
    rest by :func:`glm53flash_hf.train.distributed.apply_fsdp2` over all ranks; then :func:`check_reduction_groups`.

    ``model``: after :func:`apply_expert_parallel` (and PEFT), with its ``plan``; ``fsdp_kwargs`` as ``apply_fsdp2``.
    Returns the ``Fsdp2Plan`` of the non-expert units.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .distributed import apply_fsdp2

    policy = MixedPrecisionPolicy(param_dtype=fsdp_kwargs.get("param_dtype"), cast_forward_inputs=False,
                                  reduce_dtype=fsdp_kwargs.get("reduce_dtype", torch.float32))
    suffixes = tuple(f".{m}.experts" for m in plan.moe_modules)
    for experts in [m for n, m in model.named_modules() if f".{n}".endswith(suffixes)]:
        # a size-1 dp mesh (ep only) still makes a unit: its parameters then stay out of the dense units
        fully_shard(experts, mesh=plan.mesh["dp"], mp_policy=policy,
                    reshard_after_forward=fsdp_kwargs.get("reshard_after_forward", True))
        experts.set_gradient_divide_factor(float(plan.world_size))
        if plan.dp_size > 1:
            # sum, then divide by W after the reduce-scatter: a divide factor other than the mesh size is otherwise
            # a PREMUL_SUM reduction, which gloo does not have. Not on a 1-rank mesh: there torch 2.13's
            # foreach_reduce divides the copied gradient by the factor *and* post-divides it again when sum
            # reductions are forced (gradients scaled by 1/W^2).
            experts.set_force_sum_reduction_for_comms(True)
    fsdp_plan = apply_fsdp2(model, mesh=plan.flat_mesh, **fsdp_kwargs)
    check_reduction_groups(model, plan)
    return fsdp_plan


@torch.no_grad()
def clip_grad_norm_ep(model: nn.Module, plan: ExpertParallelPlan, max_norm: float) -> torch.Tensor:
    """Global gradient 2-norm under EP (each element once, fp64 squares, one all-reduce), clipped to ``max_norm``
    (``inf`` or ``<= 0``: measure only); collective, after reduction. Returns the fp32 norm before clipping.

    Raises:
        ValueError: a gradient DTensor with a ``Replicate`` placement.
    """
    from torch.distributed.tensor import DTensor, Replicate

    sq = torch.zeros((), dtype=torch.float64)
    grads = []
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        grads.append(g)
        if isinstance(g, DTensor):
            if any(isinstance(pl, Replicate) for pl in g.placements):
                raise ValueError(f"clip_grad_norm_ep: gradient of {name} has placements {g.placements}; "
                                 "expected Shard placements only")
            local, copies = g.to_local(), 1
        else:
            local, copies = g, len(plan.reduction_groups.get(name) or plan.replica_ranks(name))
        sq += local.detach().double().square().sum().cpu() / copies
    if plan.world_size > 1:
        sq = sq.to(grads[0].device if grads else "cpu")
        dist.all_reduce(sq, group=plan.group(plan.all_ranks))
    norm = sq.sqrt().float().cpu()
    if 0 < max_norm < float("inf"):
        coef = min(1.0, float(max_norm) / (norm.item() + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return norm


def _expert_weight_key(name: str, plan: ExpertParallelPlan) -> bool:
    return plan.is_expert_parameter(name) and name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS


def _ep_parts(t: torch.Tensor, plan: ExpertParallelPlan) -> list[torch.Tensor]:
    """Every ep rank's ``t`` (all-gather over the ep group)."""
    parts = [torch.empty_like(t) for _ in range(plan.ep_size)]
    dist.all_gather(parts, t.contiguous(), group=plan.group(plan.ep_ranks))
    return parts


def _full_local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def gather_full_state_dict(model: nn.Module, plan: ExpertParallelPlan) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict`` on every rank (collective), experts all-gathered into ``[E, ...]``.

    Raises:
        ValueError: a PEFT state-dict key (``base_layer`` / ``lora_``); gather the base model instead.
    """
    out = {}
    for name, t in model.state_dict().items():
        if "lora_" in name or "base_layer" in name:
            raise ValueError(f"gather_full_state_dict needs the base model; got PEFT key {name}")
        t = _full_local(t).detach()
        if _expert_weight_key(name, plan) and plan.ep_size > 1:
            t = torch.cat(_ep_parts(t, plan))
        out[name] = t
    return out


def gather_adapter_state_dict(model: nn.Module, plan: ExpertParallelPlan) -> dict[str, torch.Tensor]:
    """The PEFT model's adapter tensors in the one-process layout, on every rank (collective)."""
    out = {}
    for name, t in model.state_dict().items():
        if "lora_" not in name and "modules_to_save" not in name:
            continue
        t = _full_local(t).detach()
        if plan.ep_size > 1 and plan.is_expert_parameter(name) and "lora_" in name:
            parts = _ep_parts(t, plan)  # PEFT's one-process layout (ParamWrapper): lora_B [out, r * E], expert-minor
            if "lora_B" in name:
                n_local = plan.num_experts // plan.ep_size
                out_f, r = t.shape[0], t.shape[1] // n_local
                t = torch.cat([q.view(out_f, r, n_local) for q in parts], dim=2).reshape(out_f, -1)
            else:
                t = torch.cat(parts)
        out[name] = t
    return out


def save_adapter_ep(model: nn.Module, plan: ExpertParallelPlan, save_directory) -> None:
    """``PeftModel.save_pretrained`` of an EP-trained adapter in the one-process layout (collective; rank 0 writes)."""
    full = gather_adapter_state_dict(model, plan)
    if dist.get_rank() == plan.all_ranks[0]:
        model.save_pretrained(os.fspath(save_directory), state_dict=full)
    dist.barrier()


def save_pretrained_ep(model: nn.Module, plan: ExpertParallelPlan, save_directory, **kwargs) -> None:
    """``save_pretrained`` of the full model under EP in the published layout (collective; rank 0 builds the unsharded
    class on meta and writes; load with ``from_pretrained`` and :func:`apply_expert_parallel`).
    """
    full = gather_full_state_dict(model, plan)
    if dist.get_rank() == plan.all_ranks[0]:
        cls = next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))  # the unsharded class
        with torch.device("meta"):
            fresh = cls(model.config)
        fresh.load_state_dict(full, strict=True, assign=True)
        persistent = set(full)
        for name, buf in model.named_buffers():
            if name not in persistent:
                owner, _, attr = name.rpartition(".")
                fresh.get_submodule(owner).register_buffer(attr, buf.detach().clone(), persistent=False)
        fresh.save_pretrained(os.fspath(save_directory), **kwargs)
    dist.barrier()


def _to_ep_dtensor(t: torch.Tensor, plan: ExpertParallelPlan):
    from torch.distributed.tensor import DTensor, Shard

    local = _full_local(t).detach().contiguous()
    shape = (local.shape[0] * plan.ep_size, *local.shape[1:])
    return DTensor.from_local(local, plan.mesh["ep"], [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _from_ep_dtensor(loaded, template):
    from torch.distributed.tensor import DTensor, distribute_tensor

    local = loaded.to_local()
    if isinstance(template, DTensor):
        return distribute_tensor(local, template.device_mesh, template.placements, src_data_rank=None)
    return local


def _ep_state(model, optimizer, plan):
    from .distributed import _model_optimizer_state

    state = _model_optimizer_state(model, optimizer)
    msd, osd = state["model"], state.get("optimizer")
    templates = {}
    for name in list(msd):
        if _expert_weight_key(name, plan) or (plan.is_expert_parameter(name) and "lora_" in name):
            templates[("model", name)] = msd[name]
            msd[name] = _to_ep_dtensor(msd[name], plan)
    if osd is not None:
        # the per-parameter state dicts get_state_dict returns may be the optimizer's own: copy before replacing
        osd = state["optimizer"] = {**osd, "state": {fqn: dict(st) for fqn, st in osd["state"].items()}}
        for fqn, st in osd["state"].items():
            if plan.is_expert_parameter(fqn):
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        templates[("optim", fqn, k)] = v
                        st[k] = _to_ep_dtensor(v, plan)
    return state, templates


def save_sharded_checkpoint_ep(checkpoint_dir, model, plan: ExpertParallelPlan, optimizer=None) -> None:
    """DCP checkpoint under EP (collective), expert tensors and their optimizer state as DTensors of the global expert
    dimension over the ep mesh.
    """
    import torch.distributed.checkpoint as dcp

    state, _ = _ep_state(model, optimizer, plan)
    dcp.save(state, checkpoint_id=os.fspath(checkpoint_dir))


def load_sharded_checkpoint_ep(checkpoint_dir, model, plan: ExpertParallelPlan, optimizer=None) -> None:
    """Load a folder of :func:`save_sharded_checkpoint_ep` into a model sharded the same way (collective; runs no code
    from the folder).

    Raises:
        FileNotFoundError: no DCP ``.metadata`` in ``checkpoint_dir``. RuntimeError: keys missing (from DCP).
        ValueError: ``.metadata`` or a non-tensor item pickles anything but DCP metadata / plain values.
    """
    from .distributed import _check_checkpoint_dir, _keep_saved_optimizer_state, _set_loaded_state, load_dcp

    path = _check_checkpoint_dir(checkpoint_dir)
    state, templates = _ep_state(model, optimizer, plan)
    # as load_sharded_checkpoint: parameters that never had a gradient (the DSA indexer) have no saved state
    stateless = _keep_saved_optimizer_state(state, path)
    kept = state["optimizer"]["state"] if optimizer is not None else {}
    templates = {k: v for k, v in templates.items() if k[0] == "model" or k[1] in kept}
    load_dcp(state, path)
    for key, template in templates.items():
        if key[0] == "model":
            state["model"][key[1]] = _from_ep_dtensor(state["model"][key[1]], template)
        else:
            st = state["optimizer"]["state"][key[1]]
            st[key[2]] = _from_ep_dtensor(st[key[2]], template)
    _set_loaded_state(model, optimizer, state, stateless)


__all__ = ["AllToAll", "ExpertDispatcher", "ExpertParallelPlan", "apply_expert_parallel", "apply_fsdp2_ep",
           "check_reduction_groups", "clip_grad_norm_ep", "find_moe_blocks", "gather_adapter_state_dict",
           "gather_full_state_dict", "load_sharded_checkpoint_ep", "reduce_gradients", "reduction_ranks",
           "replicate_reduction_groups", "save_adapter_ep", "save_pretrained_ep", "save_sharded_checkpoint_ep"]
