"""FP8 checkpoints loaded with their block-scaled e4m3 weights kept (``glm53flash_hf.fp8_kept``).

Oracle: the same checkpoint loaded with ``dequantize_fp8=True`` (transformers' ``Fp8Dequantize`` on load, today's
behaviour), and :func:`glm53flash_hf.fp8_blockwise.dequantize_fp8_blockwise` for the tensors.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn
from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

from glm53flash_hf import fp8_kept
from glm53flash_hf.checkpoint import fp8_module_names
from glm53flash_hf.checkpoint_checks import inspect_checkpoint
from glm53flash_hf.fp8_blockwise import dequantize_fp8_blockwise, quantize_fp8_blockwise
from glm53flash_hf.fp8_kept import Glm53FlashFP8Experts, Glm53FlashFP8Linear, fp8_linear_block_rows, fp8_weight_bytes
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM, Glm53FlashForConditionalGeneration
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


def _bytes_in_memory(model) -> int:
    """Bytes of the distinct storages behind the model's parameters and buffers."""
    storages = {}
    for t in list(model.parameters()) + list(model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_whole_model_weight_bytes_fp8_kept_vs_dequantized(tiny_fp8, dtype, record_property):
    """The tiny FP8 checkpoint as ``make_tiny(fp8=True)`` writes it, loaded on CPU kept in FP8 (the
    Glm53FlashFP8Linear / Glm53FlashFP8Experts modules a CUDA load builds too), holds <= 0.55 of the bytes of all
    parameters and buffers of the same checkpoint loaded with ``dequantize_fp8=True`` in ``dtype``: the text model
    and the model with its vision tower. The ratios are recorded (``record_property``) and printed. The text-tiny
    config's proportions (embeddings and head a third of the bytes) miss the bound, the reason for the FP8 config."""
    from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig
    from glm53flash_hf.tools import plan
    from glm53flash_hf.tools.make_tiny import DEFAULT_CONFIG

    n_fp8_modules = len(fp8_module_names(inspect_checkpoint(tiny_fp8)))
    for cls in (Glm53FlashForCausalLM, Glm53FlashForConditionalGeneration):
        kept = cls.from_pretrained(tiny_fp8, dtype=dtype)
        deq = cls.from_pretrained(tiny_fp8, dtype=dtype, dequantize_fp8=True)
        converted = _converted(kept)
        assert len(converted) == n_fp8_modules and not _converted(deq)
        assert {type(m) for m in converted.values()} == {Glm53FlashFP8Linear, Glm53FlashFP8Experts}
        kept_bytes, deq_bytes = _bytes_in_memory(kept), _bytes_in_memory(deq)
        assert kept_bytes == fp8_weight_bytes(kept)["total"] and deq_bytes == fp8_weight_bytes(deq)["total"]
        ratio = kept_bytes / deq_bytes
        record_property(f"{cls.__name__} {dtype} fp8-kept / dequantized bytes", round(ratio, 4))
        print(f"{cls.__name__} {dtype}: {kept_bytes} / {deq_bytes} bytes = {ratio:.4f}")
        assert ratio <= 0.55, (cls.__name__, kept_bytes, deq_bytes)
    text_tiny = plan.fp8_load_bytes(Glm53FlashConfig.from_json_file(DEFAULT_CONFIG), dtype)
    assert text_tiny["total"] > 0.55 * text_tiny["dequantized"], text_tiny


def test_fp8_load_bytes_on_meta_equal_the_load_and_release_ratio(tiny_fp8, models):
    """plan.fp8_load_bytes (meta device, the load's quantizer and module classes) counts exactly the bytes of the
    real tiny loads, FP8-kept and dequantized. At the release configuration it finds the release's 37,338 FP8
    tensors (one per ``*_scale_inv`` of the FP8 release's index) in 229 converted modules, agrees with the plan's
    own FP8 byte count, and the whole FP8-kept model takes <= 0.55 of the bf16 dequantized load."""
    from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig
    from glm53flash_hf.tools import plan

    kept, deq = models
    got = plan.fp8_load_bytes(Glm53FlashConfig.from_pretrained(tiny_fp8), torch.float32)
    assert {k: got[k] for k in ("fp8", "scales", "other", "total")} == fp8_weight_bytes(kept)
    assert got["dequantized"] == fp8_weight_bytes(deq)["total"]
    assert got["fp8_keys"] == len(inspect_checkpoint(tiny_fp8).fp8_weights)
    assert got["fp8_modules"] == len(_converted(kept)) == len(fp8_module_names(inspect_checkpoint(tiny_fp8)))
    release = plan.load_config(None)
    got = plan.fp8_load_bytes(release, torch.bfloat16)
    assert got["fp8_keys"] == 37338 and got["fp8_modules"] == 229  # 43 experts, 43 x 3 shared, 9 dense, 12 x 4 attn
    names, _, _ = plan.parameter_shapes(release)
    dsa = {n[: -len("q_a_proj.weight")] for n in names if n.endswith("self_attn.q_a_proj.weight")}
    assert got["converted"] == sum(plan._fp8_bytes(s) for n, s in names.items() if plan._is_fp8(n, dsa))
    assert got["converted"] <= 0.55 * got["converted_dequantized"]
    assert got["total"] <= 0.55 * got["dequantized"], got["total"] / got["dequantized"]


def test_fp8_kept_logits_equal_dequantized(models):
    """fp32 compute: the FP8-kept model's logits equal the dequantized model's within 1e-5 relative."""
    kept, deq = models
    ids = torch.randint(0, 2000, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = kept(input_ids=ids).logits, deq(input_ids=ids).logits
    assert torch.isfinite(b).all()
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_fp8_experts_whose_halves_are_not_whole_blocks(tmp_path):
    """Routed experts of intermediate size 96: gate and up are blocked separately (one 128-row block each), so the
    merged rows' two scale rows look like one 128-row grid over 192 rows; the FP8-kept logits still equal the
    dequantized model's (fp32, 1e-5 relative)."""
    from glm53flash_hf.tools.make_tiny import DEFAULT_CONFIG

    with open(DEFAULT_CONFIG) as f:
        config = json.load(f)
    config["text_config"]["moe_intermediate_size"] = 96
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    folder = make_tiny(str(tmp_path / "ckpt"), config_path=str(path), fp8=True, show_progress=False)
    kept = Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    deq = Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32, dequantize_fp8=True).eval()
    experts = kept.model.layers[1].mlp.experts
    assert isinstance(experts, Glm53FlashFP8Experts) and experts.gate_up_proj_scale_inv.shape[1] == 2
    ids = torch.randint(0, 2000, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = kept(input_ids=ids).logits, deq(input_ids=ids).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_fp8_kept_text_model_equals_dequantized(tiny_fp8):
    """The text-only class (config from text_config, which lacks quantization_config) also keeps FP8."""
    from glm53flash_hf.modeling_glm53flash import Glm53FlashTextModel

    kept = Glm53FlashTextModel.from_pretrained(tiny_fp8, dtype=torch.float32).eval()
    deq = Glm53FlashTextModel.from_pretrained(tiny_fp8, dtype=torch.float32, dequantize_fp8=True).eval()
    assert len(_converted(kept)) == len(fp8_module_names(inspect_checkpoint(tiny_fp8))) and not _converted(deq)
    ids = torch.randint(0, 2000, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = kept(input_ids=ids).last_hidden_state, deq(input_ids=ids).last_hidden_state
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_fp8_kept_fwd_bwd_peak_and_input_gradients(models):
    """One forward+backward (gradients to the inputs only, base frozen): the input-embedding gradients equal the
    dequantized model's; weights plus the live-tensor high-water of the step is smaller on the FP8 base; the FP8
    weights are not modified."""
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
    # the fp32 bound, as for the logits above: 1e-5 of the largest entry. The FP8 path multiplies by
    # block rows, the dequantized one in one GEMM; 1e-7 of the largest entry is under one fp32 ulp of it, so a
    # reordered sum (another CPU's BLAS kernels) could exceed it
    diff = (grads["fp8"] - grads["dequantized"]).abs().max()
    assert diff <= 1e-5 * grads["dequantized"].abs().max(), diff
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


def test_fp8_save_reload_keeps_fp8_tensors(tiny_fp8, models, tmp_path):
    """save_pretrained of the FP8-kept model writes the published layout with the source's FP8 tensors and scales
    bit for bit (per-expert scales split back from the merged ones); it reloads to the same logits."""
    from safetensors import safe_open

    kept, _ = models
    out = str(tmp_path / "resaved")
    kept.save_pretrained(out)

    def tensors(folder):
        got = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(folder, f), "pt") as s:
                    got.update({k: s.get_tensor(k) for k in s.keys() if k.endswith("_scale_inv") or "proj" in k})
        return got

    src, new = tensors(tiny_fp8), tensors(out)
    fp8_src = {k: v for k, v in src.items() if v.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv")}
    assert len(fp8_src) > 100
    for k, v in fp8_src.items():
        assert new[k].dtype == v.dtype and torch.equal(new[k].view(torch.uint8), v.view(torch.uint8)), k
    reloaded = Glm53FlashForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 2000, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, kept(input_ids=ids).logits)


def _lora(model, seed=0, b_std=0.0):
    from peft import get_peft_model

    from glm53flash_hf.train.trainer import default_lora_config

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, default_lora_config(r=4))
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05 if "lora_A" in n else b_std)
    return peft_model


