"""Weight bytes and the live-tensor peak of one LoRA forward+backward on an FP8 base kept in FP8 against the same
checkpoint loaded dequantized (CPU).

For the tiny FP8 checkpoint (``tiny-fp8``: ``glm53flash-make-tiny --fp8``'s default config,
``configuration/tiny_fp8.json``, whose FP8-stored modules hold most of the bytes as in the release), the tiny config
(``configuration/tiny.json``) and the benchmarks' wide config (``scripts/_common.WIDE_TEXT``: hidden 256, experts'
intermediate 128, i.e. whole 128x128 blocks), ``glm53flash-make-tiny --fp8`` writes the FP8 checkpoint; each is
loaded kept in FP8 and with ``dequantize_fp8=True`` in ``--dtype``, gets
:func:`glm53flash_hf.train.trainer.default_lora_config` adapters (rank ``--rank``, routed experts included), and one
``model(input_ids, labels).loss.backward()`` on ``--seq`` tokens runs under the live-tensor counter of
``scripts/bench_sp.py`` (``_LiveTensors``: every CPU storage an aten op returns, counted until freed; after a warm-up
step). Reported: the parameters and buffers (:func:`glm53flash_hf.fp8_kept.fp8_weight_bytes`, adapters included),
the step's high-water above them, and their sum.

Usage::

    python scripts/investigations/fp8_memory.py                 # tiny-fp8, tiny and wide, fp32, 512 tokens
    python scripts/investigations/fp8_memory.py --dtype bfloat16 --seq 2048
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # _common, bench_sp: the benchmarks' helpers

MIB = 1024**2


def _config_file(folder: str, name: str) -> str | None:
    """The config file of ``name``; ``None`` (make-tiny's ``--fp8`` default) for ``"tiny-fp8"``."""
    from _common import WIDE_TEXT

    if name == "tiny-fp8":
        return None
    wide = name == "wide"
    with open(os.path.join(ROOT, "configuration", "tiny.json")) as f:
        config = json.load(f)
    if wide:
        # the shapes of WIDE_TEXT; the tiny vocabulary and special tokens (the tokenizer make_tiny trains)
        config["text_config"].update({k: v for k, v in WIDE_TEXT.items() if k not in ("vocab_size", "pad_token_id")})
        config["text_config"]["indexer_types"] = ["full"] * WIDE_TEXT["num_hidden_layers"]
        config["vision_config"]["out_hidden_size"] = WIDE_TEXT["hidden_size"]
    path = os.path.join(folder, f"config-{'wide' if wide else 'tiny'}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def measure(folder: str, dequantize: bool, dtype, seq: int, rank: int) -> dict:
    import torch
    from bench_sp import _LiveTensors
    from peft import get_peft_model

    from glm53flash_hf.fp8_kept import fp8_weight_bytes
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
    from glm53flash_hf.train.trainer import default_lora_config

    torch.manual_seed(0)
    model = Glm53FlashForCausalLM.from_pretrained(folder, dtype=dtype, dequantize_fp8=dequantize)
    model = get_peft_model(model, default_lora_config(r=rank))
    ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up
    model.zero_grad(set_to_none=True)
    tracker = _LiveTensors()
    with tracker.mode:
        model(input_ids=ids, labels=ids).loss.backward()
    weights = fp8_weight_bytes(model)
    return {"weights": weights["total"], "fp8": weights["fp8"], "step_peak": tracker.peak,
            "total": weights["total"] + tracker.peak}


def main(argv=None) -> int:
    import torch

    from glm53flash_hf.tools.make_tiny import make_tiny

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    print(f"| config | load ({args.dtype}) | weights MiB | weights / dequantized | fwd+bwd high-water MiB | total MiB "
          "| total / dequantized |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tiny-fp8", "tiny", "wide"):
            folder = make_tiny(os.path.join(tmp, name), config_path=_config_file(tmp, name), fp8=True,
                               show_progress=False)
            rows = {label: measure(folder, label == "dequantized", dtype, args.seq, args.rank)
                    for label in ("fp8 kept", "dequantized")}
            for label, r in rows.items():
                deq = rows["dequantized"]
                print(f"| {name} | {label} | {r['weights'] / MIB:.2f} | {r['weights'] / deq['weights']:.3f} "
                      f"| {r['step_peak'] / MIB:.2f} | {r['total'] / MIB:.2f} | {r['total'] / deq['total']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
