"""Workers and the single-process reference for tests/test_sequence_parallel.py (gloo, CPU).

The tiny model (``configuration/tiny.json`` via ``ckpt_fixtures.tiny_config``, fp32, MTP on with weight 0.1) is
trained on :func:`global_batch`: two packed rows of ``SEQ = 96`` tokens, position_ids restarting per document.

* row 0 ``10, 14, 1, 5, 50, 16``: at SP=4 (shards of 24) a boundary exactly at the shard boundary 24, a 1-token
  document right after it, boundaries inside shards, and the 50-token document 30..80 spans shards 1, 2 and 3;
* row 1 ``20, 26, 2, 1, 21, 26``: a document ends exactly at 48 (the SP=2 and SP=4 boundary) and a 1-token document
  starts there; the document 70..96 crosses 72 with only 2 of its tokens in the previous shard (the conv history is
  partly another document's).

:func:`reference_run` runs one process on the whole batch; :func:`worker` runs one rank of an SP group (``mode``
``"sp"``) or of a ``(dp_shard, sp)`` device mesh with FSDP2 on the flattened mesh (``mode`` ``"fsdp_sp"``). Each
rank passes its contiguous shard (:func:`glm53flash_hf.train.sequence_parallel.shard_sequence`) and the global
``num_items_in_batch``; the rank gradients are summed (SP) / reduce-scattered by FSDP with the loss multiplied by the
world size, which equals the single-process gradient.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

SEQ = 96
LR = 0.1


def make_optimizer(params):
    """SGD with momentum: the update is linear in the gradients, so "equal parameters" is checked at the gradients'
    precision. (AdamW divides every element by its own RMS: gradient elements 1e-4 of their tensor's largest, e.g.
    ``attn_hc.base``, get full-size updates from a few fp32 ulps of summation-order noise, so parameters would differ
    far more than the gradients do.)"""
    return torch.optim.SGD(params, lr=LR, momentum=0.9)
DOCS = [(10, 14, 1, 5, 50, 16), (20, 26, 2, 1, 21, 26)]


def make_model(seed: int = 0):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ckpt_fixtures import tiny_config

    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    torch.manual_seed(seed)
    return Glm53FlashForCausalLM(tiny_config()).float().train()


def global_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(200 + step)
    rows = len(DOCS)
    ids = torch.randint(0, 1900, (rows, SEQ), generator=g)
    pos = torch.cat([torch.cat([torch.arange(n) for n in docs]).unsqueeze(0) for docs in DOCS])
    labels = ids.clone()
    labels[pos == 0] = -100
    labels[:, 3:5][torch.rand(rows, 2, generator=g) < 0.5] = -100
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def ids_batch(step: int) -> dict:
    """:func:`global_batch` with ``labels = input_ids`` (the README's packed example): no -100 at the document
    starts, so a document's first token is a label of the previous document's last position in the main loss (as
    transformers' row-wise shift gives it on one device) but never an MTP target of the previous document."""
    batch = global_batch(step)
    return {**batch, "labels": batch["input_ids"].clone()}


def num_items(batch: dict) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_run(path: str, steps: int = 2) -> None:
    """One process, whole batch: loss and gradients of step 1, parameter changes after ``steps`` optimizer steps."""
    torch.set_num_threads(1)
    model = make_model(0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():  # the loss without num_items_in_batch: main and every MTP depth each a mean
        loss_nocount = model(**global_batch(1)).loss.item()
        ids_nocount = model(**ids_batch(1)).loss.item()
    batch = ids_batch(1)
    loss = model(**batch, num_items_in_batch=num_items(batch)).loss
    loss.backward()
    ids_loss, ids_grads = loss.item(), _grads(model)
    model.zero_grad(set_to_none=True)
    opt = make_optimizer(model.parameters())
    losses, grads = [], None
    for step in range(1, steps + 1):
        batch = global_batch(step)
        loss = model(**batch, num_items_in_batch=num_items(batch)).loss
        loss.backward()
        if step == 1:
            grads = _grads(model)
        else:
            grads2 = _grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    updates = {n: p - start[n] for n, p in params.items()}
    torch.save({"losses": losses, "grads": grads, "grads2": grads2, "params": params, "updates": updates,
                "loss_nocount": loss_nocount, "ids_nocount": ids_nocount, "ids_loss": ids_loss, "ids_grads": ids_grads},
               path)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` (the FSDP2 test's measure)."""
    scale = b.abs().max().item()
    err = (a - b).abs().max().item()
    return err / scale if scale > 0 else err


def _worst(mine: dict, ref: dict) -> tuple[float, str]:
    worst = (0.0, "")
    for name, g in mine.items():
        worst = max(worst, (_rel(g, ref[name]), name))
    return worst


def _sp_step(model, opt, step, rank, world, group, out_grads=None, make_batch=global_batch):
    import torch.distributed as dist

    from glm53flash_hf.train.sequence_parallel import shard_sequence

    batch = make_batch(step)
    loss = model(**shard_sequence(batch, rank, world), num_items_in_batch=num_items(batch)).loss
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    if out_grads is not None:
        out_grads.update(_grads(model))
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item()


def _sp_run(rank, world, ref, out, tmpdir):
    import torch.distributed as dist

    from glm53flash_hf.train.sequence_parallel import apply_sequence_parallel, shard_sequence

    group = dist.group.WORLD
    model = make_model(0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    apply_sequence_parallel(model, group)
    with torch.no_grad():  # without num_items_in_batch: the ranks' losses sum to the one-process mean
        nocount = model(**shard_sequence(global_batch(1), rank, world)).loss.detach().clone()
        ids_nocount = model(**shard_sequence(ids_batch(1), rank, world)).loss.detach().clone()
        ignored = {**global_batch(1), "labels": torch.full((len(DOCS), SEQ), -100)}
        out["ignored_loss"] = model(**shard_sequence(ignored, rank, world)).loss.item()  # this rank's share
    dist.all_reduce(nocount, group=group)
    dist.all_reduce(ids_nocount, group=group)
    out["loss_nocount"] = nocount.item()
    # labels = input_ids: loss and gradients of one step (no update), against the one-process run
    ids_grads: dict = {}
    out["ids_loss"] = _sp_step(model, None, 1, rank, world, group, ids_grads, make_batch=ids_batch)
    out["ids_nocount"] = ids_nocount.item()
    out["ids_grad_rel_err"] = _worst(ids_grads, ref["ids_grads"])
    out["ids_grad_names_match"] = sorted(ids_grads) == sorted(ref["ids_grads"])
    model.zero_grad(set_to_none=True)
    opt = make_optimizer(model.parameters())
    grads: dict = {}
    grads2: dict = {}
    losses = [_sp_step(model, opt, 1, rank, world, group, grads), _sp_step(model, opt, 2, rank, world, group, grads2)]
    out["grad2_rel_err"] = _worst(grads2, ref["grads2"])
    out["losses"] = losses
    out["grad_names_match"] = sorted(grads) == sorted(ref["grads"])
    out["grad_rel_err"] = _worst(grads, ref["grads"])
    # parameters after two steps, as their change from the common start (the start itself is bit-equal)
    # parameters after two steps (measured at their own scale), and, for information, their change from the common
    # start at the change's scale: that one is floored by the parameters' fp32 ulp (an MTP expert moving by 8e-6
    # while its entries are 0.02: the difference of two 0.02-sized floats resolves 2e-9, 2.5e-4 of the change)
    out["param_rel_err"] = _worst({n: p.detach() for n, p in model.named_parameters()}, ref["params"])
    out["update_rel_err"] = _worst({n: p.detach() - start[n] for n, p in model.named_parameters()}, ref["updates"])

    # uneven shards are refused on every rank with the lengths named
    batch = global_batch(1)
    cut = 48 if rank == 0 else 40
    try:
        model(**{k: v[:, :cut] for k, v in batch.items()}, num_items_in_batch=10)
        out["uneven_error"] = None
    except ValueError as exc:
        out["uneven_error"] = str(exc)
    # the Trainer's data path: rank micro-batches of different lengths made equal (pad to a multiple of world)
    from glm53flash_hf.train.trainer import sp_micro_batches

    mine = {"input_ids": torch.full((1, 5 + 2 * rank), rank), "labels": torch.full((1, 5 + 2 * rank), rank),
            "position_ids": torch.arange(5 + 2 * rank).unsqueeze(0), "cu_seq_lens_q": torch.tensor([0, 5 + 2 * rank])}
    micro = sp_micro_batches(mine, group, pad_token_id=99, min_shard=1)
    out["micro"] = [{k: v.tolist() for k, v in m.items()} for m in micro]

    # negative control: the KDA recurrence without state passing (each shard's first segment from a zero state)
    from glm53flash_hf.train import sequence_parallel as sp_mod

    original = sp_mod.sp_chunk_kda
    try:
        sp_mod.sp_chunk_kda = lambda sp, core, q, k, v, g, beta, cu_seqlens, fla_cp=None: core(
            q, k, v, g, beta, cu_seqlens=cu_seqlens
        )[0]
        broken = make_model(0)
        apply_sequence_parallel(broken, group)
        bad: dict = {}
        bad_loss = _sp_step(broken, None, 1, rank, world, group, bad)
    finally:
        sp_mod.sp_chunk_kda = original
    out["control_loss"] = bad_loss
    out["control_grad_rel_err"] = _worst(bad, ref["grads"])
    if world == 2:
        out.update(_remote_code_run(rank, world, group, ref, os.path.join(tmpdir, "remote")))


def _remote_code_run(rank, world, group, ref, path) -> dict:
    """Step 1 of a model saved by rank 0 and loaded through ``AutoModelForCausalLM`` with remote code (one rank
    after the other: the remote-code module cache is shared), parallelised by ``apply_sequence_parallel``."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from glm53flash_hf.train.sequence_parallel import apply_sequence_parallel

    if rank == 0:
        make_model(0).save_pretrained(path)
    model = None
    for turn in range(world):
        dist.barrier()
        if turn == rank:
            model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).float().train()
    apply_sequence_parallel(model, group)
    grads: dict = {}
    loss = _sp_step(model, None, 1, rank, world, group, grads)
    return {"remote_module": type(model).__module__, "remote_loss": loss,
            "remote_grad_rel_err": _worst(grads, ref["grads"]),
            "remote_grad_names_match": sorted(grads) == sorted(ref["grads"])}


def _fsdp_sp_run(rank, world, dp, sp, ref, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from glm53flash_hf.train.distributed import apply_fsdp2
    from glm53flash_hf.train.sequence_parallel import apply_sequence_parallel, shard_sequence

    mesh = init_device_mesh("cpu", (dp, sp), mesh_dim_names=("dp_shard", "sp"))
    model = make_model(0)
    apply_fsdp2(model, mesh=mesh[("dp_shard", "sp")]._flatten("dp_shard_sp"))
    apply_sequence_parallel(model, mesh["sp"].get_group())
    dp_rank, sp_rank = mesh.get_local_rank("dp_shard"), mesh.get_local_rank("sp")
    batch = global_batch(1)
    rows = batch["input_ids"].shape[0] // dp
    mine = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
    loss = model(**shard_sequence(mine, sp_rank, sp), num_items_in_batch=num_items(batch)).loss
    (loss * world).backward()  # FSDP averages the gradients over the dp_shard x sp ranks: this makes it a sum
    from torch.distributed.tensor import DTensor

    worst = (0.0, "")
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (_rel(g, ref["grads"][name]), name))
    out["grad_rel_err"] = worst
    total = loss.detach().clone()
    dist.all_reduce(total)
    out["losses"] = [total.item()]


def worker(rank: int, world: int, port: int, tmpdir: str, ref_path: str, mode: str, dp: int = 1) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    if os.environ.get("TRITON_INTERPRET") != "1" and "fla" not in sys.modules:
        sys.modules["fla"] = None  # as tests/conftest.py does for the main pytest process
    torch.set_num_threads(1)
    out: dict = {}
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=240)
        )
        ref = torch.load(ref_path)
        if mode == "sp":
            _sp_run(rank, world, ref, out, tmpdir)
        else:
            _fsdp_sp_run(rank, world, dp, world // dp, ref, out)
        dist.barrier()
    except BaseException:
        out["error"] = traceback.format_exc()
        torch.save(out, os.path.join(tmpdir, f"result_{mode}{world}_{rank}.pt"))
        raise
    torch.save(out, os.path.join(tmpdir, f"result_{mode}{world}_{rank}.pt"))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- HF Trainer


def trainer_rows() -> list[dict]:
    """The Trainer's dataset: the rows of :func:`global_batch` ``(1)`` then ``(2)``, one dict of ``[SEQ]`` tensors
    per row (``input_ids``, ``labels``, ``position_ids``)."""
    rows = []
    for step in (1, 2):
        batch = global_batch(step)
        rows += [{k: v[i] for k, v in batch.items()} for i in range(batch["input_ids"].shape[0])]
    return rows


def trainer_worker(rank: int, world: int, port: int, tmpdir: str, sp: int) -> None:
    """One process of a :class:`~glm53flash_hf.train.trainer.Glm53FlashTrainer` run: two optimizer steps (plain
    SGD, lr ``LR``, constant schedule, no clipping) over :func:`trainer_rows` in order (``train_sampling_strategy=
    "sequential"``), ``2 / world`` rows per process and step, so both runs see the same two rows per step. ``world``
    1: one process, ``sequence_parallel_size`` 1; ``world`` > 1: ``torch.distributed`` environment variables for
    the Trainer's own gloo process group, ``sequence_parallel_size=sp``. Writes the logged losses and the final
    parameters to ``trainer_{world}_{rank}.pt``."""
    from transformers import TrainingArguments, default_data_collator

    from glm53flash_hf.train.trainer import Glm53FlashTrainer

    if os.environ.get("TRITON_INTERPRET") != "1" and "fla" not in sys.modules:
        sys.modules["fla"] = None
    torch.set_num_threads(1)
    if world > 1:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    out: dict = {}
    try:
        args = TrainingArguments(
            output_dir=os.path.join(tmpdir, f"trainer{world}"), use_cpu=True, report_to=[], max_steps=2,
            per_device_train_batch_size=2 // world, learning_rate=LR, optim="sgd", lr_scheduler_type="constant",
            weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, remove_unused_columns=False, train_sampling_strategy="sequential", seed=0,
        )
        model = make_model(0)
        trainer = Glm53FlashTrainer(model=model, args=args, train_dataset=trainer_rows(),
                                    data_collator=default_data_collator, pad_token_id=0,
                                    sequence_parallel_size=sp if world > 1 else 1)
        trainer.train()
        out["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["sp_group_size"] = (torch.distributed.get_world_size(trainer.sp_group)
                                if trainer.sp_group is not None else 1)
    except BaseException:
        out["error"] = traceback.format_exc()
        torch.save(out, os.path.join(tmpdir, f"trainer_{world}_{rank}.pt"))
        raise
    torch.save(out, os.path.join(tmpdir, f"trainer_{world}_{rank}.pt"))


# ---------------------------------------------------------------------------------------------- fla's CP KDA
# One KDA layer, fused path (fla's kernels under the Triton interpreter), one packed row of CP_SEQ tokens: at SP=4
# (shards of 32) a document ends exactly at the shard boundary 32, a 1-token document starts there, and the
# 70-token document 40..110 spans shards 1, 2 and 3.
CP_SEQ = 128
CP_DOCS = (10, 22, 1, 7, 70, 18)


def _cp_inputs(rows: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, CP_SEQ, hidden, generator=g)
    dout = torch.randn(rows, CP_SEQ, hidden, generator=g)
    pos = torch.cat([torch.arange(n) for n in CP_DOCS]).expand(rows, -1)
    return x, dout, pos


def _kda_layer(kernel: str = "fused", seed: int = 0):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_kda import random_init_, tiny_config

    from glm53flash_hf.kda import Glm53FlashLinearAttention

    torch.manual_seed(seed)
    layer = Glm53FlashLinearAttention(tiny_config(kernels={"kda": kernel}), layer_idx=0)
    random_init_(layer)
    return layer


def _layer_grads(layer) -> dict:
    return {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}


def kda_cp_worker(rank: int, world: int, port: int, tmpdir: str, rows: int) -> None:
    """One rank of one fused KDA layer under SP (``TRITON_INTERPRET=1`` must be set before this process imports
    triton): ``rows == 1`` takes fla's context-parallel ``chunk_kda``
    (:func:`~glm53flash_hf.train.sequence_parallel.chunk_kda_context_parallel`, counted), ``rows == 2`` this package's
    state passing with fla's chunk kernels (the warning that names why fla's CP is not used is recorded). Rank 0 also
    runs the whole rows in one layer call, fused without SP (the fp32 reference) and on the torch path in float64 (the
    oracle). Writes
    ``kda_cp{world}x{rows}_{rank}.pt``: the errors of the rank's output, input gradient and summed parameter
    gradients against both, the fp32 reference's own error against float64, and the counts."""
    import warnings
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    out: dict = {}
    path = os.path.join(tmpdir, f"kda_cp{world}x{rows}_{rank}.pt")
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from interp import fla_interpreter_patches

        from glm53flash_hf import dispatch, kda_fused, packing
        from glm53flash_hf.packing import build_document_layout
        from glm53flash_hf.train import sequence_parallel
        from glm53flash_hf.train.sequence_parallel import build_shard_layout

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=400)
        )
        with fla_interpreter_patches(cp=True):
            def choose(family, requested, *tensors):  # the dispatcher never picks "fused" on CPU: ask the probe
                if requested == "torch":
                    return "torch"
                ok, reason = kda_fused.fused_kda_available(*tensors)
                assert ok, reason
                return "fused"

            dispatch.choose_backend = choose
            calls = []
            original_cp = sequence_parallel.chunk_kda_context_parallel

            def counted(*args, cp_context, **kwargs):
                calls.append(cp_context.cu_seqlens_cpu.tolist())
                return original_cp(*args, cp_context=cp_context, **kwargs)

            sequence_parallel.chunk_kda_context_parallel = counted
            layer = _kda_layer()
            x, dout, pos = _cp_inputs(rows, layer.hidden_size)
            ref = [None]
            if rank == 0:
                xr = x.clone().requires_grad_()
                o_ref = layer(xr, build_document_layout(rows, CP_SEQ, "cpu", position_ids=pos))[0]
                (o_ref * dout).sum().backward()
                ref = {"o": o_ref.detach(), "dx": xr.grad, "grads": _layer_grads(layer)}
                layer.zero_grad(set_to_none=True)
                # float64 oracle: the torch path, same weights, whole rows
                exact = _kda_layer("torch")
                exact.load_state_dict(layer.state_dict())
                exact.double()
                x64 = x.double().requires_grad_()
                o64 = exact(x64, build_document_layout(rows, CP_SEQ, "cpu", position_ids=pos))[0]
                (o64 * dout.double()).sum().backward()
                ref["o64"], ref["dx64"], ref["grads64"] = o64.detach(), x64.grad, _layer_grads(exact)
                ref = [ref]
            dist.broadcast_object_list(ref, src=0)
            ref = ref[0]
            L = CP_SEQ // world
            sl = slice(rank * L, (rank + 1) * L)
            xl = x[:, sl].clone().requires_grad_()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                layout = build_shard_layout(packing, dist.group.WORLD, rows, L, "cpu",
                                            position_ids=pos[:, sl].contiguous())
                o = layer(xl, layout)[0]
            (o * dout[:, sl]).sum().backward()
            grads = _layer_grads(layer)
            for g in grads.values():
                dist.all_reduce(g)
            out["o_rel_err"] = _rel(o.detach(), ref["o"][:, sl])
            out["dx_rel_err"] = _rel(xl.grad, ref["dx"][:, sl])
            out["grad_rel_err"] = _worst(grads, ref["grads"])
            out["grad_names_match"] = sorted(grads) == sorted(ref["grads"])
            out["grad_rel_err64"] = _worst({n: g.double() for n, g in grads.items()}, ref["grads64"])
            out["ref_grad_rel_err64"] = _worst({n: g.double() for n, g in ref["grads"].items()}, ref["grads64"])
            out["o_rel_err64"] = _rel(o.detach().double(), ref["o64"][:, sl])
            out["dx_rel_err64"] = _rel(xl.grad.double(), ref["dx64"][:, sl])
            out["grad_rel_err_by_name"] = {n: _rel(g, ref["grads"][n]) for n, g in grads.items()}
            out["grad_rel_err64_by_name"] = {n: _rel(g.double(), ref["grads64"][n]) for n, g in grads.items()}
            out["cp_calls"] = calls
            out["warnings"] = [str(w.message) for w in caught if "context-parallel" in str(w.message)]
            out["local_cu"] = layout.cu_seqlens.tolist()
        dist.barrier()
    except BaseException:
        out["error"] = traceback.format_exc()
        torch.save(out, path)
        raise
    torch.save(out, path)
    dist.destroy_process_group()
