"""PEFT LoRA on GLM-5.3-Flash: projections (``target_modules``) and the routed experts' 3-D weights
(``target_parameters``) via :func:`glm53flash_hf.train.trainer.default_lora_config`."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

peft = pytest.importorskip("peft")

from tiny import fp64_error_tol, no_warnings, rel_err  # noqa: E402

from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig  # noqa: E402
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM  # noqa: E402
from glm53flash_hf.tools.make_tiny import DEFAULT_CONFIG, make_tiny  # noqa: E402
from glm53flash_hf.train.trainer import EXPERT_TARGET_PARAMETERS, default_lora_config  # noqa: E402


def _base(seed: int = 0) -> Glm53FlashForCausalLM:
    torch.manual_seed(seed)
    return Glm53FlashForCausalLM(Glm53FlashConfig.from_json_file(DEFAULT_CONFIG)).eval()


def _ids(seed: int = 1, shape=(2, 12)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1900, shape, generator=g)


def _perturb_lora_b(model, only_experts: bool = False, seed: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and (not only_experts or ".experts." in name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _experts_modules(model):
    return {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}


@pytest.fixture(scope="module")
def lora():
    base = _base()
    ids = _ids()
    with torch.no_grad():
        ref = base(ids).logits
    model = peft.get_peft_model(base, default_lora_config(r=4))
    return model, ids, ref


def test_config_fields():
    cfg = default_lora_config(r=4)
    assert cfg.task_type == "CAUSAL_LM"
    assert sorted(cfg.target_parameters) == sorted(EXPERT_TARGET_PARAMETERS)
    import re

    pattern = re.compile(cfg.target_modules)
    for name in ("model.layers.2.self_attn.q_a_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
                 "model.language_model.layers.3.mlp.shared_experts.gate_proj", "model.layers.2.self_attn.o_proj",
                 "model.layers.2.self_attn.kv_b_proj"):
        assert pattern.fullmatch(name), name
    for name in ("model.visual.blocks.0.mlp.down_proj",
                 "model.layers.2.self_attn.indexer.wq_b", "model.layers.0.self_attn.f_a_proj", "lm_head"):
        assert not pattern.fullmatch(name), name
    assert cfg.lora_dropout == 0.0 and cfg.lora_alpha == 8
    with pytest.raises(ValueError):
        default_lora_config(r=0)
    with pytest.raises(ValueError):
        default_lora_config(target_modules=None, experts=False)


def test_identity_at_init_and_wrapping(lora):
    model, ids, ref = lora
    with torch.no_grad():
        out = model(ids).logits
    assert torch.equal(out, ref)
    names = [n for n, _ in model.named_parameters() if "lora_" in n]
    # every sparse layer's experts (5 main + 1 MTP) got one A/B pair per 3-D parameter
    n_sparse = sum(1 for n in _experts_modules(model))
    assert n_sparse == 6
    assert sum(1 for n in names if ".experts." in n) == n_sparse * 2 * 2
    leaves = ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_proj", "v_proj", "o_proj", "gate_proj",
              "shared_experts.down_proj")
    for leaf in leaves:
        assert any(f"{leaf}.lora_A" in n for n in names), leaf
    assert not any("visual" in n for n in names)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(names)


def test_expert_lora_changes_expert_outputs():
    base = _base()
    model = peft.get_peft_model(base, default_lora_config(r=4))
    experts = _experts_modules(model)
    g = torch.Generator().manual_seed(3)
    cfg = base.config.get_text_config()
    h = torch.randn(10, cfg.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:2] for _ in range(10)])
    w = torch.rand(10, 2, generator=g)
    with torch.no_grad():
        before = {n: m(h, idx, w) for n, m in experts.items()}
        _perturb_lora_b(model, only_experts=True)
        after = {n: m(h, idx, w) for n, m in experts.items()}
    for n in experts:
        assert (after[n] - before[n]).abs().max() > 1e-3, n
    # the perturbation is seen only through the experts' LoRA: merged weights explain the change
    name, mod = next(iter(experts.items()))
    with torch.no_grad():
        delta = mod.get_delta_weight("default")
    assert delta.shape == mod.get_base_layer().gate_up_proj.shape or delta.shape == mod.get_base_layer().down_proj.shape


def test_gradients_reach_lora_only(lora):
    model, ids, _ = lora
    _perturb_lora_b(model)  # non-zero B so that A gets gradients too
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    model.eval()
    lora_params = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora_params
    for n, p in lora_params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert p.grad is None, n
    model.zero_grad(set_to_none=True)


def test_save_load_merge(lora, tmp_path):
    model, ids, ref = lora
    _perturb_lora_b(model, seed=5)
    with torch.no_grad():
        adapted = model(ids).logits
    assert (adapted - ref).abs().max() > 1e-3
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == sorted(EXPERT_TARGET_PARAMETERS)
    assert saved["task_type"] == "CAUSAL_LM"

    fresh = peft.PeftModel.from_pretrained(_base(), tmp_path / "adapter").eval()
    with torch.no_grad():
        reloaded = fresh(ids).logits
    # same fp32 weights (saved and read back unchanged), same code, same inputs: bit-equal
    assert torch.equal(reloaded, adapted)

    merged = fresh.merge_and_unload()
    assert type(merged) is Glm53FlashForCausalLM
    assert not any("lora_" in n or "base_layer" in n for n, _ in merged.named_parameters())
    base_sd = _base().state_dict()
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert not torch.equal(merged.state_dict()[key], base_sd[key])  # the expert delta was merged in
    with torch.no_grad():
        out = merged(ids).logits
    # Claim: the merged model computes the adapted model's maths in fp32 by other operations (W + s B A rounded once
    # per weight, then one product instead of two). Bound: 4x the adapted fp32 model's own error against its float64
    # evaluation (transformers' batched_mm experts: grouped_mm has no float64).
    adapted64 = copy.deepcopy(model).double()
    adapted64.base_model.model.set_experts_implementation("batched_mm")
    with torch.no_grad():
        exact = adapted64(ids).logits
    assert rel_err(out, exact) <= fp64_error_tol(adapted, exact)


def test_auto_peft_remote_code(tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny = str(tmp_path / "tiny")
    make_tiny(tiny, dtype="float32", show_progress=False)
    base = AutoModelForCausalLM.from_pretrained(tiny, trust_remote_code=True, dtype=torch.float32)
    assert type(base).__module__.startswith("transformers_modules")
    model = peft.get_peft_model(base, default_lora_config(r=2))
    _perturb_lora_b(model, seed=7)
    model.eval()
    ids = _ids(seed=8, shape=(1, 9))
    with torch.no_grad():
        expected = model(ids).logits
    adapter = str(tmp_path / "adapter")
    model.save_pretrained(adapter)
    assert json.loads(open(os.path.join(adapter, "adapter_config.json")).read())["base_model_name_or_path"] == tiny

    loaded = AutoPeftModelForCausalLM.from_pretrained(adapter, trust_remote_code=True, dtype=torch.float32).eval()
    assert isinstance(loaded, peft.PeftModelForCausalLM)
    with torch.no_grad():
        got = loaded(ids).logits
    # same fp32 weights read back, the same remote code, same inputs: bit-equal
    assert torch.equal(got, expected)


def test_vl_adapter_loads_through_auto_peft_model_and_as_causal_lm(tmp_path, monkeypatch):
    """An adapter trained on the VL model (LoRA + ``modules_to_save=["lm_head"]``, as the finetune job trains it),
    relabelled by ``mark_vl_adapter`` and copied by ``write_causal_lm_adapter``: ``AutoPeftModel`` (VL) and
    ``AutoPeftModelForCausalLM`` (causal LM) load every tensor (no warning) and give the in-process adapter model's
    logits and its ``merge_and_unload()``'s (float32). PEFT's own save labels the VL adapter ``CAUSAL_LM``:
    ``AutoPeftModelForCausalLM`` then builds the causal LM and warns about missing adapter keys."""
    from peft import AutoPeftModel, AutoPeftModelForCausalLM
    from transformers import AutoModelForImageTextToText

    from glm53flash_hf.train.adapters import mark_vl_adapter, write_causal_lm_adapter

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny = str(tmp_path / "tiny")
    make_tiny(tiny, dtype="float32", show_progress=False)
    base = AutoModelForImageTextToText.from_pretrained(tiny, trust_remote_code=True, dtype=torch.float32).eval()
    ids = _ids(seed=10, shape=(1, 9))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    model = peft.get_peft_model(base, default_lora_config(r=2, modules_to_save=["lm_head"]))
    _perturb_lora_b(model, seed=9)
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    vl_dir, text_dir = str(tmp_path / "adapter-vl"), str(tmp_path / "adapter")
    model.save_pretrained(vl_dir)
    with torch.no_grad():
        merged = copy.deepcopy(model).merge_and_unload()(input_ids=ids).logits
    assert (merged - base_logits).abs().max() > 0.05  # the adapter changes the logits

    with pytest.warns(UserWarning, match="missing adapter keys"):  # PEFT's save as it is: the causal LM is built
        AutoPeftModelForCausalLM.from_pretrained(vl_dir, trust_remote_code=True, dtype=torch.float32)

    mark_vl_adapter(vl_dir)
    assert write_causal_lm_adapter(vl_dir, text_dir) == len(peft.get_peft_model_state_dict(model))
    for cls, folder, base_class in ((AutoPeftModel, vl_dir, "Glm53FlashForConditionalGeneration"),
                                    (AutoPeftModelForCausalLM, text_dir, "Glm53FlashForCausalLM")):
        saved = json.loads(open(os.path.join(folder, "adapter_config.json")).read())
        assert saved["base_model_name_or_path"] == tiny
        with no_warnings():
            loaded = cls.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
        assert type(loaded.get_base_model()).__name__ == base_class
        with torch.no_grad():
            got = loaded.eval()(input_ids=ids).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(got, merged, rtol=0, atol=1e-5)


def test_adapter_conversion_refuses_what_it_cannot_place(tmp_path):
    """Keys outside the language model and the LM head (the vision tower's) have no place in the causal LM; a
    causal-LM adapter is not relabelled as the VL model's; a folder without its safetensors file is named."""
    from safetensors.torch import save_file

    from glm53flash_hf.train.adapters import causal_lm_adapter_key, mark_vl_adapter, write_causal_lm_adapter

    assert causal_lm_adapter_key("base_model.model.model.language_model.layers.0.mlp.up_proj.lora_A.weight") == \
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    assert causal_lm_adapter_key("base_model.model.lm_head.weight") == "base_model.model.lm_head.weight"
    with pytest.raises(ValueError, match="visual.blocks.0.attn.qkv.lora_A.weight.* has no module"):
        causal_lm_adapter_key("base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight")

    config = default_lora_config(r=2)
    config.base_model_name_or_path = "base"
    for name, key in (("vl", "base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight"),
                      ("text", "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight")):
        folder = str(tmp_path / name)
        config.save_pretrained(folder)
        save_file({key: torch.zeros(2, 3)}, os.path.join(folder, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="has no module"):
        write_causal_lm_adapter(str(tmp_path / "vl"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(ValueError, match="not an adapter of the VL model"):
        mark_vl_adapter(str(tmp_path / "text"))
    assert json.loads((tmp_path / "text" / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    os.remove(tmp_path / "text" / "adapter_model.safetensors")
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors is missing"):
        write_causal_lm_adapter(str(tmp_path / "text"), str(tmp_path / "out"))


def test_kv_b_proj_lora_reaches_the_absorbed_attention():
    """MLA uses kv_b_proj's weight in the absorbed form; a LoRA on it must change outputs and get gradients."""
    base = _base()
    model = peft.get_peft_model(base, default_lora_config(r=4, target_modules=("kv_b_proj",), experts=False))
    ids = _ids()
    with torch.no_grad():
        before = model(ids).logits
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "kv_b_proj.lora_B" in name:
                p.normal_(0, 0.5)
    model.train()
    out = model(ids, labels=ids)
    out.loss.backward()
    assert (out.logits.detach() - before).abs().max() > 1e-4
    grads = {n: p.grad for n, p in model.named_parameters() if "kv_b_proj.lora_" in n}
    assert grads and all(g is not None and g.abs().max() > 0 for g in grads.values())
