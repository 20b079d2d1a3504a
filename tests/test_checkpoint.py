"""Loading the published layout in all its variants, FP8 on CPU, strict key accounting, canonical save.

Fixture: a randomised tiny ``Glm53FlashForCausalLM`` (``configuration/tiny.json``: KDA, full and shared DSA, dense
and MoE MLP, MTP) saved with our ``save_pretrained`` in 13 shards (the canonical published layout), rewritten with
safetensors into each key-prefix variant (text under ``model.language_model.`` / ``language_model.`` / ``model.`` /
none; a few fake vision tensors under ``model.visual.`` / ``visual.`` / ``vision_tower.``), bf16 and FP8 (the keys
of ``fp8.fp8_keys_of`` as e4m3 with ``_scale_inv`` placed in the *next* shard).

FP8 bound (``ckpt_fixtures.fp8_error_bound``): e4m3 keeps 3 mantissa bits, so rounding ``x/s`` to nearest errs by
at most ``2^-4 |x/s|`` for normal values and ``2^-10`` below the smallest normal 2^-6 (subnormal spacing 2^-9);
scaled back, ``|deq - x| <= max(2^-4 |x|, 2^-10 s)`` per element, plus ``2^-22 |x|`` for the two fp32 operations.
"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch
from ckpt_fixtures import (
    CANONICAL_TEXT,
    VARIANTS,
    bf16_model,
    edit_shard,
    expected_in_memory,
    fp8_error_bound,
    read_all,
    read_index,
    save_canonical,
    tiny_config,
    write_variant,
)

from glm53flash_hf.fp8_blockwise import dequantize_fp8_blockwise
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM, Glm53FlashTextModel

MTP = 6  # tiny.json: num_hidden_layers 6, one MTP layer at layers.6


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    canonical = save_canonical(bf16_model(), root / "canonical")
    out = {"canonical": canonical}
    for text, vision in VARIANTS:
        for fp8 in (False, True):
            name = f"{text or 'none'}|{vision}|{'fp8' if fp8 else 'bf16'}"
            out[(text, fp8)] = write_variant(canonical, str(root / name.replace("|", "_")), text, vision, fp8=fp8)
    return out


@pytest.fixture(scope="module")
def reference(ckpts):
    """The canonical bf16 checkpoint loaded as is (bf16 and fp32)."""
    load = Glm53FlashForCausalLM.from_pretrained
    return {dt: load(ckpts["canonical"], dtype=dt).state_dict() for dt in (torch.bfloat16, torch.float32)}


def _load(path, cls=Glm53FlashForCausalLM, dtype=torch.bfloat16, **kw):
    """``from_pretrained`` with FP8 checkpoints dequantized (the FP8-kept load is tested in test_fp8_kept.py)."""
    return cls.from_pretrained(path, dtype=dtype, dequantize_fp8=True, **kw)


def _dequantized_file(folder) -> dict[str, torch.Tensor]:
    """File tensors of a (possibly FP8) folder with FP8 weights dequantized to fp32 and scales removed."""
    raw = read_all(folder)
    out = {}
    for k, v in raw.items():
        if k.endswith("_scale_inv"):
            continue
        fp8 = v.dtype == torch.float8_e4m3fn
        out[k] = dequantize_fp8_blockwise(v, raw[k + "_scale_inv"], torch.float32) if fp8 else v
    return out


@pytest.mark.parametrize("text,vision", VARIANTS)
def test_bf16_prefix_variants_load_same_weights(ckpts, reference, text, vision, caplog):
    with caplog.at_level(logging.INFO):
        model = _load(ckpts[(text, False)])
    sd = model.state_dict()
    assert sd.keys() == reference[torch.bfloat16].keys()
    for k, v in reference[torch.bfloat16].items():
        assert v.dtype == sd[k].dtype and torch.equal(v, sd[k]), k
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "4 vision-tower tensors" in lines[0], lines


@pytest.mark.parametrize("text,vision", VARIANTS)
def test_text_model_loads_every_variant(ckpts, reference, text, vision, caplog):
    """AutoModel's class: text keys under any prefix; vision and lm_head skipped and reported in one line."""
    for fp8 in (False, True):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            model = _load(ckpts[(text, fp8)], Glm53FlashTextModel, torch.float32)
        sd = model.state_dict()
        ref = {k.removeprefix("model."): v for k, v in reference[torch.float32].items() if k.startswith("model.")}
        assert sd.keys() == ref.keys()
        for k, v in ref.items():
            if fp8:
                assert v.dtype == sd[k].dtype, k
            else:
                assert torch.equal(v, sd[k]), k
        lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
        assert len(lines) == 1 and "4 vision-tower tensors and 1 lm_head tensors" in lines[0], lines
    # FP8: the text model reads the top-level quantization_config too (its config is only text_config)
    fp8_model = _load(ckpts[(text, True)], Glm53FlashTextModel, torch.float32)
    causal = _load(ckpts[(text, True)], Glm53FlashForCausalLM, torch.float32)
    for k, v in fp8_model.state_dict().items():
        assert torch.equal(v, causal.state_dict()["model." + k]), k


