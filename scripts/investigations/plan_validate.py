"""Predicted (``glm53flash-plan``) against measured peak memory per rank, CPU / gloo, tiny and wide configs.

Each setup runs one training step on ``P`` spawned processes (gloo): the model in fp32 (``kernels="torch"``),
sharded as the setup says (FSDP2 over all ranks with :func:`glm53flash_hf.train.distributed.apply_fsdp2`, EP with
:func:`glm53flash_hf.train.expert_parallel.apply_expert_parallel` + ``apply_fsdp2_ep``, SP with
``apply_sequence_parallel``), full fine-tune or PEFT LoRA (:func:`glm53flash_hf.train.trainer.default_lora_config`),
AdamW. A first step creates the optimizer states; the gradients are then dropped (``set_to_none``) and the measured
step (forward, backward, ``optimizer.step``) runs under the live-tensor counter of ``scripts/bench_sp.py``
(``_LiveTensors``: every CPU storage an aten op returns, counted until freed). Measured peak per rank = the bytes of
the storages alive before the step (parameters as sharded, buffers, optimizer states) + the counter's high-water;
the table shows the largest over the ranks. Predicted = :func:`glm53flash_hf.tools.plan.plan_memory` for the same
setup (``compute_dtype`` / ``base`` fp32, as measured).

Usage::

    python scripts/investigations/plan_validate.py              # every setup (a few minutes on 2 cores)
    python scripts/investigations/plan_validate.py --only tiny-1-full
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # _common, bench_sp: the benchmarks' helpers

MIB = 1024 * 1024

#: name -> (config, processes, fsdp, ep, sp, tokens per row, rows, lora rank (0 = full), checkpointing)
SETUPS = {
    "tiny-1-full": ("tiny", 1, 1, 1, 1, 512, 2, 0, True),
    "tiny-1-lora": ("tiny", 1, 1, 1, 1, 512, 2, 8, True),
    "wide-1-full-nockpt": ("wide", 1, 1, 1, 1, 512, 1, 0, False),
    "tiny-fsdp2-full": ("tiny", 2, 2, 1, 1, 512, 2, 0, True),
    "wide-fsdp2-full": ("wide", 2, 2, 1, 1, 1024, 2, 0, True),
    "wide-ep2-dp2-lora": ("wide", 4, 4, 2, 1, 1024, 2, 8, True),
    "wide-sp2-full": ("wide", 2, 2, 1, 2, 2048, 1, 0, True),
}


def model_config(name: str):
    """The text config of ``"tiny"`` (``glm53flash_hf/tools/tiny_config.json``) or ``"wide"`` (``scripts/_common.py``
    ``WIDE_TEXT``), ``kernels="torch"``."""
    from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig, Glm53FlashTextConfig
    from glm53flash_hf.tools.make_tiny import DEFAULT_CONFIG

    if name == "tiny":
        config = Glm53FlashConfig.from_json_file(DEFAULT_CONFIG).text_config
        config.kernels = {f: "torch" for f in config.kernels}
        return config
    if name == "wide":
        from _common import WIDE_TEXT

        return Glm53FlashTextConfig(**WIDE_TEXT, kernels="torch")
    raise ValueError(f"config must be 'tiny' or 'wide'; got {name!r}")


def _storages(tensors) -> dict:
    """``{data_ptr: nbytes}`` of the storages of ``tensors`` (DTensors: their local shard)."""
    out = {}
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr():
            out[s.data_ptr()] = s.nbytes()
    return out


def _batch(config, rows: int, seq: int, rank: int, world: int, sp: int):
    import torch

    from glm53flash_hf.train.sequence_parallel import shard_sequence

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, min(config.vocab_size, 1900), (rows * (world // sp), seq), generator=g)
    docs = [seq // 8, seq // 2, seq // 4, seq - seq // 8 - seq // 2 - seq // 4]
    pos = torch.cat([torch.arange(d) for d in docs]).unsqueeze(0).expand(ids.shape[0], -1).contiguous()
    dp_rank = rank // sp
    batch = {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}
    batch = {k: v[dp_rank * rows : (dp_rank + 1) * rows] for k, v in batch.items()}
    return shard_sequence(batch, rank % sp, sp) if sp > 1 else batch


def _worker(rank: int, name: str, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    sys.modules.setdefault("fla", None)
    torch.set_num_threads(1)
    from bench_sp import _LiveTensors

    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    cfg_name, world, fsdp, ep, sp, seq, rows, rank_r, ckpt = SETUPS[name]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = model_config(cfg_name)
    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(config).float().train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plan = None
    if ep > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from glm53flash_hf.train import expert_parallel

        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
        plan = expert_parallel.apply_expert_parallel(model, mesh)
    if rank_r:
        import peft

        from glm53flash_hf.train.trainer import default_lora_config

        model = peft.get_peft_model(model, default_lora_config(r=rank_r))
        if ckpt:
            model.enable_input_require_grads()
    if sp > 1:
        from glm53flash_hf.train.sequence_parallel import apply_sequence_parallel

        apply_sequence_parallel(model, dist.group.WORLD)
    if fsdp > 1:
        if plan is not None:
            from glm53flash_hf.train.expert_parallel import apply_fsdp2_ep

            apply_fsdp2_ep(model, plan)
        else:
            from glm53flash_hf.train.distributed import apply_fsdp2

            apply_fsdp2(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    batch = _batch(config, rows, seq, rank, world, sp)
    items = rows * (world // sp) * (seq - 1)

    def step():
        loss = model(**batch, num_items_in_batch=items).loss
        (loss * (world // sp if sp > 1 else world)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates the optimizer states (and one-off caches)
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    alive = _storages(list(model.parameters()) + list(model.buffers()) + states)
    static = sum(alive.values())
    tracker = _LiveTensors()
    # storages alive before the step are counted in ``static``: the counter must not count them again when an op
    # returns a view of them (``weight.t()``)
    tracker.live.update(dict.fromkeys(alive, 0))
    start = time.perf_counter()
    with tracker.mode:
        step()
    seconds = time.perf_counter() - start
    with open(os.path.join(out_dir, f"{name}_{rank}.txt"), "w") as f:
        f.write(f"{static} {tracker.peak} {seconds}\n")
    if world > 1:
        dist.destroy_process_group()


def measure(name: str) -> dict:
    """Run setup ``name`` (a key of :data:`SETUPS`); returns ``{"peak": bytes (max over ranks), "static": bytes,
    "seconds": s}``."""
    import socket

    import torch.multiprocessing as mp

    world = SETUPS[name][1]
    out_dir = tempfile.mkdtemp(prefix="plan_validate_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if world == 1:  # in this process: its torch thread count is restored after the run
        import torch

        threads = torch.get_num_threads()
        try:
            _worker(0, name, port, out_dir)
        finally:
            torch.set_num_threads(threads)
    else:
        mp.start_processes(_worker, args=(name, port, out_dir), nprocs=world, start_method="spawn")
    rows = []
    for rank in range(world):
        with open(os.path.join(out_dir, f"{name}_{rank}.txt")) as f:
            static, peak, seconds = f.read().split()
            rows.append((int(static), int(peak), float(seconds)))
    best = max(rows, key=lambda r: r[0] + r[1])
    return {"peak": best[0] + best[1], "static": best[0], "seconds": max(r[2] for r in rows)}


def predict(name: str):
    """The planner's :class:`glm53flash_hf.tools.plan.MemoryPlan` for setup ``name`` (fp32, as measured)."""
    from glm53flash_hf.tools.plan import Setup, plan_memory

    cfg_name, world, fsdp, ep, sp, seq, rows, rank_r, ckpt = SETUPS[name]
    setup = Setup(gpus=world, gpu_memory_gib=1024.0, fsdp=fsdp, ep=ep, sp=sp, seq_len=seq, micro_batch=rows,
                  lora_rank=rank_r, base="fp32", compute_dtype="fp32", checkpointing=ckpt)
    return plan_memory(model_config(cfg_name), setup)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(SETUPS), help="run only these setups")
    args = parser.parse_args(argv)
    names = args.only or list(SETUPS)
    print(f"{'setup':22s} {'procs':>5s} {'tokens/rank':>11s} {'predicted MiB':>13s} {'measured MiB':>12s} "
          f"{'ratio':>6s} {'step s':>6s}")
    worst = 0.0
    for name in names:
        plan = predict(name)
        got = measure(name)
        ratio = plan.total / got["peak"]
        worst = max(worst, abs(ratio - 1))
        _, world, _, _, sp, seq, rows, _, _ = SETUPS[name]
        print(f"{name:22s} {world:5d} {rows * seq // sp:11d} {plan.total / MIB:13.2f} {got['peak'] / MIB:12.2f} "
              f"{ratio:6.3f} {got['seconds']:6.1f}", flush=True)
    print(f"largest |predicted / measured - 1|: {worst:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
