"""Workers and the single-process reference for tests/test_fsdp2.py (2 processes, gloo, CPU).

Everything here is deterministic: the tiny model (``glm53flash_hf/tools/tiny_config.json``, ``torch.manual_seed``),
three fixed global batches of packed rows and AdamW. :func:`reference_run` trains the unsharded model on the whole
global batches in one process; :func:`worker` (started twice by ``torch.multiprocessing``) trains the FSDP2-sharded
model, each rank on its half of the rows, checks what the test asserts and writes its findings to
``result_<rank>.pt`` (exceptions are written there too, then re-raised so the launcher stops the other rank).


Loss normalisation: every forward passes ``num_items_in_batch`` = the number of supervised labels of the *global*
batch, so the (main + MTP) loss is a sum over tokens divided by one global constant; the global loss is then the sum
of the ranks' losses, and with ``loss * world_size`` as the backward target FSDP's averaged reduce-scatter gives
exactly the single-process gradient (transformers' Trainer scales the same way).
"""

from __future__ import annotations

import copy
import os
import sys
import time
import traceback

import torch

WORLD = 2
ROWS, SEQ = 4, 24
LR = 1e-3
#: documents per row (lengths sum to SEQ): packed rows with position_ids restarting at every document
DOCS = [(10, 14), (24,), (7, 9, 8), (16, 8)]


def make_model(seed: int = 0):
    """The tiny causal LM in fp32 (MTP layer included; the loss adds 0.1 * mtp_loss)."""
    from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
    from glm53flash_hf.tools.make_tiny import DEFAULT_CONFIG

    torch.manual_seed(seed)
    return Glm53FlashForCausalLM(Glm53FlashConfig.from_json_file(DEFAULT_CONFIG)).float().train()


