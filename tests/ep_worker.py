"""Workers and single-process references for tests/test_expert_parallel.py (4 processes, gloo, CPU).

Deterministic: a 3-layer tiny model (``tests/ckpt_fixtures.py`` ``tiny_config``: one dense layer, two MoE layers and
the MTP layer's MoE, 8 experts, top-2), fixed global batches of ``ROWS = 4`` rows (one per rank), plain SGD in fp32,
and the aux-loss-free bias update after every step. Loss normalisation as in ``tests/fsdp2_worker.py``: the global
``num_items_in_batch`` in every forward, ``loss * world`` as the backward target.

Scenarios (``variant``): ``"normal"``; ``"imbalance"`` (router biases +10 on expert 0 and +5 on expert 1: every
token's top-2 is {0, 1}, both on ep rank 0, so the other ranks receive no rows); ``"lora"`` (PEFT LoRA on the
attention projections and on the experts' ``gate_up_proj`` / ``down_proj``; base frozen); ``"checkpoint"`` (SGD with
momentum: a DCP checkpoint before step 3, resumed into a fresh model; ``save_pretrained`` under EP after step 3).
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

ROWS, SEQ = 4, 12
LR = 0.5
STEPS = 3
BIAS_SPEED = 1e-3
MOMENTUM = 0.9


def config():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ckpt_fixtures import tiny_config

    return tiny_config(
        num_hidden_layers=3,
        layer_types=["linear_attention", "indexed_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        indexer_types=["full", "full", "full"],
    )


def make_model(variant: str, seed: int = 0):
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    torch.manual_seed(seed)
    model = Glm53FlashForCausalLM(config()).float().train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)  # spread the routing (the default init routes almost uniformly at random)
        if variant == "imbalance":
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b[0], b[1] = 10.0, 5.0
    return model


def lora(model, seed: int = 1):
    import peft

    from glm53flash_hf.train.trainer import default_lora_config

    torch.manual_seed(seed)
    out = peft.get_peft_model(model, default_lora_config(r=2))
    with torch.no_grad():  # B starts at zero in PEFT; a non-zero B makes the adapters matter from step 1
        for name, p in out.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return out


def global_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, 1900, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100
    return {"input_ids": ids, "labels": labels}


def num_items(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def rows_of(batch: dict, rank: int, world: int) -> dict:
    per = ROWS // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def trainable_state(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def bias_state(model) -> dict:
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def reference_run(path: str) -> None:
    """One process, whole batches, every variant: losses, trained parameters, initial LoRA adapters, biases."""
    from glm53flash_hf.train.trainer import AuxLossFreeBalancingCallback

    torch.set_num_threads(1)
    out = {}
    for variant in ("normal", "imbalance", "lora", "momentum"):
        model = make_model("normal" if variant == "momentum" else variant)
        if variant == "lora":
            model = lora(model)
            out["lora_init"] = trainable_state(model)
        balance = AuxLossFreeBalancingCallback(BIAS_SPEED)
        balance.attach(model)
        momentum = MOMENTUM if variant == "momentum" else 0.0
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=momentum)
        losses, norms = [], []
        for step in range(1, STEPS + 1):
            batch = global_batch(step)
            loss = model(**batch, num_items_in_batch=num_items(batch)).loss
            loss.backward()
            # fp64: torch.nn.utils.clip_grad_norm_'s fp32 norm is 6.2e-6 relative below the exact one here (the
            # embedding and lm_head gradients, 131k squares each, dominate), clip_grad_norm_ep sums in fp64
            norms.append(sum(p.grad.double().square().sum() for p in model.parameters()
                             if p.grad is not None).sqrt().item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            balance.update()
            losses.append(loss.item())
        loads = {n: v.clone() for n, v in balance.last_loads.items()}
        out[variant] = {"losses": losses, "grad_norms": norms, "params": trainable_state(model),
                        "bias": bias_state(model), "loads": loads}
        if variant == "momentum":
            out[variant]["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(out, path)


# --------------------------------------------------------------------------------------------------- workers


def _expert_slice(name: str, full: torch.Tensor, plan, local_shape) -> torch.Tensor:
    """This rank's slice of a full (1-process) tensor: expert weights by expert index; LoRA A ``[E * r, in]`` by
    the rows ``e * r : (e + 1) * r`` of the local experts; LoRA B ``[out, r * E]`` by its interleaved columns
    ``j * E + e`` (PEFT's layout: ``peft/tuners/lora/layer.py`` ``ParamWrapper.get_delta_weight``)."""
    lo = plan.ep_rank * local_shape[0]
    if "lora_B" in name:
        num_experts = config().text_config.n_routed_experts
        out_f, cols = full.shape
        r, n_local = cols // num_experts, num_experts // plan.ep_size
        start = plan.ep_rank * n_local
        return full.view(out_f, r, num_experts)[:, :, start : start + n_local].reshape(out_f, r * n_local)
    return full[lo : lo + local_shape[0]]


def _train(variant: str, mode: str, mesh, ref: dict, rank: int, world: int, out: dict, momentum: float = 0.0,
           ckpt_dir: str | None = None):
    """One EP run; returns (model, plan, optimizer) after ``STEPS`` steps and records findings in ``out``."""
    import torch.distributed as dist

    from glm53flash_hf.train import expert_parallel as ep
    from glm53flash_hf.train.trainer import AuxLossFreeBalancingCallback

    model = make_model(variant)
    plan = ep.apply_expert_parallel(model, mesh)
    if variant == "lora":
        model = lora(model)
        init = ref["lora_init"]
        with torch.no_grad():  # the 1-process adapters: whole for replicated layers, this rank's experts' slices
            for name, p in model.named_parameters():
                if p.requires_grad:
                    full = init[name]
                    p.copy_(_expert_slice(name, full, plan, p.shape) if plan.is_expert_parameter(name) else full)
    if mode == "fsdp":
        ep.apply_fsdp2_ep(model, plan)
    elif mode == "fsdp_bf16":
        ep.apply_fsdp2_ep(model, plan, param_dtype=torch.bfloat16)
    else:
        ep.replicate_reduction_groups(model, plan)
    balance = AuxLossFreeBalancingCallback(BIAS_SPEED)
    balance.attach(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=momentum)
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        if ckpt_dir is not None and step == STEPS:
            ep.save_sharded_checkpoint_ep(ckpt_dir, model, plan, opt)
        batch = global_batch(step)
        loss = model(**rows_of(batch, rank, world), num_items_in_batch=num_items(batch)).loss
        (loss * world).backward()
        if mode == "replicate":
            ep.reduce_gradients(model, plan)
        norms.append(ep.clip_grad_norm_ep(model, plan, float("inf")).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        balance.update()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    out["losses"], out["grad_norms"] = losses, norms
    return model, plan, opt, balance


def _compare(model, plan, ref_variant: dict, balance, out: dict) -> None:
    """Replica identity (max |difference| over each parameter's replica group) and distance to the 1-process run."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    replica_diff = {"expert": 0.0, "dense": 0.0}
    ref_diff, worst = 0.0, ""
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        expert = plan.is_expert_parameter(name)
        ranks = plan.replica_ranks(name)
        if len(ranks) > 1:
            parts = [torch.empty_like(full) for _ in ranks]
            dist.all_gather(parts, full.contiguous(), group=plan.group(ranks))
            d = max((q - parts[0]).abs().max().item() for q in parts)
            key = "expert" if expert else "dense"
            replica_diff[key] = max(replica_diff[key], d)
        expect = ref_variant["params"][name]
        if expert:
            expect = _expert_slice(name, expect, plan, full.shape)
        d = (full - expect).abs().max().item()
        if d >= ref_diff:
            ref_diff, worst = d, name
    bias_diff = max(
        (b - ref_variant["bias"][n]).abs().max().item() for n, b in model.named_buffers()
        if n.endswith("e_score_correction_bias")
    ) if not out.get("skip_bias") else 0.0
    out.update(replica_diff=replica_diff, ref_param_diff=(ref_diff, worst), bias_diff=bias_diff,
               loads={n: v.clone() for n, v in balance.last_loads.items()})


def _planted(mesh, plan_world: int, out: dict) -> None:
    """A non-expert parameter (the final norm) sharded on the EP-only submesh (``docs/design.md``, section "Expert
    parallelism")."""
    from torch.distributed.fsdp import fully_shard

    from glm53flash_hf.train import expert_parallel as ep

    model = make_model("normal")
    plan = ep.apply_expert_parallel(model, mesh)
    fully_shard(model.model.norm, mesh=mesh["ep"])
    try:
        ep.apply_fsdp2_ep(model, plan)
        out["planted_fsdp"] = None
    except ValueError as exc:
        out["planted_fsdp"] = str(exc)
    # the plain (EP-unaware) FSDP2 plan on an EP model: the experts land in the dense units on all ranks
    from glm53flash_hf.train.distributed import apply_fsdp2

    model = make_model("normal")
    plan = ep.apply_expert_parallel(model, mesh)
    apply_fsdp2(model, mesh=plan.flat_mesh)
    try:
        ep.check_reduction_groups(model, plan)
        out["planted_experts_dense"] = None
    except ValueError as exc:
        out["planted_experts_dense"] = str(exc)
    # replicated mode: lm_head registered on the EP-only group
    model = make_model("normal")
    plan = ep.apply_expert_parallel(model, mesh)
    for name, _ in model.named_parameters():
        plan.reduction_groups[name] = plan.replica_ranks(name)
    plan.reduction_groups["lm_head.weight"] = plan.ep_ranks
    try:
        ep.check_reduction_groups(model, plan)
        out["planted_replicate"] = None
    except ValueError as exc:
        out["planted_replicate"] = str(exc)
    # what the check prevents: train the replicated mode with that group anyway; lm_head replicas drift apart
    if plan.dp_size > 1:
        _drift(model, plan, mesh, out)
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    odd = config()
    odd.text_config.n_routed_experts = 5
    try:
        ep.apply_expert_parallel(Glm53FlashForCausalLM(odd), mesh)
        out["indivisible"] = None
    except ValueError as exc:
        out["indivisible"] = str(exc)


def _drift(model, plan, mesh, out: dict) -> None:
    import torch.distributed as dist

    from glm53flash_hf.train import expert_parallel as ep

    rank, world = dist.get_rank(), plan.world_size
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(1, STEPS + 1):
        batch = global_batch(step)
        loss = model(**rows_of(batch, rank, world), num_items_in_batch=num_items(batch)).loss
        (loss * world).backward()
        ep.reduce_gradients(model, plan)
        opt.step()
        opt.zero_grad(set_to_none=True)
    w = model.lm_head.weight.detach()
    parts = [torch.empty_like(w) for _ in range(world)]
    dist.all_gather(parts, w.contiguous())
    out["drift_lm_head"] = max((p - parts[0]).abs().max().item() for p in parts)


def worker(rank: int, world: int, port: int, tmpdir: str, ref_path: str, dp: int, ep_size: int,
           scenarios: list) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if os.environ.get("TRITON_INTERPRET") != "1" and "fla" not in sys.modules:
        sys.modules["fla"] = None
    torch.set_num_threads(1)
    out: dict = {}
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=240)
        )
        mesh = init_device_mesh("cpu", (dp, ep_size), mesh_dim_names=("dp", "ep"))
        ref = torch.load(ref_path)
        for variant, mode in scenarios:
            if variant == "planted":
                res = {}
                _planted(mesh, world, res)
                out["planted"] = res
                continue
            res = {}
            ckpt = os.path.join(tmpdir, f"dcp_{variant}_{mode}") if variant.startswith("checkpoint") else None
            base = {"checkpoint": "normal", "checkpoint_lora": "lora"}.get(variant, variant)
            model, plan, opt, balance = _train(base, mode, mesh, ref, rank, world, res,
                                               momentum=MOMENTUM if ckpt else 0.0, ckpt_dir=ckpt)
            if variant.startswith("checkpoint"):
                _checkpoint(model, plan, ref, mode, mesh, rank, world, tmpdir, ckpt, res, base)
            else:
                _compare(model, plan, ref[variant], balance, res)
            if variant == "lora":
                from glm53flash_hf.train.expert_parallel import save_adapter_ep

                res["adapter_dir"] = os.path.join(tmpdir, f"adapter_{mode}")
                save_adapter_ep(model, plan, res["adapter_dir"])
            out[f"{variant}/{mode}"] = res
            del model, opt
        dist.barrier()
    except BaseException:
        out["error"] = traceback.format_exc()
        torch.save(out, os.path.join(tmpdir, f"result_{rank}.pt"))
        raise
    torch.save(out, os.path.join(tmpdir, f"result_{rank}.pt"))
    dist.destroy_process_group()


def _checkpoint(model, plan, ref, mode, mesh, rank, world, tmpdir, ckpt, res, base="normal") -> None:
    """DCP resume (momentum SGD: expert optimizer state too) and, for the base model, save_pretrained under EP.
    ``base == "lora"``: the resumed model is a fresh LoRA model (other adapter init), expert adapters in the DCP."""
    import torch.distributed as dist

    from glm53flash_hf.train import expert_parallel as ep

    # resume: fresh weights (seed 1), fresh optimizer, load the pre-step-3 checkpoint, take step 3
    fresh = make_model(base, seed=1)
    fplan = ep.apply_expert_parallel(fresh, mesh)
    if base == "lora":
        fresh = lora(fresh, seed=2)
    if mode == "fsdp":
        ep.apply_fsdp2_ep(fresh, fplan)
    else:
        ep.replicate_reduction_groups(fresh, fplan)
    opt = torch.optim.SGD([p for p in fresh.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    ep.load_sharded_checkpoint_ep(ckpt, fresh, fplan, opt)
    batch = global_batch(STEPS)
    loss = fresh(**rows_of(batch, rank, world), num_items_in_batch=num_items(batch)).loss
    total = loss.detach().clone()
    dist.all_reduce(total)
    res["resumed_loss"] = total.item()
    if base != "normal":
        return
    # save_pretrained under EP (the momentum run's trained weights), then load and shard again
    folder = os.path.join(tmpdir, f"pretrained_{mode}")
    ep.save_pretrained_ep(model, plan, folder, max_shard_size="200KB")
    full = ep.gather_full_state_dict(model, plan)  # collective
    res["full_state"] = full if rank == 0 else None
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    loaded = Glm53FlashForCausalLM.from_pretrained(folder).float()
    lplan = ep.apply_expert_parallel(loaded, mesh)
    from torch.distributed.tensor import DTensor

    diff = 0.0
    mine = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        q = mine[name]
        q = q.full_tensor() if isinstance(q, DTensor) else q.detach()
        diff = max(diff, (p.detach() - q).abs().max().item())
    res["reshard_diff"] = diff
    res["folder"] = folder
    del lplan
