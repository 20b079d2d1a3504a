"""``glm53flash-make-tiny``: the embedded default checkpoint (published layout, every layer kind, vision tower,
FP8 variant, tokenizer whose special-token ids match the config, determinism given ``--seed``)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from tiny import read_checkpoint_tensors

from glm53flash_hf.fp8_blockwise import (
    FP8_DTYPE,
    dequantize_fp8_blockwise,
    fp8_keys_of,
    fp8_quantization_config,
    roundtrip_error_bound,
)
from glm53flash_hf.modeling_glm53flash import AUTO_MAP
from glm53flash_hf.tools.make_tiny import (
    DEFAULT_CONFIG,
    DEFAULT_FP8_CONFIG,
    SAMPLING_DEFAULTS,
    SPECIAL_TOKENS,
    TEXT_TAG_TOKENS,
    main,
    make_tiny,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P = "model.language_model.layers."


_tensors = read_checkpoint_tensors


def _digest(folder) -> dict[str, str]:
    return {
        name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(folder))
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny") / "ckpt")
    make_tiny(out, seed=0, show_progress=False)
    return out


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny_fp8") / "ckpt")
    assert main([out, "--fp8", "--seed", "0", "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def tiny_fp8_unquantized(tmp_path_factory):
    """The model of ``--fp8``'s default config, written without FP8."""
    out = str(tmp_path_factory.mktemp("tiny_fp8_unquantized") / "ckpt")
    make_tiny(out, config_path=DEFAULT_FP8_CONFIG, seed=0, show_progress=False)
    return out