def test_fp8_variants_load_exactly_dequantized(ckpts, reference):
    """Every FP8 variant (scales in other shards than their weights) loads the same weights; each parameter
    equals the file's tensors dequantized (per expert, before the expert merge) bit for bit, non-FP8 tensors
    pass through untouched, dtypes match a bf16 load, and quantization_config is gone."""
    canonical_fp8 = ckpts[(CANONICAL_TEXT, True)]
    index = read_index(canonical_fp8)["weight_map"]
    moved = [k for k in index if k.endswith("_scale_inv") and index[k] != index[k[: -len("_scale_inv")]]]
    assert len(moved) > 150  # scales really sit in other shards
    files = _dequantized_file(canonical_fp8)
    loaded = {}
    for text, _ in VARIANTS:
        model = _load(ckpts[(text, True)], dtype=torch.float32)
        assert getattr(model.config, "quantization_config", None) is None
        assert not getattr(model, "is_quantized", False)
        loaded[text] = model.state_dict()
    first = loaded[CANONICAL_TEXT]
    for text, sd in loaded.items():
        for k in first:
            assert torch.equal(first[k], sd[k]), (text, k)
    n_layers = tiny_config().text_config.num_hidden_layers + 1
    expected = {}
    for i in range(n_layers):
        layer = expected_in_memory(files, f"{CANONICAL_TEXT}layers.{i}.")
        expected.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    expected["model.embed_tokens.weight"] = files[f"{CANONICAL_TEXT}embed_tokens.weight"]
    expected["model.norm.weight"] = files[f"{CANONICAL_TEXT}norm.weight"]
    expected["lm_head.weight"] = files["lm_head.weight"]
    assert expected.keys() == first.keys()
    fp32_ref = reference[torch.float32]
    n_diff = 0
    for k, v in first.items():
        assert v.dtype == fp32_ref[k].dtype, k
        assert torch.equal(v, expected[k].to(v.dtype)), k
        n_diff += not torch.equal(v, fp32_ref[k])
    assert n_diff > 40  # the FP8 parameters differ from the bf16 load; the others are bit-equal (checked above)
    bf16 = _load(canonical_fp8, dtype=torch.bfloat16).state_dict()
    for k, v in reference[torch.bfloat16].items():
        assert bf16[k].dtype == v.dtype, k  # e.g. conv1d stays fp32 (kept-in-fp32 module) under FP8 loading


def test_fp8_dequantization_error_within_e4m3_bound(ckpts):
    source = read_all(ckpts["canonical"])
    raw = read_all(ckpts[(CANONICAL_TEXT, True)])
    checked = 0
    for k, w in raw.items():
        if w.dtype != torch.float8_e4m3fn:
            continue
        s = raw[k + "_scale_inv"]
        deq = dequantize_fp8_blockwise(w, s, torch.float32)
        x = source[k].float()
        err = (deq - x).abs()
        bound = fp8_error_bound(x, s)
        assert (err <= bound).all(), f"{k}: max excess {(err - bound).max().item():.3e}"
        assert err.max() > 0
        checked += 1
    assert checked == 181


