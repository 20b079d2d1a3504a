"""glm53flash-plan (glm53flash_hf/tools/plan.py): the parts add up, the fits verdict follows the budget, bad options
are refused naming them, the LoRA adapter count equals PEFT's, and one 1-process prediction is within 15 % of the
measured peak of live tensors (the multi-process validation is ``scripts/investigations/plan_validate.py``)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import types

import pytest
import torch

from glm53flash_hf.tools import plan
from glm53flash_hf.tools.make_tiny import DEFAULT_CONFIG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1024**3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A checkpoint folder holding only the tiny config (all the planner reads)."""
    out = tmp_path_factory.mktemp("plan_tiny")
    shutil.copy(DEFAULT_CONFIG, out / "config.json")
    return str(out)


def _cli(*args):
    """``glm53flash-plan ARGS`` (the console script's ``main``) in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = plan.main(list(args))
        except SystemExit as exc:
            code = exc.code
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_cli_parts_add_up_and_verdict(folder):
    config = plan.load_config(folder)
    setup = plan.Setup(gpus=2, gpu_memory_gib=1.0, fsdp=2, ep=2, seq_len=256, lora_rank=4, reserve_gib=0.0)
    p = plan.plan_memory(config, setup)
    assert set(p.parts) == {"weights", "gradients", "optimizer_states", "activations", "communication_buffers"}
    assert all(v > 0 for v in p.parts.values())
    assert p.total == sum(p.parts.values())
    assert p.parts["optimizer_states"] == 2 * p.parts["gradients"]  # AdamW: two fp32 moments per fp32 gradient
    # the verdict follows the budget: just above the total fits, just below does not
    above = plan.plan_memory(config, plan.Setup(**{**setup.__dict__, "gpu_memory_gib": (p.total + 1) / GIB}))
    below = plan.plan_memory(config, plan.Setup(**{**setup.__dict__, "gpu_memory_gib": (p.total - 1) / GIB}))
    assert above.fits and not below.fits
    ok = _cli(folder, "--gpus", "2", "--fsdp", "2", "--ep", "2", "--seq-len", "256", "--lora-rank", "4",
              "--gpu-memory-gib", "1", "--reserve-gib", "0")
    assert ok.returncode == 0, ok.stderr
    assert f"{p.total / GIB:9.2f} GiB" in ok.stdout and "fits: yes" in ok.stdout
    small = _cli(folder, "--gpus", "1", "--seq-len", "256", "--gpu-memory-gib", "0.01", "--reserve-gib", "0")
    assert small.returncode == 1 and "fits: no" in small.stdout


@pytest.mark.parametrize(
    "args, match",
    [
        (["--gpus", "0"], r"--gpus must be a positive integer; got 0"),
        (["--gpus", "4", "--ep", "3"], r"--ep=3 must divide --gpus=4"),
        (["--gpus", "3", "--ep", "3", "--fsdp", "3"], r"--ep=3 must divide the routed-expert count n_routed_experts=8"),
        (["--gpus", "4", "--fsdp", "2"], r"--fsdp must be 1 or --gpus=4"),
        (["--gpus", "4", "--ep", "2", "--sp", "2"], r"--ep and --sp cannot be combined.*--ep=2 --sp=2"),
        (["--gpus", "2", "--sp", "2", "--seq-len", "255"], r"--sp=2 must divide --seq-len=255"),
        (["--base", "int4"], r"--base must be one of .*got 'int4'"),
        (["--lora-rank", "-1"], r"--lora-rank must be >= 0"),
        (["--gpu-memory-gib", "0"], r"--gpu-memory-gib must be a finite number > 0; got 0.0"),
    ],
)
def test_bad_options_refused(folder, args, match):
    import re

    out = _cli(folder, "--gpus", "1", *args) if "--gpus" not in args else _cli(folder, *args)
    assert out.returncode == 2
    assert re.search(match, out.stderr), out.stderr
    config = plan.load_config(folder)
    with pytest.raises(ValueError, match=r"--gpus must be a positive integer; got 0"):
        plan.plan_memory(config, plan.Setup(gpus=0))


def test_no_config_refused(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint='.*empty' must be a folder with a config.json"):
        plan.load_config(str(tmp_path / "empty"))
    out = _cli("--gpus", "1")
    assert out.returncode == 2 and "give a checkpoint folder or --release" in out.stderr


def test_lora_adapter_count_equals_peft(folder):
    """The planner's trainable elements under LoRA (1 GPU) = PEFT's trainable parameters of the real model."""
    import peft

    from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
    from glm53flash_hf.train.trainer import default_lora_config

    config = Glm53FlashConfig.from_json_file(DEFAULT_CONFIG)
    with torch.device("meta"):
        model = peft.get_peft_model(Glm53FlashForCausalLM(config), default_lora_config(r=4))
    expected = sum(p.numel() for p in model.parameters() if p.requires_grad)
    p = plan.plan_memory(config, plan.Setup(gpus=1, seq_len=64, lora_rank=4))
    assert p.details["trainable_per_gpu"] == expected
    assert p.parts["gradients"] == 4 * expected


def test_fp8_base_weights(folder):
    """FP8 base: the quantized tensors at 1 byte plus fp32 block scales, the rest unchanged."""
    config = plan.load_config(folder)
    bf16 = plan.plan_memory(config, plan.Setup(gpus=1, seq_len=64, lora_rank=4, base="bf16"))
    fp8 = plan.plan_memory(config, plan.Setup(gpus=1, seq_len=64, lora_rank=4, base="fp8"))
    shapes, kept, _ = plan.parameter_shapes(config)
    dsa = {n[: -len("q_a_proj.weight")] for n in shapes if n.endswith("self_attn.q_a_proj.weight")}
    quantized = [s for n, s in shapes.items() if plan._is_fp8(n, dsa)]
    assert quantized
    saved = sum(2 * torch.Size(s).numel() - plan._fp8_bytes(s) for s in quantized)
    assert bf16.parts["weights"] - fp8.parts["weights"] == saved


def test_predicted_within_15_percent_of_measured():
    """One process, tiny config, LoRA, activation checkpointing: predicted vs the live-tensor high-water."""
    import plan_validate

    predicted = plan_validate.predict("tiny-1-lora").total
    measured = plan_validate.measure("tiny-1-lora")["peak"]
    assert abs(predicted / measured - 1) <= 0.15, (predicted, measured)
