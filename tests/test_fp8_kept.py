"""FP8 checkpoints loaded with their block-scaled e4m3 weights kept (``glm53flash_hf.fp8_kept``).

Oracle: the same checkpoint loaded with ``dequantize_fp8=True`` (transformers' ``Fp8Dequantize`` on load, today's
behaviour), and :func:`glm53flash_hf.tools.fp8.dequantize_fp8_blockwise` for the tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from torch import nn
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

from glm53flash_hf import fp8_kept
from glm53flash_hf.checkpoint import fp8_module_names, inspect_checkpoint
from glm53flash_hf.fp8_kept import Glm53FlashFP8Experts, Glm53FlashFP8Linear, fp8_linear_block_rows, fp8_weight_bytes
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
from glm53flash_hf.tools.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise
from glm53flash_hf.tools.make_tiny import make_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    return make_tiny(str(tmp_path_factory.mktemp("fp8") / "tiny"), fp8=True, show_progress=False)


@pytest.fixture(scope="module")
def models(tiny_fp8):
    kept = Glm53FlashForCausalLM.from_pretrained(tiny_fp8, dtype=torch.float32).eval()
    deq = Glm53FlashForCausalLM.from_pretrained(tiny_fp8, dtype=torch.float32, dequantize_fp8=True).eval()
    return kept, deq


def _converted(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (FP8Linear, FP8Experts))}


def test_fp8_modules_kept_as_e4m3_with_scales(tiny_fp8, models):
    """Every module whose weights the checkpoint stores in FP8 (attention projections, dense and shared MLPs,
    routed experts) is transformers' FP8Linear / FP8Experts holding e4m3 weights and fp32 block scales; the
    others (KDA projections, kv_b_proj, indexer, lm_head) stay plain; each FP8 weight dequantized equals the
    dequantized load's parameter bit for bit; the converted modules take <= 0.55 of their bf16 bytes."""
    kept, deq = models
    ckpt = inspect_checkpoint(tiny_fp8)
    names = fp8_module_names(ckpt)
    converted = _converted(kept)
    assert {n.removeprefix("model.") for n in converted} == names
    kinds = {type(m) for m in converted.values()}
    assert kinds == {Glm53FlashFP8Linear, Glm53FlashFP8Experts}
    assert any(n.endswith("mlp.experts") for n in converted) and any(n.endswith("q_b_proj") for n in converted)
    assert type(kept.model.layers[0].self_attn.o_proj) is nn.Linear  # KDA o_proj is bf16 in the checkpoint
    assert type(kept.model.layers[2].self_attn.kv_b_proj) is nn.Linear
    deq_params = dict(deq.named_parameters())
    fp8_bytes = bf16_bytes = 0
    for name, module in converted.items():
        pairs = (
            [("gate_up_proj", "gate_up_proj_scale_inv"), ("down_proj", "down_proj_scale_inv")]
            if isinstance(module, FP8Experts)
            else [("weight", "weight_scale_inv")]
        )
        for w_name, s_name in pairs:
            w, s = getattr(module, w_name), getattr(module, s_name)
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32, name
            ref = deq_params[f"{name}.{w_name}"]
            if w.dim() == 2:
                got = dequantize_fp8_blockwise(w, s, torch.float32)
            else:  # per expert; gate and up halves blocked separately
                half = w.shape[1] // 2 if w_name == "gate_up_proj" else None
                got = torch.stack([
                    torch.cat([
                        dequantize_fp8_blockwise(w[e, :half], s[e, : s.shape[1] // 2], torch.float32),
                        dequantize_fp8_blockwise(w[e, half:], s[e, s.shape[1] // 2 :], torch.float32),
                    ]) if half else dequantize_fp8_blockwise(w[e], s[e], torch.float32)
                    for e in range(w.shape[0])
                ])  # fmt: skip
            assert torch.equal(got, ref), name
            fp8_bytes += w.numel() + s.numel() * 4
            bf16_bytes += ref.numel() * 2
    assert fp8_bytes <= 0.55 * bf16_bytes, (fp8_bytes, bf16_bytes)
    whole_kept, whole_deq = fp8_weight_bytes(kept), fp8_weight_bytes(deq)
    assert whole_kept["fp8"] > 0 and whole_deq["fp8"] == 0
    assert whole_deq["total"] - whole_kept["total"] == (4 - 1) * whole_kept["fp8"] - whole_kept["scales"]


def test_fp8_kept_logits_equal_dequantized(models):
    """fp32 compute: the FP8-kept model's logits equal the dequantized model's within 1e-5 relative."""
    kept, deq = models
    ids = torch.randint(0, 2000, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = kept(input_ids=ids).logits, deq(input_ids=ids).logits
    assert torch.isfinite(b).all()
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_fp8_kept_fwd_bwd_peak_and_input_gradients(models):
    """One forward+backward (gradients to the inputs only, base frozen): the input-embedding gradients equal the
    dequantized model's; weights plus the live-tensor high-water of the step is smaller on the FP8 base; the FP8
    weights are not modified."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from bench_sp import _LiveTensors

    kept, deq = models
    ids = torch.randint(0, 2000, (1, 16), generator=torch.Generator().manual_seed(1))
    before = {n: p.clone() for n, p in kept.named_parameters() if p.dtype == torch.float8_e4m3fn}
    peaks, grads = {}, {}
    for label, model in (("fp8", kept), ("dequantized", deq)):
        for p in model.parameters():
            p.requires_grad_(False)
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        tracker = _LiveTensors()
        with tracker.mode:
            model(inputs_embeds=emb).logits.float().pow(2).mean().backward()
        peaks[label] = fp8_weight_bytes(model)["total"] + tracker.peak
        grads[label] = emb.grad
    assert torch.allclose(grads["fp8"], grads["dequantized"], rtol=1e-4, atol=1e-7 * grads["dequantized"].abs().max())
    assert peaks["fp8"] < peaks["dequantized"], peaks
    for n, p in kept.named_parameters():
        if n in before:
            assert torch.equal(p.view(torch.uint8), before[n].view(torch.uint8)), n


@pytest.mark.parametrize("halves", [False, True])
def test_block_rows_linear_matches_dense_in_small_tiles(monkeypatch, halves):
    """fp8_linear_block_rows in tiles of one block row equals x @ dequantized(W).T (forward and input gradient),
    for a plain grid with partial blocks and for separately blocked halves."""
    torch.manual_seed(0)
    block = (16, 32)
    if halves:
        parts = [quantize_fp8_blockwise(torch.randn(24, 70), block) for _ in range(2)]
        w = torch.cat([p[0] for p in parts])
        s = torch.cat([p[1] for p in parts])
        dense = torch.cat([dequantize_fp8_blockwise(q, sc, torch.float32, block) for q, sc in parts])
    else:
        w, s = quantize_fp8_blockwise(torch.randn(50, 70), block)
        dense = dequantize_fp8_blockwise(w, s, torch.float32, block)
    monkeypatch.setattr(fp8_kept, "TILE_ELEMENTS", 1)
    x = torch.randn(3, 5, 70, requires_grad=True)
    out = fp8_linear_block_rows(x, w, s, block)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = ref_x @ dense.T
    assert (out - ref).abs().max() <= 1e-6 * ref.abs().max()  # fp32, sums in another order
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    assert (x.grad - ref_x.grad).abs().max() <= 1e-6 * ref_x.grad.abs().max()


def test_block_rows_linear_rejects_bad_inputs():
    w, s = quantize_fp8_blockwise(torch.randn(40, 64), (16, 32))
    with pytest.raises(ValueError, match="weight: expected a 2-D"):
        fp8_linear_block_rows(torch.randn(2, 64), w.float(), s, (16, 32))
    with pytest.raises(ValueError, match=r"scale_inv \(3, 1\) does not tile"):
        fp8_linear_block_rows(torch.randn(2, 64), w, s[:, :1], (16, 32))
    with pytest.raises(ValueError, match="weight_scale_inv with 2 rows does not tile"):
        fp8_linear_block_rows(torch.randn(2, 64), w, s[:2], (16, 32))


def test_bad_dequantize_flag_and_excluded_fp8_module(tiny_fp8, tmp_path):
    with pytest.raises(ValueError, match="dequantize_fp8 must be a bool; got 'yes'"):
        Glm53FlashForCausalLM.from_pretrained(tiny_fp8, dequantize_fp8="yes")
    folder = str(tmp_path / "excl")
    shutil.copytree(tiny_fp8, folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["modules_to_not_convert"].append("q_b_proj")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"modules_to_not_convert=.*excludes 4 modules .*q_b_proj.*dequantize_fp8"):
        Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32, dequantize_fp8=True)
    assert not _converted(model)