def global_batch(step: int) -> dict:
    """Global batch of ``step`` (1-based): ``input_ids``/``position_ids``/``labels`` ``[ROWS, SEQ]``; labels are -100
    on each document's first token (no cross-document target) and on a few prompt tokens."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 1900, (ROWS, SEQ), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in docs]).unsqueeze(0) for docs in DOCS])
    labels = ids.clone()
    labels[pos == 0] = -100
    labels[:, 1:3][torch.rand(ROWS, 2, generator=g) < 0.5] = -100
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def num_items(batch: dict) -> int:
    """Supervised targets of the global batch after the causal shift (transformers' count)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def rows_of(batch: dict, rank: int, world: int) -> dict:
    per = ROWS // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def reference_run(path: str, steps: int = 3) -> None:
    """Single process, whole global batches: losses of ``steps`` AdamW steps and the step-1 gradients."""
    torch.set_num_threads(1)
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(1, steps + 1):
        batch = global_batch(step)
        loss = model(**batch, num_items_in_batch=num_items(batch)).loss
        loss.backward()
        if step == 1:
            # the indexer's parameters get no gradient (top-k selection only; no indexer loss in this model)
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.save({"losses": losses, "grads": grads}, path)


def _train_step(model, opt, step: int, rank: int, world: int, grads_out: dict | None = None) -> float:
    """One AdamW step on this rank's rows; returns the global loss (sum over ranks)."""
    import torch.distributed as dist

    batch = global_batch(step)
    loss = model(**rows_of(batch, rank, world), num_items_in_batch=num_items(batch)).loss
    (loss * world).backward()
    if grads_out is not None:
        grads_out.update(
            {n: p.grad.to_local().detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item()


def _local_slice(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's ``Shard(0)`` part of ``full`` (DTensor's split, no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _sharding_report(model, plan) -> dict:
    """Every parameter of every block: DTensor, one Shard(0) placement on a 2-rank mesh, local shard < full."""
    from torch.distributed.tensor import DTensor, Shard

    bad, checked = [], 0
    blocks = {q: model.get_submodule(q) for q in plan.blocks}
    for qual, block in blocks.items():
        for name, p in block.named_parameters(prefix=qual):
            checked += 1
            if not isinstance(p, DTensor):
                bad.append(f"{name}: {type(p).__name__}")
            elif tuple(p.placements) != (Shard(0),) or p.device_mesh.size() != WORLD:
                bad.append(f"{name}: placements {p.placements} mesh {p.device_mesh}")
            elif not p.to_local().numel() < p.numel():
                bad.append(f"{name}: local {tuple(p.to_local().shape)} of {tuple(p.shape)}")
    others = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    return {"blocks": list(blocks), "checked": checked, "bad": bad, "not_dtensor_elsewhere": others}


def _fp32_run(rank: int, world: int, mesh, tmpdir: str, ref: dict, out: dict) -> None:
    from glm53flash_hf.train.distributed import apply_fsdp2, load_sharded_checkpoint, save_sharded_checkpoint

    model = make_model(0)
    plan = apply_fsdp2(model, mesh=mesh)
    out["sharding"] = _sharding_report(model, plan)
    out["fp32_plan_units"] = (list(plan.fp32_units), list(plan.low_precision_units))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    grads: dict = {}
    losses = [_train_step(model, opt, 1, rank, world, grads_out=grads), _train_step(model, opt, 2, rank, world)]
    # step-1 gradients: this rank's shard against the same rows of the single-process gradient
    params = dict(model.named_parameters())
    worst = (0.0, "")
    out["grad_names_match"] = sorted(grads) == sorted(ref["grads"])
    for name, g in grads.items():
        expect = _local_slice(ref["grads"][name], params[name])
        scale = ref["grads"][name].abs().max().item()
        err = (g - expect).abs().max().item() / scale if scale > 0 else (g - expect).abs().max().item()
        worst = max(worst, (err, name))
    out["grad_rel_err"] = worst
    out["grad_count"] = len(grads)
    ckpt = os.path.join(tmpdir, "ckpt_step2")
    save_sharded_checkpoint(ckpt, model, opt)
    losses.append(_train_step(model, opt, 3, rank, world))
    out["losses"] = losses

    # resume: different initial weights, fresh optimizer, load the step-2 checkpoint, take step 3
    fresh = make_model(1)
    apply_fsdp2(fresh, mesh=mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    load_sharded_checkpoint(ckpt, fresh, fresh_opt)
    out["resumed_loss3"] = _train_step(fresh, fresh_opt, 3, rank, world)
    out["resumed_files"] = sorted(os.listdir(ckpt))

    # dispatch.local_tensor on real DTensors (outside a forward, FSDP parameters are sharded DTensors)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from glm53flash_hf.dispatch import local_tensor

    t = torch.arange(12.0).view(4, 3)
    rep = local_tensor(distribute_tensor(t, mesh, [Replicate()]), "test.replicated")
    out["replicate_unwrapped"] = type(rep) is torch.Tensor and torch.equal(rep, t)
    errors = []
    for name, tensor in (
        ("test.sharded", distribute_tensor(t, mesh, [Shard(0)])),
        ("lm_head.weight", fresh.lm_head.weight),
    ):
        try:
            local_tensor(tensor, name)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    out["shard_errors"] = errors


class _DtypeRecorder:
    """Forward pre-hooks on every module recording the dtype of each parameter while it is unsharded (a plain tensor:
    FSDP swaps the gathered parameter in before the hooks registered after ``fully_shard`` run) and of each buffer."""

    def __init__(self, model):
        self.model, self.params, self.buffers, self.handles = model, {}, {}, []

    def __enter__(self):
        from torch.distributed.tensor import DTensor

        def record(prefix):
            def hook(module, args, kwargs):
                for name, p in module.named_parameters(prefix=prefix):
                    if not isinstance(p, DTensor):
                        self.params[name] = str(p.dtype)
                for name, b in module.named_buffers(prefix=prefix, recurse=False):
                    self.buffers[name] = str(b.dtype)

            return hook

        for qual, module in self.model.named_modules():
            self.handles.append(module.register_forward_pre_hook(record(qual), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _accelerate_run(rank: int, world: int, accelerate_env: dict, out: dict) -> None:
    """The recipe of configuration/accelerate_fsdp2.yaml: ``shard_fp32_kept_units``, then accelerate's own
    ``fsdp2_prepare_model`` with the plugin the yaml's environment builds (accelerate drops FSDP on CPU, so it is
    called directly with a stand-in for the ``Accelerator``: plugin, mixed precision, no device mesh)."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from glm53flash_hf.train.distributed import shard_fp32_kept_units

    os.environ.update(accelerate_env)
    plugin = FullyShardedDataParallelPlugin()
    mixed = accelerate_env["ACCELERATE_MIXED_PRECISION"]
    plugin.set_mixed_precision(mixed)
    model = make_model(0)
    plan = shard_fp32_kept_units(model)
    stand_in = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None, mixed_precision=mixed,
        is_main_process=rank == 0, device=torch.device("cpu"),
    )
    model = fsdp2_prepare_model(stand_in, model)
    batch = global_batch(1)
    with _DtypeRecorder(model) as rec:
        loss = model(**rows_of(batch, rank, world), num_items_in_batch=num_items(batch)).loss
    (loss.float() * world).backward()
    out["accelerate"] = {
        "units": [q for q, m in model.named_modules() if isinstance(m, FSDPModule)],
        "plan_fp32_units": plan.fp32_units,
        "fp32_parameters": plan.fp32_parameters,
        "seen": rec.params,
        "not_dtensor": [n for n, p in model.named_parameters() if not isinstance(p, DTensor)],
        "missing_grads": [n for n, p in model.named_parameters() if p.grad is None and "indexer" not in n],
        "loss_dtype": str(loss.dtype),
        "policy": repr(plugin.mixed_precision_policy),
    }


def _bf16_run(rank: int, world: int, mesh, out: dict) -> None:
    """bf16 policy: dtypes seen in the forward; loss and gradients against an unsharded model with the same dtypes."""
    import torch.distributed as dist

    from glm53flash_hf.train.distributed import apply_fsdp2, fp32_kept_parameter_names

    model = make_model(0)
    kept = fp32_kept_parameter_names(model)
    reference = copy.deepcopy(model)
    all_bf16 = copy.deepcopy(model)
    plan = apply_fsdp2(model, mesh=mesh, param_dtype=torch.bfloat16)
    fp32_names = set(plan.fp32_parameters)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name not in fp32_names:
                p.data = p.data.to(torch.bfloat16)
        for p in all_bf16.parameters():
            p.data = p.data.to(torch.bfloat16)

    batch = global_batch(1)
    mine = rows_of(batch, rank, world)
    n = num_items(batch)
    with _DtypeRecorder(model) as rec:
        loss = model(**mine, num_items_in_batch=n).loss
    (loss * world).backward()
    ref_loss = reference(**mine, num_items_in_batch=n).loss
    (ref_loss * world).backward()
    with torch.no_grad():
        bf16_loss = all_bf16(**mine, num_items_in_batch=n).loss

    names = [name for name, p in reference.named_parameters() if p.grad is not None]
    out["bf16_grad_names_match"] = names == [name for name, p in model.named_parameters() if p.grad is not None]
    flat = torch.cat([reference.get_parameter(name).grad.float().flatten() for name in names])
    dist.all_reduce(flat)
    flat /= world
    params = dict(model.named_parameters())
    worst, offset = (0.0, ""), 0
    grad_dtypes = set()
    for name in names:
        full_shape = params[name].shape
        numel = full_shape.numel()
        expect_full = flat[offset : offset + numel].view(full_shape)
        offset += numel
        g = params[name].grad
        grad_dtypes.add(str(g.dtype))
        expect = _local_slice(expect_full, g)
        scale = expect_full.abs().max().item()
        err = (g.to_local() - expect).abs().max().item() / (scale if scale > 0 else 1.0)
        worst = max(worst, (err, name))
    out["bf16"] = {
        "kept": kept,
        "plan": {
            "fp32_units": plan.fp32_units,
            "low_precision_units": plan.low_precision_units,
            "fp32_parameters": plan.fp32_parameters,
            "extra_fp32_parameters": plan.extra_fp32_parameters,
            "blocks": plan.blocks,
        },
        "seen": rec.params,
        "buffers_seen": rec.buffers,
        "all_params": [name for name, _ in reference.named_parameters()],
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "all_bf16_loss": bf16_loss.item(),
        "grad_rel_err": worst,
        "grad_dtypes": sorted(grad_dtypes),
    }


def worker(rank: int, world: int, port: int, tmpdir: str, ref_path: str, accelerate_env: dict) -> None:
    """One rank: init gloo, the fp32 run (sharding, losses, gradients, checkpoint/resume, local_tensor), the bf16
    run and the accelerate recipe; findings to ``tmpdir/result_<rank>.pt``."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if os.environ.get("TRITON_INTERPRET") != "1" and "fla" not in sys.modules:
        sys.modules["fla"] = None  # as tests/conftest.py does for the main pytest process (this child skips it)
    torch.set_num_threads(1)
    out: dict = {}
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=180)
        )
        mesh = init_device_mesh("cpu", (world,))
        ref = torch.load(ref_path)
        out["seconds"] = {"start": time.monotonic()}
        _fp32_run(rank, world, mesh, tmpdir, ref, out)
        out["seconds"]["fp32"] = time.monotonic()
        _bf16_run(rank, world, mesh, out)
        out["seconds"]["bf16"] = time.monotonic()
        _accelerate_run(rank, world, accelerate_env, out)
        out["seconds"]["accelerate"] = time.monotonic()
        dist.barrier()
    except BaseException:
        out["error"] = traceback.format_exc()
        torch.save(out, os.path.join(tmpdir, f"result_{rank}.pt"))
        raise
    torch.save(out, os.path.join(tmpdir, f"result_{rank}.pt"))
    dist.destroy_process_group()