def test_lora_on_fp8_base_equals_lora_on_dequantized_and_trains(tiny_fp8):
    """default_lora_config (routed experts included) on the FP8 base: logits and adapter gradients equal the same
    adapter on the dequantized base (fp32); a few AdamW steps lower the loss; the FP8 weights are unchanged."""
    ids = torch.randint(0, 2000, (2, 12), generator=torch.Generator().manual_seed(2))
    results = {}
    for deq in (False, True):
        base = Glm53FlashForCausalLM.from_pretrained(tiny_fp8, dtype=torch.float32, dequantize_fp8=deq)
        peft_model = _lora(base, b_std=0.02)
        out = peft_model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
        results[deq] = (out.logits.detach(), grads, peft_model)
    (a, ga, kept), (b, gb, _) = results[False], results[True]
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert ga.keys() == gb.keys() and any(".experts." in n for n in ga)
    for n in gb:
        assert ga[n] is not None and (ga[n] - gb[n]).abs().max() <= 1e-4 * gb[n].abs().max(), n
    before = {n: p.clone() for n, p in kept.named_parameters() if p.dtype == torch.float8_e4m3fn}
    opt = torch.optim.AdamW([p for p in kept.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = kept(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    for n, p in kept.named_parameters():
        if n in before:
            assert p.dtype == torch.float8_e4m3fn and torch.equal(p.view(torch.uint8), before[n].view(torch.uint8))


MERGE_IDS = torch.randint(0, 2000, (2, 12), generator=torch.Generator().manual_seed(2))


def _fp8_weights(model, names):
    """``{(module, parameter): tensor}`` of the weights of the modules ``names`` (those the checkpoint stores in
    FP8)."""
    out = {}
    for n, m in model.named_modules():
        if n in names:
            for p in ("gate_up_proj", "down_proj") if hasattr(m, "gate_up_proj") else ("weight",):
                out[(n, p)] = getattr(m, p)
    return out


def _roundtrip(x, halves):
    """(rt(x), elementwise bound) of one 2-D weight with fresh block scales, gate/up halves blocked separately."""
    from glm53flash_hf.fp8_blockwise import roundtrip_error_bound

    rts, bounds = [], []
    for part in x.chunk(2) if halves else [x]:
        q, s = quantize_fp8_blockwise(part)
        rts.append(dequantize_fp8_blockwise(q, s, torch.float32))
        bounds.append(roundtrip_error_bound(part, dequantize_fp8_blockwise(torch.ones_like(q), s, torch.float32)))
    return torch.cat(rts), torch.cat(bounds)


@pytest.fixture(scope="module")
def merge_oracle(tiny_fp8, models):
    """A trained-like LoRA adapter on the FP8 base, its logits, and the oracle built without merge_lora_fp8: the same
    adapter on transformers' dequantized load merged by PEFT (``x = W + delta``), then each FP8-stored weight
    replaced by its block-scaled e4m3 round trip ``rt(x)`` (:func:`quantize_fp8_blockwise` /
    :func:`dequantize_fp8_blockwise`), with its logits, the ``x`` and the elementwise round-trip bounds."""
    kept, _ = models
    names = set(_converted(kept))
    peft_model = _lora(Glm53FlashForCausalLM.from_pretrained(tiny_fp8, dtype=torch.float32), b_std=0.02)
    lora = {k: v.detach().clone() for k, v in peft_model.state_dict().items() if "lora_" in k}
    with torch.no_grad():
        adapter_logits = peft_model(input_ids=MERGE_IDS).logits
    oracle = _lora(Glm53FlashForCausalLM.from_pretrained(tiny_fp8, dtype=torch.float32, dequantize_fp8=True))
    assert not oracle.load_state_dict(lora, strict=False).unexpected_keys
    oracle = oracle.merge_and_unload()
    xs, bounds = {}, {}
    with torch.no_grad():
        for (n, p), w in _fp8_weights(oracle, names).items():
            xs[(n, p)] = w.clone()
            pairs = [_roundtrip(w[e], p == "gate_up_proj") for e in range(len(w))] if w.dim() == 3 else None
            rt, bound = (torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])) if pairs else (
                _roundtrip(w, False))  # fmt: skip
            w.copy_(rt)
            bounds[(n, p)] = bound
        rt_logits = oracle.eval()(input_ids=MERGE_IDS).logits
    return {"names": names, "lora": lora, "adapter_logits": adapter_logits, "rt_logits": rt_logits, "x": xs,
            "bounds": bounds}


def _merge_and_reload(tiny_fp8, oracle, fp8, folder, delta_factor=1.0, monkeypatch=None):
    """merge_lora_fp8 of the oracle's adapter on a fresh FP8 base (``delta_factor`` != 1: a broken merge that scales
    each FP8 weight's delta), save_pretrained, reload; returns the reloaded model's errors against the contract:
    ``rt`` (logits vs the round-trip oracle, relative to its max), ``adapter`` (vs the adapter model), ``bound``
    (largest elementwise ``|reloaded - x| / bound``), the merge's report and whether the reload is FP8."""
    from glm53flash_hf.train import fp8_lora

    peft_model = _lora(Glm53FlashForCausalLM.from_pretrained(tiny_fp8, dtype=torch.float32))
    peft_model.load_state_dict(oracle["lora"], strict=False)
    if delta_factor != 1.0:
        merge_one = fp8_lora._merge_one
        monkeypatch.setattr(fp8_lora, "_merge_one", lambda w, s, d, *a: merge_one(w, s, d * delta_factor, *a))
    merged, report = fp8_lora.merge_lora_fp8(peft_model, fp8=fp8, dtype=torch.float32)
    merged.save_pretrained(folder)
    reloaded = Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=MERGE_IDS).logits
    dense = Glm53FlashForCausalLM.from_pretrained(folder, dtype=torch.float32, dequantize_fp8=True) if fp8 else reloaded
    bound = max(
        ((w - oracle["x"][k]).abs() / oracle["bounds"][k]).max().item()
        for k, w in _fp8_weights(dense, oracle["names"]).items()
    )
    ref, rt = oracle["adapter_logits"], oracle["rt_logits"]
    return {
        "rt": ((logits - rt).abs().max() / rt.abs().max()).item(),
        "adapter": ((logits - ref).abs().max() / ref.abs().max()).item(),
        "bound": bound, "report": report, "fp8": bool(_converted(reloaded)),
    }  # fmt: skip


