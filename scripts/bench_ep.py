"""Expert-parallel sizes and a CPU/gloo timing (``glm53flash_hf.train.expert_parallel``).

1. For the release sizes (``Glm53FlashConfig()``'s text config: hidden 4096, 288 routed experts of intermediate
   2048, top-8, 42 MoE layers; ``configuration/`` holds only the tiny config and the accelerate files) at
   ``--tokens`` tokens per rank (default 8192), computed from shapes, for EP 1 / 8 / 32:

   * dispatch bytes per rank per MoE layer: the bf16 rows ``T * k * H * 2`` of which ``(ep - 1) / ep`` leave the rank
     under uniform routing; the combine sends as many back, and the backward repeats both (the reverse all-to-alls);
     the count exchange (``E`` int64) is negligible. Load imbalance moves the *receive* side up to all ``T * k * ep``
     rows on one rank.
   * expert-weight memory per rank: ``E / ep`` experts of ``3 * H * I`` parameters per MoE layer, in bf16 and as
     fp32 training state (fp32 master + gradient + two AdamW moments, 16 bytes a parameter), before any FSDP sharding
     over ``dp`` (which divides it by ``dp`` again).

2. On CPU with gloo it times one MoE block of the tiny config (``configuration/tiny.json``), forward + backward,
   at EP 1 / 2 / 4 (1, 2, 4 processes, ``--cpu-tokens`` tokens per rank), median of ``--repeats``.

Usage: ``python scripts/bench_ep.py [--tokens 8192] [--no-cpu]``. Runs in about 30 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def release_sizes() -> dict:
    from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig

    c = Glm53FlashConfig().get_text_config(decoder=True)
    moe_layers = list(c.mlp_layer_types).count("sparse") + c.num_nextn_predict_layers
    return dict(H=c.hidden_size, I=c.moe_intermediate_size, E=c.n_routed_experts, k=c.num_experts_per_tok,
                moe_layers=moe_layers)


def ep_table(sizes: dict, tokens: int, eps=(1, 8, 32)) -> list[dict]:
    """Per-rank dispatch bytes per MoE layer and expert-weight memory, from shapes (see the module docstring).

    Raises:
        ValueError: an ep size that does not divide the expert count.
    """
    H, inter, E, k, L = sizes["H"], sizes["I"], sizes["E"], sizes["k"], sizes["moe_layers"]
    rows = []
    for ep in eps:
        if E % ep:
            raise ValueError(f"ep={ep} must divide n_routed_experts={E}")
        sent = tokens * k * H * 2 * (ep - 1) / ep
        params = E // ep * 3 * H * inter
        rows.append(dict(ep=ep, experts_per_rank=E // ep, dispatch_bytes=sent, combine_bytes=sent,
                         fwd_bwd_bytes=4 * sent, expert_params_per_layer=params,
                         bf16_weights_bytes=params * 2 * L, fp32_train_state_bytes=params * 16 * L))
    return rows


def _gib(x: float) -> str:
    return f"{x / 2**30:8.2f} GiB"


def _mib(x: float) -> str:
    return f"{x / 2**20:8.1f} MiB"


def _cpu_worker(rank: int, world: int, port: int, tokens: int, repeats: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.modules.setdefault("fla", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig
    from glm53flash_hf.modeling_glm53flash import Glm53FlashMoE, init_moe_weights
    from glm53flash_hf.train.expert_parallel import apply_expert_parallel

    with open(os.path.join(ROOT, "configuration", "tiny.json")) as f:
        config = Glm53FlashConfig(**json.load(f)).get_text_config(decoder=True)
    config._experts_implementation = "eager"  # the module standalone: our grouped path, no dispatch warning
    torch.manual_seed(0)
    block = Glm53FlashMoE(config)
    for m in block.modules():
        init_moe_weights(m, config)
    block.shared_experts.apply(lambda m: torch.nn.init.normal_(m.weight, std=0.02) if hasattr(m, "weight") else None)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep"))
    if world > 1:
        apply_expert_parallel(block, mesh)
    x = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t = time.perf_counter()
        block(x).square().mean().backward()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def cpu_timing(tokens: int, repeats: int, eps=(1, 2, 4)) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    out = {}
    for ep in eps:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t.json")
            mp.start_processes(_cpu_worker, args=(ep, port, tokens, repeats, path), nprocs=ep, start_method="spawn")
            with open(path) as f:
                out[ep] = statistics.median(json.load(f))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank (default: %(default)s)")
    parser.add_argument("--cpu-tokens", type=int, default=256, help="tokens per rank of the CPU timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU/gloo timing")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.cpu_tokens < 1 or args.repeats < 1:
        parser.error(f"--tokens, --cpu-tokens, --repeats must be >= 1; got {args.tokens}, {args.cpu_tokens}, "
                     f"{args.repeats}")
    sizes = release_sizes()
    print(f"release sizes: {sizes}; {args.tokens} tokens per rank, bf16 activations and weights")
    print(f"{'EP':>3} {'experts/rank':>12} {'dispatch/layer':>15} {'fwd+bwd a2a/layer':>18} "
          f"{'expert weights bf16':>20} {'fp32 train state':>17}")
    for r in ep_table(sizes, args.tokens):
        print(f"{r['ep']:>3} {r['experts_per_rank']:>12} {_mib(r['dispatch_bytes']):>15} "
              f"{_mib(r['fwd_bwd_bytes']):>18} {_gib(r['bf16_weights_bytes']):>20} "
              f"{_gib(r['fp32_train_state_bytes']):>17}")
    if not args.no_cpu:
        print(f"CPU/gloo, tiny config, one MoE block fwd+bwd, {args.cpu_tokens} tokens per rank "
              f"(median of {args.repeats}):")
        for ep, seconds in cpu_timing(args.cpu_tokens, args.repeats).items():
            print(f"  EP={ep}: {seconds * 1e3:8.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