# Stored bf16 in the release but kept in fp32 in memory (``_keep_in_fp32_modules_strict``): saved as fp32, the
# same values (the bf16 -> fp32 upcast is exact), as transformers' glm5_next does.
UPCAST_ON_LOAD = ("_conv1d.weight", "mlp.gate.weight")


@pytest.mark.parametrize("text,vision", VARIANTS)
def test_round_trip_writes_canonical_layout_bit_identical(ckpts, text, vision, tmp_path):
    """load (any variant) -> save writes the canonical keys with the file's values; save -> load -> save is
    byte-identical and the reloaded model equals the first one bit for bit."""
    canonical = read_all(ckpts["canonical"])
    model = _load(ckpts[(text, False)])
    model.save_pretrained(tmp_path / "saved", max_shard_size="200KB")
    saved = read_all(tmp_path / "saved")
    assert saved.keys() == canonical.keys()
    upcast = 0
    for k, v in canonical.items():
        if k.endswith(UPCAST_ON_LOAD) and v.dtype == torch.bfloat16:
            assert saved[k].dtype == torch.float32 and torch.equal(saved[k], v.float()), k
            upcast += 1
        else:
            assert saved[k].dtype == v.dtype and torch.equal(saved[k], v), k
    assert upcast == 3 * 3 + 6  # q/k/v conv of the 3 KDA layers, router of 5 MoE layers + MTP
    again = _load(tmp_path / "saved")
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    again.save_pretrained(tmp_path / "saved2", max_shard_size="200KB")
    for name in sorted(os.listdir(tmp_path / "saved")):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            with open(tmp_path / "saved" / name, "rb") as a, open(tmp_path / "saved2" / name, "rb") as b:
                assert a.read() == b.read(), name


def test_fp8_load_saves_dequantized_canonical(ckpts, tmp_path):
    model = _load(ckpts[("", True)])
    model.save_pretrained(tmp_path / "saved")
    saved = read_all(tmp_path / "saved")
    assert saved.keys() == read_all(ckpts["canonical"]).keys()
    assert not any(v.dtype == torch.float8_e4m3fn for v in saved.values())
    with open(tmp_path / "saved" / "config.json") as f:
        assert "quantization_config" not in json.load(f)


@pytest.mark.parametrize("fp8", [False, True])
def test_mtp_parameters_equal_file_tensors(ckpts, fp8):
    folder = ckpts[("language_model.", fp8)]
    model = _load(folder, dtype=torch.float32)
    files = _dequantized_file(folder)
    expected = expected_in_memory(files, f"language_model.layers.{MTP}.")
    params = dict(model.model.layers[MTP].named_parameters())
    params.update(dict(model.model.layers[MTP].named_buffers()))
    assert {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"} <= params.keys()
    assert expected.keys() == params.keys()
    for k, v in expected.items():
        assert torch.equal(params[k], v.to(params[k].dtype)), k


# ------------------------------------------------------------------------------------------------ strictness


@pytest.fixture()
def broken(ckpts, tmp_path):
    """A fresh copy of the canonical bf16 checkpoint to damage."""
    return write_variant(ckpts["canonical"], str(tmp_path / "broken"), vision_prefix=None)


def test_missing_key_raises_and_opt_out_warns(broken, caplog):
    key = f"{CANONICAL_TEXT}layers.{MTP}.enorm.weight"
    edit_shard(broken, key, None)
    with pytest.raises(ValueError, match=r"1 keys missing from the checkpoint .*model\.layers\.6\.enorm\.weight"):
        _load(broken)
    with caplog.at_level(logging.WARNING):
        model = _load(broken, allow_missing_keys=True)
    assert any("model.layers.6.enorm.weight" in r.getMessage() and "allowed" in r.getMessage() for r in caplog.records)
    assert model.model.layers[MTP].enorm.weight.shape == (64,)


def test_unexpected_key_raises_and_opt_out_warns(broken, caplog):
    extra = {f"{CANONICAL_TEXT}layers.0.self_attn.bogus.weight": torch.zeros(3, dtype=torch.bfloat16)}
    edit_shard(broken, "lm_head.weight", read_all(broken)["lm_head.weight"], add=extra)
    with pytest.raises(ValueError, match=r"unexpected in the checkpoint .*layers\.0\.self_attn\.bogus\.weight"):
        _load(broken)
    with caplog.at_level(logging.WARNING):
        _load(broken, allow_unexpected_keys=True)
    assert any("bogus" in r.getMessage() and "allowed" in r.getMessage() for r in caplog.records)


def test_integer_tensor_outside_the_model_is_an_unexpected_key(broken):
    """An integer tensor no weight takes is reported as an unexpected key (as transformers reports it), not refused as
    a cast weight; one that loads into a weight is refused (tests/test_load_checks.py)."""
    extra = {"step_counter": torch.tensor([1, 2])}
    edit_shard(broken, "lm_head.weight", read_all(broken)["lm_head.weight"], add=extra)
    with pytest.raises(ValueError, match=r"1 keys unexpected in the checkpoint .*step_counter"):
        _load(broken)
    _, info = _load(broken, output_loading_info=True)
    assert "step_counter" in info["unexpected_keys"] and not info["missing_keys"]


def test_state_dict_without_checkpoint_initialises_missing_weights(ckpts, caplog):
    """from_pretrained(None, config=..., state_dict=...) initialises what the dict lacks and warns, as transformers;
    a checkpoint folder missing a key still raises (test_missing_key_raises_and_opt_out_warns)."""
    config = Glm53FlashForCausalLM.config_class.from_pretrained(ckpts["canonical"])
    with caplog.at_level(logging.WARNING):
        model = Glm53FlashForCausalLM.from_pretrained(None, config=config, state_dict={})
    assert any("missing from the checkpoint" in r.getMessage() for r in caplog.records)
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())