def test_fp8_merge_reload_is_the_adapter_model_with_round_tripped_weights(tiny_fp8, merge_oracle, tmp_path):
    """merge_lora_fp8(fp8=True) -> save -> reload: the logits equal (fp32, 1e-5 relative) the adapter model's with
    each merged weight W + delta replaced by its e4m3 round trip, i.e. the round trip is the only difference; every
    reloaded weight element is within the e4m3 round-trip bound of W + delta, as the merge's report says; the
    model stays FP8."""
    got = _merge_and_reload(tiny_fp8, merge_oracle, True, str(tmp_path / "fp8"))
    report = got["report"]
    assert got["fp8"] and report["fp8"] and report["merged_fp8_weights"] == 49  # 37 FP8Linear + 2 per experts
    assert got["rt"] <= 1e-5, got
    assert 0 < got["bound"] <= 1 and 0 < report["max_roundtrip_bound_ratio"] <= 1, got
    assert abs(got["bound"] - report["max_roundtrip_bound_ratio"]) <= 1e-6, got
    assert 0 < report["max_rel_roundtrip_error"] <= 2.0**-4


def test_dense_merge_reload_equals_the_adapter_model(tiny_fp8, merge_oracle, tmp_path):
    """merge_lora_fp8(fp8=False, fp32) -> save -> reload: the adapter model's logits within 1e-5 relative (the order
    of fp32 sums); the FP8-stored weights equal W + delta of the PEFT merge on the dequantized base to fp32
    rounding; no FP8 left."""
    got = _merge_and_reload(tiny_fp8, merge_oracle, False, str(tmp_path / "dense"))
    assert not got["fp8"] and got["report"]["max_roundtrip_bound_ratio"] == 0
    assert got["adapter"] <= 1e-5, got
    assert got["bound"] <= 1e-3, got


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "dense"])
@pytest.mark.parametrize("delta_factor", [0.0, 2.0], ids=["delta-dropped", "delta-twice"])
def test_merge_contract_checks_fail_on_a_broken_merge(tiny_fp8, merge_oracle, tmp_path, monkeypatch, fp8,
                                                      delta_factor):
    """The two tests above can fail: a merge that drops each FP8 weight's delta or adds it twice misses the logits
    by far more than 1e-5 and the weights by far more than the round-trip bound."""
    got = _merge_and_reload(tiny_fp8, merge_oracle, fp8, str(tmp_path / "broken"), delta_factor, monkeypatch)
    assert got["rt" if fp8 else "adapter"] > 1e-2 and got["bound"] > 10, got


