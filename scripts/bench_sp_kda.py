"""One KDA layer, forward + backward: our sequence parallelism over N devices against one device.

The comparison point: one ``Glm53FlashLinearAttention`` layer with hidden 4096 and 64 x 128 KDA heads (the
release text config's), one document of ``--tokens`` (128k) tokens, batch 1, bf16 on CUDA. Timed: forward +
``backward`` of ``out.float().square().mean()`` (gradients of the input and of every parameter), median over
``--iters`` after ``--warmup`` untimed steps, CUDA-synchronised; under SP the slowest rank's time (the ranks wait for
each other in the state passing anyway).

* ``python scripts/bench_sp_kda.py``: the one-device time on ``cuda:0``; then, when ``torch.cuda.device_count() >=
  2``, ``torchrun --nproc_per_node N`` of this script (``N = --sp``, default: every visible GPU) for the SP time,
  each rank holding a contiguous ``tokens / N`` shard (``train.sequence_parallel.build_shard_layout`` + the SP path,
  NCCL; fla's context-parallel ``chunk_kda`` where it applies, the report names the KDA path that ran). With one
  GPU it says that SP needs at least 2 and reports the one-device time only.
* ``--smoke``: tiny shapes (hidden 64, 2 x 16 heads, 256 tokens, fp32) on the CPU torch kernels, and SP = 2 over
  gloo (two local processes through torchrun), so the pipeline runs without a GPU; the times mean nothing.
* ``--report PATH`` / ``--json PATH``: a markdown table / the numbers.

Memory: one device holds the whole row's activations for the backward (``tokens x (hidden + 3 H K + ...)``); a rank
holds ``1 / N`` of them plus the KDA boundary exchange (``N`` pairs ``(A, B)`` ``[H, K, K]`` fp32, 8 MiB each at
64 x 128).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RELEASE = dict(hidden=4096, heads=64, head_dim=128, tokens=131072)
SMOKE = dict(hidden=64, heads=2, head_dim=16, tokens=256)


def _layer(args, device, dtype):
    import torch

    from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
    from glm53flash_hf.kda import Glm53FlashLinearAttention

    config = Glm53FlashTextConfig(
        hidden_size=args.hidden, linear_num_heads=args.heads, linear_head_dim=args.head_dim,
        kernels="torch" if args.smoke else "auto",
    )
    torch.manual_seed(0)
    return Glm53FlashLinearAttention(config, layer_idx=0).to(device=device, dtype=dtype).train()


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step, device, warmup: int, iters: int, barrier=None) -> list[float]:
    times = []
    for i in range(warmup + iters):
        if barrier is not None:
            barrier()
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def _inputs(args, device, dtype, start: int, length: int):
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=g)[:, start : start + length]
    return x.to(device=device, dtype=dtype).requires_grad_(True)


def one_device(args) -> dict:
    import torch

    from glm53flash_hf.packing import build_layout

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda:0")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    layer = _layer(args, device, dtype)
    x = _inputs(args, device, dtype, 0, args.tokens)
    layout = build_layout(1, args.tokens, device, position_ids=torch.arange(args.tokens, device=device)[None])

    def step():
        layer(x, layout)[0].float().square().mean().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = _time_steps(step, device, args.warmup, args.iters)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"mode": "one device", "devices": 1, "device": str(device), "ms": statistics.median(times),
            "ms_all": times, "peak_gib": peak}


def sp_worker(args) -> None:
    """One torchrun rank: its contiguous shard of the row through the layer's sequence-parallel path."""
    import torch
    import torch.distributed as dist

    from glm53flash_hf import packing
    from glm53flash_hf.train.sequence_parallel import build_shard_layout

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.bfloat16 if cuda else torch.float32
    local = args.tokens // world
    layer = _layer(args, device, dtype)
    x = _inputs(args, device, dtype, rank * local, local)
    pos = torch.arange(rank * local, (rank + 1) * local, device=device)[None]
    layout = build_shard_layout(packing, dist.group.WORLD, 1, local, device, position_ids=pos)

    def step():
        layer(x, layout)[0].float().square().mean().backward()
        x.grad = None
        layer.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = torch.tensor(_time_steps(step, device, args.warmup, args.iters, barrier=dist.barrier), device=device)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0], device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per step, the slowest rank
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        ms = times.tolist()
        from glm53flash_hf.dispatch import choose_backend, requested_backend
        from glm53flash_hf.train.sequence_parallel import fla_cp_refusal

        fused = choose_backend("kda", requested_backend(layer.config, "kda"), x,
                               layer.o_norm.weight.view(1, 1, 1, -1)) == "fused"
        refusal = fla_cp_refusal(layout.shard, device) if fused else "torch kernels"
        path = "fla chunk_kda(cp_context)" if refusal is None else f"package state passing ({refusal})"
        with open(args.worker_out, "w") as f:
            json.dump({"mode": f"SP={world}", "devices": world, "device": str(device), "ms": statistics.median(ms),
                       "ms_all": ms, "peak_gib": float(peak) if cuda else None, "kda_sp_path": path}, f)
    dist.destroy_process_group()