def test_many_missing_keys_listed_first_20_and_count(broken):
    index = read_index(broken)["weight_map"]
    for k in [k for k in index if k.startswith((f"{CANONICAL_TEXT}layers.2.", f"{CANONICAL_TEXT}layers.4."))]:
        edit_shard(broken, k, None)
    with pytest.raises(ValueError, match=r"keys missing .*\.\.\. \((\d+) in all\)") as e:
        _load(broken)
    total = int(re.search(r"\((\d+) in all\)", str(e.value)).group(1))
    assert total > 40 and str(e.value).count("model.layers.") == 20


def test_shape_mismatch_names_key_and_both_shapes(broken, caplog):
    """A shape the config-vs-header check does not cover (tests/test_load_checks.py) is reported after the load."""
    edit_shard(broken, f"{CANONICAL_TEXT}layers.2.self_attn.q_a_layernorm.weight", torch.ones(33, dtype=torch.bfloat16))
    match = r"model\.layers\.2\.self_attn\.q_a_layernorm\.weight: checkpoint \(33,\) vs model \(32,\)"
    with pytest.raises(ValueError, match=match):
        _load(broken)
    with caplog.at_level(logging.WARNING):
        _load(broken, ignore_mismatched_sizes=True)
    assert any(re.search(match, r.getMessage()) for r in caplog.records)


def test_truncated_shard_names_the_file(broken):
    shard = os.path.join(broken, read_index(broken)["weight_map"]["lm_head.weight"])
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=rf"{os.path.basename(shard)}: corrupt or truncated safetensors file"):
        _load(broken)