def test_merge_lora_fp8_rejects_two_adapters(tiny_fp8):
    from glm53flash_hf.train.fp8_lora import merge_lora_fp8
    from glm53flash_hf.train.trainer import default_lora_config

    peft_model = _lora(Glm53FlashForCausalLM.from_pretrained(tiny_fp8, dtype=torch.float32))
    peft_model.add_adapter("second", default_lora_config(r=2))
    peft_model.base_model.set_adapter(["default", "second"])
    with pytest.raises(ValueError, match=r"one active adapter; got active_adapters=\['default', 'second'\]"):
        merge_lora_fp8(peft_model)


def test_merge_adapter_rejects_unknown_format(tiny_fp8):
    from glm53flash_hf.tools.finetune import merge_adapter

    with pytest.raises(ValueError, match="merged_format must be 'fp8' or 'dense'; got 'bf8'"):
        merge_adapter(tiny_fp8, "unused", torch.float32, "bf8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fp8_path(tiny_fp8, capsys):
    """CUDA: the FP8-kept model on the GPU (transformers' FP8 kernel where it loads and the grid is whole blocks,
    else the block-row forward) against the dequantized fp32 model on CPU; LoRA fwd+bwd on the GPU leaves the FP8
    weights unchanged and gives finite adapter gradients. Prints which path ran and the error."""
    kept = Glm53FlashForCausalLM.from_pretrained(tiny_fp8, dtype=torch.float32, device_map="cuda").eval()
    deq = Glm53FlashForCausalLM.from_pretrained(tiny_fp8, dtype=torch.float32, dequantize_fp8=True).eval()
    assert all(p.device.type == "cuda" for p in kept.parameters()) and _converted(kept)
    ids = torch.randint(0, 2000, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = kept(input_ids=ids.cuda()).logits.cpu(), deq(input_ids=ids).logits
    rel = ((a - b).abs().max() / b.abs().max()).item()
    kernel = fp8_kept._KERNEL_STATE.get("cuda", False)
    with capsys.disabled():
        print(f"\nCUDA FP8 path: transformers kernel={kernel}; logits rel error vs dequantized fp32 CPU {rel:.3g}")
    # the kernel quantizes activations to e4m3 per 128-block (dynamic scheme): errors of that order are its design
    assert rel <= (0.1 if kernel else 1e-4), rel
    before = {n: p.clone() for n, p in kept.named_parameters() if p.dtype == torch.float8_e4m3fn}
    peft_model = _lora(kept, b_std=0.02)
    peft_model(input_ids=ids.cuda(), labels=ids.cuda()).loss.backward()
    grads = [p.grad for p in peft_model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    for n, p in kept.named_parameters():
        if n in before:
            assert torch.equal(p.view(torch.uint8), before[n].view(torch.uint8)), n