def test_every_layer_kind_in_published_layout(tiny):
    config = json.load(open(os.path.join(tiny, "config.json")))
    text = config["text_config"]
    assert config["model_type"] == "glm5_next" and config["auto_map"] == AUTO_MAP
    assert set(text["layer_types"]) == {"linear_attention", "indexed_attention"}
    assert set(text["mlp_layer_types"]) == {"dense", "sparse"}
    assert set(text["indexer_types"]) == {"full", "shared"}
    index = json.load(open(os.path.join(tiny, "model.safetensors.index.json")))
    keys = set(index["weight_map"])
    n = text["num_hidden_layers"]
    assert text["num_nextn_predict_layers"] == 1
    for i in range(n):
        kda = text["layer_types"][i] == "linear_attention"
        for part in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "f_a_proj.weight", "A_log", "dt_bias"):
            assert (f"{P}{i}.self_attn.{part}" in keys) == kda, (i, part)
        assert (f"{P}{i}.self_attn.kv_b_proj.weight" in keys) == (not kda)
        own_indexer = not kda and text["indexer_types"][i] == "full"
        assert (f"{P}{i}.self_attn.indexer.index_kpool_compress_gate" in keys) == own_indexer, i
        moe = text["mlp_layer_types"][i] == "sparse"
        assert (f"{P}{i}.mlp.gate_proj.weight" in keys) == (not moe)
        for e in range(text["n_routed_experts"]):
            assert (f"{P}{i}.mlp.experts.{e}.gate_proj.weight" in keys) == moe
        assert {f"{P}{i}.hc_{s}_{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")} <= keys
    mtp = {k[len(f"{P}{n}.") :] for k in keys if k.startswith(f"{P}{n}.")}
    assert {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
            "self_attn.indexer.wq_b.weight", "mlp.experts.0.down_proj.weight"} <= mtp
    assert not any(k.startswith("hc_") for k in mtp)
    assert {"lm_head.weight", "model.language_model.embed_tokens.weight", "model.language_model.norm.weight"} <= keys
    # The vision tower: every tensor transformers' Glm5NextVisionModel has, under model.visual.
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    from glm53flash_hf import Glm53FlashConfig

    vision = Glm5NextVisionModel(Glm53FlashConfig.from_json_file(DEFAULT_CONFIG).vision_config)
    assert {k for k in keys if k.startswith("model.visual.")} == {f"model.visual.{k}" for k in vision.state_dict()}
    # Index agrees with the shard files, sizes add up, the code files are there.
    tensors = _tensors(tiny)
    assert set(tensors) == keys
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(set(index["weight_map"].values())) == shards
    for module in ("modeling_glm53flash.py", "configuration_glm53flash.py", "kda.py", "dsa.py", "mhc.py", "moe.py"):
        assert os.path.isfile(os.path.join(tiny, module))
    # bf16 as the release, fp32 where the model keeps fp32.
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    assert tensors[f"{P}0.self_attn.A_log"].dtype == torch.float32
    assert tensors[f"{P}1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_tokenizer_special_ids_match_config(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    config = json.load(open(os.path.join(tiny, "config.json")))
    text = config["text_config"]
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    pad = text["pad_token_id"]
    assert pad == 2000
    # Contiguous from pad_token_id in SPECIAL_TOKENS order, and each one a single token.
    assert [ids[t] for t in SPECIAL_TOKENS] == list(range(pad, pad + len(SPECIAL_TOKENS)))
    for t in SPECIAL_TOKENS:
        assert tok(t, add_special_tokens=False).input_ids == [ids[t]], t
    assert len(tok) == pad + len(SPECIAL_TOKENS) <= text["vocab_size"]
    # Every id field of the config, checked by name.
    assert text["pad_token_id"] == ids["<|endoftext|>"] == tok.pad_token_id
    assert text["eos_token_id"] == [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == pad
    assert config["image_token_id"] == ids["<|image|>"]
    assert config["video_token_id"] == ids["<|video|>"]
    assert config["image_start_token_id"] == ids["<|begin_of_image|>"]
    assert config["image_end_token_id"] == ids["<|end_of_image|>"]
    assert config["video_start_token_id"] == ids["<|begin_of_video|>"]
    assert config["video_end_token_id"] == ids["<|end_of_video|>"]
    generation = json.load(open(os.path.join(tiny, "generation_config.json")))
    assert generation["eos_token_id"] == text["eos_token_id"] and generation["pad_token_id"] == pad
    # sampling defaults, so that a server's or pipeline's temperature / top_p are not ignored (do_sample off)
    assert {k: generation.get(k) for k in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS == {
        "do_sample": True, "temperature": 1.0, "top_p": 0.95}
    # Byte-level BPE trained on pydoc_data.topics: lossless, compresses the training text, specials atomic.
    from pydoc_data.topics import topics

    sample = topics["if"][:2000] + " naïve 漢字 🙂"
    encoded = tok(sample, add_special_tokens=False).input_ids
    assert tok.decode(encoded) == sample
    assert max(encoded) < pad and len(encoded) < len(sample.encode()) / 2.5
    prompt = "[gMASK]<sop><|user|>hi<|assistant|><think>why</think>ok"
    assert tok.decode(tok(prompt).input_ids, skip_special_tokens=True) == "hi<think>why</think>ok"
    assert TEXT_TAG_TOKENS == set(SPECIAL_TOKENS[SPECIAL_TOKENS.index("<think>"):])


def test_deterministic_given_seed(tiny, tmp_path):
    again = str(tmp_path / "again")
    make_tiny(again, seed=0, show_progress=False)
    assert _digest(again) == _digest(tiny)
    other = str(tmp_path / "other")
    make_tiny(other, seed=1, show_progress=False)
    a, b = _digest(tiny), _digest(other)
    assert a["tokenizer.json"] == b["tokenizer.json"]
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert a[name] != b[name], name


def test_fp8_default_config_is_the_tiny_config_with_bigger_experts(tiny_fp8):
    """``--fp8`` without ``--config`` builds DEFAULT_FP8_CONFIG (configuration/tiny_fp8.json): the tiny config with
    only the routed experts changed (more and wider), so that the FP8 modules hold most of the bytes."""
    base, fp8 = json.load(open(DEFAULT_CONFIG)), json.load(open(DEFAULT_FP8_CONFIG))
    changed = {k for k in fp8["text_config"] if fp8["text_config"][k] != base["text_config"].get(k)}
    assert changed == {"n_routed_experts", "moe_intermediate_size"}
    assert fp8["text_config"]["n_routed_experts"] > base["text_config"]["n_routed_experts"]
    assert fp8["text_config"]["moe_intermediate_size"] > base["text_config"]["moe_intermediate_size"]
    assert {k: v for k, v in fp8.items() if k != "text_config"} == {k: v for k, v in base.items() if k != "text_config"}
    assert os.path.samefile(os.path.join(REPO, "configuration", "tiny_fp8.json"), DEFAULT_FP8_CONFIG)
    written = json.load(open(os.path.join(tiny_fp8, "config.json")))["text_config"]
    assert {k: written[k] for k in changed} == {k: fp8["text_config"][k] for k in changed}


def test_fp8_variant(tiny_fp8_unquantized, tiny_fp8):
    ref, q = _tensors(tiny_fp8_unquantized), _tensors(tiny_fp8)
    # The vision tower is never FP8 (fp8_keys_of's MLP pattern would also match vision blocks; make-tiny
    # quantizes the text shards only).
    fp8_keys = fp8_keys_of(k for k in ref if not k.startswith("model.visual."))
    assert set(q) == set(ref) | {k + "_scale_inv" for k in fp8_keys}
    # Which tensors: experts, shared experts, dense MLP, 4 DSA/MTP projections; never kv_b_proj, KDA, vision.
    assert f"{P}1.mlp.experts.3.up_proj.weight" in fp8_keys and f"{P}0.mlp.down_proj.weight" in fp8_keys
    assert f"{P}2.self_attn.o_proj.weight" in fp8_keys and f"{P}6.self_attn.q_a_proj.weight" in fp8_keys
    assert f"{P}2.self_attn.kv_b_proj.weight" not in fp8_keys and f"{P}0.self_attn.o_proj.weight" not in fp8_keys
    assert not any("visual" in k or "indexer" in k for k in fp8_keys)
    for key in ref:
        if key not in fp8_keys:
            assert q[key].dtype == ref[key].dtype and torch.equal(q[key], ref[key]), key
            continue
        w, s = q[key], q[key + "_scale_inv"]
        assert w.dtype == FP8_DTYPE and w.shape == ref[key].shape
        assert s.dtype == torch.float32 and s.shape == (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
        # e4m3 bound (fp8_blockwise.roundtrip_error_bound, docs/design.md FP8): half an ulp (3 mantissa bits → 2^-4
        # relative) for normals, 2^-10·scale for subnormals, plus 2^-22 relative for the fp32 x / scale, which can
        # round a value just below a rounding tie onto it (seen: 3.4999999 subnormal spacings, stored as 4).
        source = ref[key].float()
        error = (dequantize_fp8_blockwise(w, s, torch.float32) - source).abs()
        bound = roundtrip_error_bound(source, dequantize_fp8_blockwise(torch.ones_like(w), s, torch.float32))
        assert (error <= bound).all(), key
        assert error.max() > 0, key  # really quantized
    config = json.load(open(os.path.join(tiny_fp8, "config.json")))
    assert config["quantization_config"] == fp8_quantization_config()


def test_config_ids_must_match_tokenizer(tmp_path):
    config = json.load(open(DEFAULT_CONFIG))
    config["image_token_id"] = 2014
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.image_token_id=2014 .*<\|image\|>.*2016"):
        make_tiny(str(tmp_path / "out"), config_path=str(path), show_progress=False)
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_refuses_non_empty_out(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        make_tiny(str(tmp_path), show_progress=False)
    with pytest.raises(ValueError, match="dtype"):
        make_tiny(str(tmp_path / "new"), dtype="float16", show_progress=False)


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("OUT", "--fp8", "--seed", "--config", "--dtype", "--overwrite", "--quiet"):
        assert option in text
    assert "pydoc_data.topics" in text and "_scale_inv" in text
    # The console script works outside pytest too.
    command = [os.path.join(os.path.dirname(sys.executable), "glm53flash-make-tiny"), "--help"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and re.search(r"--fp8", result.stdout), result.stderr