def test_corrupt_header_names_the_file(broken):
    shard = os.path.join(broken, read_index(broken)["weight_map"][f"{CANONICAL_TEXT}norm.weight"])
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage{{")
    with pytest.raises(ValueError, match=rf"{os.path.basename(shard)}: corrupt or truncated"):
        _load(broken)


def test_missing_shard_file_named(broken):
    shard = os.path.join(broken, read_index(broken)["weight_map"]["lm_head.weight"])
    os.remove(shard)
    with pytest.raises(ValueError, match=rf"{os.path.basename(shard)}: checkpoint shard not found"):
        _load(broken)


def test_fp8_weight_without_scale_raises(ckpts, tmp_path):
    folder = write_variant(ckpts["canonical"], str(tmp_path / "q"), fp8=True)
    key = f"{CANONICAL_TEXT}layers.1.mlp.experts.3.up_proj.weight"
    edit_shard(folder, key + "_scale_inv", None)
    with pytest.raises(ValueError, match=r"FP8 tensors have no _scale_inv .*" + re.escape(key)):
        _load(folder)


def test_fp8_without_quantization_config_raises(ckpts, tmp_path):
    folder = write_variant(ckpts["canonical"], str(tmp_path / "q"), fp8=True)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"FP8 tensors .* quantization_config=None"):
        _load(folder)


def test_fp8_partial_blocks_rejected_before_transformers_misreads_them(tmp_path):
    """transformers' Fp8Dequantize infers the block as rows // scale_rows: for 192 rows in two 128-blocks it
    would use 96-row blocks. We refuse such a checkpoint with a message naming the key (the release's FP8 weights
    are all multiples of 128; glm53flash-crop dequantizes partial blocks exactly)."""
    model = bf16_model(tiny_config(intermediate_size=192))
    canonical = save_canonical(model, tmp_path / "c")
    folder = write_variant(canonical, str(tmp_path / "q"), fp8=True)
    message = r"layers\.0\.mlp\.(gate|up|down)_proj\.weight: weight \[\d+, \d+\] has a partial 128-block"
    with pytest.raises(ValueError, match=message):
        _load(folder)


def test_text_model_saves_its_own_names_and_reloads(ckpts, tmp_path):
    """The text model's prefix renaming is load-only: it saves the published per-layer layout under its own
    names (``layers.N.…``, no prefix, no lm_head), which both text-only classes read back."""
    model = _load(ckpts[("language_model.", False)], Glm53FlashTextModel)
    model.save_pretrained(tmp_path / "t")
    saved = read_all(tmp_path / "t")
    canonical = read_all(ckpts["canonical"])
    assert saved.keys() == {k.removeprefix(CANONICAL_TEXT) for k in canonical if k.startswith(CANONICAL_TEXT)}
    for k, v in saved.items():
        assert torch.equal(v, canonical[CANONICAL_TEXT + k].to(v.dtype)), k
    again = _load(tmp_path / "t", Glm53FlashTextModel).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(again[k], v), k
    causal = _load(tmp_path / "t", allow_missing_keys=True)  # no lm_head in a text-model folder
    for k, v in model.state_dict().items():
        assert torch.equal(causal.state_dict()["model." + k], v), k


def test_fp8_subfolder_load(ckpts, tmp_path):
    import shutil

    shutil.copytree(ckpts[(CANONICAL_TEXT, True)], tmp_path / "repo" / "weights")
    for cls in (Glm53FlashTextModel, Glm53FlashForCausalLM):
        model = cls.from_pretrained(tmp_path / "repo", subfolder="weights", dtype=torch.float32, dequantize_fp8=True)
        assert getattr(model.config, "quantization_config", None) is None


def test_checkpoint_without_mtp_layer_explains_the_fix(tmp_path):
    """transformers' built-in class drops the MTP layer on save but keeps num_nextn_predict_layers in the config."""
    from tiny import hf_reference

    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
    from glm53flash_hf.tools.export import export

    hf = hf_reference(seed=3, text_overrides={"num_nextn_predict_layers": 1})
    hf.save_pretrained(tmp_path / "builtin")
    with pytest.raises(ValueError, match="no weights for the MTP layer.*num_nextn_predict_layers = 0"):
        Glm53FlashForCausalLM.from_pretrained(tmp_path / "builtin")
    with pytest.warns(UserWarning, match="no MTP layer"):
        export(str(tmp_path / "builtin"), str(tmp_path / "exported"), show_progress=False)
    model = Glm53FlashForCausalLM.from_pretrained(tmp_path / "exported")
    assert model.config.text_config.num_nextn_predict_layers == 0


def test_missing_expert_tensor_is_explained(broken):
    """A missing per-expert tensor shows up as a short fused expert stack; the message says so."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        edit_shard(broken, f"{CANONICAL_TEXT}layers.1.mlp.experts.3.{proj}.weight", None)
    with pytest.raises(ValueError, match=r"holds 7 per-expert tensors for this layer, the config says 8 experts"):
        _load(broken)