def launch_sp(args, world: int) -> dict:
    out = os.path.join(args.tmp, f"sp_kda_{world}.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    base = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd = base + ["--nproc_per_node", str(world), "--master_addr", "127.0.0.1", "--master_port", str(port),
                  os.path.abspath(__file__), "--worker-out", out] + args.forward
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, timeout=args.sp_timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        return {"mode": f"SP={world}", "devices": world, "error": f"torchrun exit {proc.returncode}"}
    with open(out) as f:
        return json.load(f)


def write(args, rows: list[dict], notes: list[str]) -> None:
    shape = f"hidden {args.hidden}, KDA {args.heads} x {args.head_dim}, {args.tokens} tokens, batch 1"
    lines = [f"# KDA layer fwd+bwd, one device vs sequence parallel ({shape})", "",
             "| mode | devices | device | median ms | peak GiB per device |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['devices']} | | failed: {r['error']} | |")
            continue
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "n/a"
        lines.append(f"| {r['mode']} | {r['devices']} | {r['device']} | {r['ms']:.2f} | {peak} |")
    lines += [""] + [f"- {n}" for n in notes]
    lines += [f"- {r['mode']} KDA path: {r['kda_sp_path']}" for r in rows if r.get("kda_sp_path")]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": shape, "rows": rows, "notes": notes}, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, SP=2 over gloo")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--sp", type=int, default=0, help="SP ranks (default: every visible GPU; 2 with --smoke)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--sp-timeout", type=float, default=300, help="seconds for the torchrun part")
    parser.add_argument("--report", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else RELEASE).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # the workers get the shape and timing flags, not the output paths or the SP size
    fwd, skip = [], False
    for a in argv if argv is not None else sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a in ("--report", "--json", "--sp", "--sp-timeout"):
            skip = True
            continue
        if a.startswith(("--report=", "--json=", "--sp=", "--sp-timeout=")):
            continue
        fwd.append(a)
    args.forward = fwd
    if args.smoke:
        sys.modules.setdefault("fla", None)  # the CPU torch kernels only (as tests/conftest.py)
    if args.worker_out:
        sp_worker(args)
        return 0
    import tempfile

    import torch

    args.tmp = tempfile.mkdtemp(prefix="bench_sp_kda_")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not args.smoke:
        print("bench_sp_kda: no CUDA device; the release shape is for GPUs (use --smoke for the CPU dry run)")
        return 2
    notes = [f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}; "
             f"{gpus} visible GPU(s)"]
    rows = [one_device(args)]
    world = args.sp or (2 if args.smoke else gpus)
    if args.smoke or world >= 2 and gpus >= world:
        if args.tokens % world:
            notes.append(f"SP={world} not run: {args.tokens} tokens do not divide by {world}")
        else:
            rows.append(launch_sp(args, world))
    else:
        notes.append(f"SP not measured: sequence parallelism needs >= 2 GPUs, {gpus} visible "
                     f"(asked for SP={world or 'all'}); the one-device time only")
    notes.append("target: <= 44.35 ms per layer fwd+bwd at SP8, 128k tokens (xtuner's FLA sequence parallelism, "
                 "8 x H200)")
    write(args, rows, notes)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
