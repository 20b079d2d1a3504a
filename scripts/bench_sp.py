"""Sequence parallelism: bytes exchanged per rank and layer (from shapes), and peak memory per rank on CPU / gloo.

1. Bytes (no tensors are built): for the release text config (``Glm53FlashTextConfig()``: hidden 4096, KDA
   64 x 128 heads, conv 4, MLA ``kv_lora_rank`` 512, indexer ``index_head_dim`` 128) at ``--tokens`` (128k) and
   ``--sp`` (8), one row, bf16 activations and fp32 KDA states / indexer state, what each rank receives per layer in
   the forward (the backward returns the gradients of the gathered tensors: the all-gather's reduce-scatter), for what
   :mod:`glm53flash_hf.train.sequence_parallel` does:

   * KDA: all-gather of the conv tails ``[W_conv - 1, 3 H K]`` and of the boundary pair ``(A [H, K, K],
     B [H, K, V])`` fp32;
   * DSA: all-gather of the latent ``[L, kv_lora_rank]`` and of the indexer state ``[L, 2 index_head_dim]`` fp32.

2. Peak memory (``--measure``): ``WIDE_TEXT`` of ``scripts/_common.py`` (hidden 256, 3 KDA + 1 DSA layers, MoE,
   4 mHC streams), fp32, one packed row of ``--seq`` tokens (4 documents), forward + backward with per-layer
   activation checkpointing, SP = 1, 2, 4 processes on gloo. Peak = the process's peak RSS during the step minus
   its RSS before it (Linux ``ru_maxrss``; after a warm-up step on a short row, with the gradients allocated), the
   largest over the ranks. RSS counts what glibc keeps from freed blocks, so this over-states the live peak.
   ``--mmap-threshold N`` sets glibc's ``MALLOC_MMAP_THRESHOLD_`` in every worker's environment (the same for
   every SP size): blocks of ``N`` bytes or more are then ``mmap``-ed and returned to the system when freed (no
   dynamic threshold), so RSS follows the live tensors instead of what the heap kept from earlier phases. ``--live``
   also reports the live-tensor high-water of the measured step (every CPU storage an aten op returns, counted until
   it is freed: a ``TorchDispatchMode``), which does not depend on the allocator.
   The DSA layer's chunk budgets (indexer score buffer, sparse-MLA query chunk: ``1 << 26`` elements, 256 MiB fp32
   each, by default) give a transient of about 1 GiB per rank whatever the sequence length; ``--budget`` (default
   ``1 << 22``) sets them, equally for every SP size, so that the measurement shows the part SP divides.

Usage::

    python scripts/bench_sp.py                         # bytes only
    python scripts/bench_sp.py --measure --seq 32768   # plus peak memory, SP = 1, 2, 4 (minutes on 2 cores)
    python scripts/bench_sp.py --measure --seq 32768 --mmap-threshold 131072   # the same, big blocks mmap-ed
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MIB = 1024 * 1024


def bytes_per_layer(config, tokens: int, world: int, act_bytes: int = 2, state_bytes: int = 4) -> dict:
    """Bytes one rank receives per layer in the forward (one row of ``tokens``; ``world`` ranks)."""
    L = tokens // world
    H, K = config.linear_num_heads, config.linear_head_dim
    conv = (config.linear_conv_kernel_dim - 1) * 3 * H * K * act_bytes
    pair = 2 * H * K * K * state_bytes
    latent = L * config.kv_lora_rank * act_bytes
    index_state = L * 2 * config.index_head_dim * state_bytes
    others = world - 1
    return {
        "kda_conv_tails": others * conv,
        "kda_state_pairs": others * pair,
        "kda_total": others * (conv + pair),
        "dsa_latent": others * latent,
        "dsa_indexer_state": others * index_state,
        "dsa_total": others * (latent + index_state),
        "local_tokens": L,
    }


def print_bytes(tokens: int, world: int) -> None:
    from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig

    config = Glm53FlashTextConfig()
    b = bytes_per_layer(config, tokens, world)
    print(f"release text config (hidden {config.hidden_size}, KDA {config.linear_num_heads}x{config.linear_head_dim}, "
          f"kv_lora_rank {config.kv_lora_rank}, index_head_dim {config.index_head_dim}), {tokens} tokens, SP {world}"
          f" ({b['local_tokens']} tokens per rank); received per rank per layer in the forward")
    print(f"  KDA: conv tails {b['kda_conv_tails'] / MIB:8.2f} MiB + boundary states (A, B) "
          f"{b['kda_state_pairs'] / MIB:8.2f} MiB = {b['kda_total'] / MIB:8.2f} MiB")
    print(f"  DSA: latent {b['dsa_latent'] / MIB:8.2f} MiB + indexer state {b['dsa_indexer_state'] / MIB:8.2f} MiB "
          f"= {b['dsa_total'] / MIB:8.2f} MiB")
    print(f"  backward: the gradients of what was gathered return (reduce-scatter): KDA {b['kda_total'] / MIB:.2f} "
          f"MiB, DSA latent {b['dsa_latent'] / MIB:.2f} MiB (the indexer state has no gradient)")
    ring = b["dsa_total"]
    print(f"  (a ring moves the same {ring / MIB:.2f} MiB for DSA in {world - 1} dependent steps; the KDA pair could "
          f"be a {max(1, (world - 1).bit_length())}-step scan instead of an all-gather)")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _set_budgets(model, elements: int) -> None:
    """The DSA buffers' element budgets, per module: the indexer's score buffer (``max_score_elements``) and the
    sparse-MLA query chunk (``query_chunk`` from ``[chunk, W, kv_lora_rank + heads]``)."""
    for module in model.modules():
        if hasattr(module, "max_score_elements"):
            module.max_score_elements = elements
        if hasattr(module, "query_chunk") and hasattr(module, "kv_lora_rank"):
            width = module.config.index_topk + module.config.index_kpool - 1
            module.query_chunk = max(1, elements // (width * (module.kv_lora_rank + module.num_heads)))


class _LiveTensors:
    """High-water of the bytes of the CPU storages that aten ops return while active (each counted once, until its
    storage is freed); a ``TorchDispatchMode``, so autograd's backward and checkpoint recomputation are included."""

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self
        self.live, self.current, self.peak = {}, 0, 0

        def free(ptr):
            tracker.current -= tracker.live.pop(ptr, 0)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2): its local shard's storage
                    if getattr(t, "device", None) is not None and t.device.type == "cpu":
                        storage = t.untyped_storage()
                        ptr, size = storage.data_ptr(), storage.nbytes()
                        if ptr and size and ptr not in tracker.live:
                            tracker.live[ptr] = size
                            tracker.current += size
                            weakref.finalize(storage, free, ptr)
                tracker.peak = max(tracker.peak, tracker.current)
                return out

        self.mode = Mode()


def _worker(rank: int, world: int, port: int, seq: int, out_dir: str, budget: int = 0, live: bool = False) -> None:
    import torch
    import torch.distributed as dist

    sys.modules.setdefault("fla", None)
    torch.set_num_threads(1)
    from _common import WIDE_TEXT

    from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
    from glm53flash_hf.train.sequence_parallel import apply_sequence_parallel, shard_sequence

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = Glm53FlashTextConfig(**WIDE_TEXT, num_nextn_predict_layers=0, kernels="torch")
    model = Glm53FlashForCausalLM(config).float().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if world > 1:
        apply_sequence_parallel(model, dist.group.WORLD)
    if budget:
        _set_budgets(model, budget)

    def row(n):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(1, config.vocab_size, (1, n), generator=g)
        docs = [n // 8, n // 2, n // 4, n - n // 8 - n // 2 - n // 4]
        pos = torch.cat([torch.arange(d) for d in docs]).unsqueeze(0)
        batch = {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}
        return shard_sequence(batch, rank, world) if world > 1 else batch

    # warm-up step on a short row: the first step's one-off allocations (thread pools, kernel caches) are not
    # counted in the measured step's peak
    model(**row(64 * world), num_items_in_batch=64 * world - 1).loss.backward()
    model.zero_grad(set_to_none=False)  # the gradients stay allocated: the measured step does not count them
    local = row(seq)
    tracker = _LiveTensors() if live else None
    before = _rss_bytes()
    start = time.perf_counter()
    with tracker.mode if tracker else contextlib.nullcontext():
        loss = model(**local, num_items_in_batch=seq - 1).loss
        loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    with open(os.path.join(out_dir, f"mem_{world}_{rank}.txt"), "w") as f:
        f.write(f"{peak} {seconds} {tracker.peak if tracker else -1}\n")
    if world > 1:
        dist.destroy_process_group()


def measure(seq: int, worlds=(1, 2, 4), budget: int = 0, mmap_threshold: int = 0, live: bool = False) -> None:
    import tempfile

    import torch.multiprocessing as mp

    if mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)  # read by glibc when each worker starts
    out_dir = tempfile.mkdtemp(prefix="bench_sp_")
    peaks, lives = {}, {}
    for world in worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(world, port, seq, out_dir, budget, live), nprocs=world,
                           start_method="spawn")
        rows = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"mem_{world}_{rank}.txt")) as f:
                peak, seconds, live_peak = f.read().split()
                rows.append((int(peak), float(seconds), int(live_peak)))
        peaks[world] = max(r[0] for r in rows)
        lives[world] = max(r[2] for r in rows)
        extra = f", live tensors {lives[world] / MIB:8.1f} MiB" if live else ""
        print(f"  SP={world}: peak {peaks[world] / MIB:8.1f} MiB per rank (max over ranks){extra}, fwd+bwd "
              f"{max(r[1] for r in rows):.1f} s", flush=True)
    for world in worlds[1:]:
        extra = f" (live tensors {lives[world] / lives[worlds[0]]:.3f})" if live else ""
        print(f"  SP={world} / SP=1: {peaks[world] / peaks[worlds[0]]:.3f}{extra}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=131072, help="global tokens for the byte count")
    parser.add_argument("--sp", type=int, default=8, help="SP ranks for the byte count")
    parser.add_argument("--measure", action="store_true", help="also measure peak memory (CPU, gloo)")
    parser.add_argument("--seq", type=int, default=32768, help="tokens of the measured row")
    parser.add_argument("--budget", type=int, default=1 << 22,
                        help="element budget of the DSA indexer score buffer and sparse-MLA query chunk, the same for "
                             "every SP size (the default 1 << 26, 256 MiB fp32 buffers, is a per-rank constant that "
                             "SP cannot divide; 0 keeps it; default: %(default)s)")
    parser.add_argument("--mmap-threshold", type=int, default=0,
                        help="MALLOC_MMAP_THRESHOLD_ (bytes) in every worker's environment (0: glibc's default)")
    parser.add_argument("--live", action="store_true", help="also report the live-tensor high-water (slower)")
    args = parser.parse_args(argv)
    if args.tokens % args.sp or args.seq % 4:
        parser.error("--tokens must divide by --sp and --seq by 4")
    print_bytes(args.tokens, args.sp)
    if args.measure:
        print(f"peak memory, WIDE_TEXT of scripts/_common.py, fp32, one row of {args.seq} tokens, per-layer "
              f"checkpointing, DSA budgets {args.budget or 'default'} elements, MALLOC_MMAP_THRESHOLD_ "
              f"{args.mmap_threshold or 'unset'}, gloo:")
        measure(args.seq, budget=args.budget, mmap_threshold=args.mmap_threshold, live=args.live)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
