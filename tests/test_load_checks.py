"""Loading checks that run before (or right after) transformers' loader: a config that does not describe the files,
NaN/Inf weights, ambiguous or malformed index files, damaged files, special-token ids outside the vocabulary.

Fixture: the randomised tiny causal LM (``configuration/tiny.json``: 6 layers + MTP, 8 experts, hidden 64, vocab
2048) saved once in 12 shards and once as a single ``model.safetensors``; each test damages a copy (edited JSON or
one rewritten tensor). The dtype checks (an integer or bool tensor in a checkpoint or a ``load_state_dict``) use the
randomised fp32 tiny LM saved in 14 shards (:func:`shared_fixtures.sharded_lm_folder`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time

import pytest
import shared_fixtures
import torch
from ckpt_fixtures import INDEX, bf16_model, edit_shard, read_all, read_index, save_canonical, tiny_config
from shared_fixtures import logits_of as _logits

from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

random_lm, sharded_lm_folder = shared_fixtures.random_lm, shared_fixtures.sharded_lm_folder  # fixtures

P = "model.language_model."
SHARD = r"model-\d{5}-of-\d{5}\.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("load_checks")
    model = bf16_model()
    sharded = save_canonical(model, root / "sharded")
    single = str(root / "single")
    model.save_pretrained(single, max_shard_size="100MB")
    assert os.path.isfile(os.path.join(single, "model.safetensors")) and len(read_index(sharded)["weight_map"]) > 100
    return {"sharded": sharded, "single": single}


@pytest.fixture()
def folder(saved, tmp_path):
    """A fresh copy of the sharded checkpoint."""
    return str(shutil.copytree(saved["sharded"], tmp_path / "ckpt"))


def _edit_config(folder, **text_fields):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["text_config"].update(text_fields)
    with open(path, "w") as f:
        json.dump(config, f)


# ------------------------------------------------------------------------------------------------ config vs headers


LAYERS = 100_000


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(hidden_size=10**9),
            rf"{P}embed_tokens\.weight \({SHARD} in .*\) has shape \[2048, 64\], the config implies "
            r"\[2048, 1000000000\] \(dim 1: hidden_size=1000000000\)",
        ),
        (
            dict(vocab_size=10**12),
            rf"{P}embed_tokens\.weight \({SHARD} in .*\) has shape \[2048, 64\], the config implies "
            r"\[1000000000000, 64\] \(dim 0: vocab_size=1000000000000\)",
        ),
        (
            dict(
                num_hidden_layers=LAYERS,
                layer_types=["linear_attention"] * LAYERS,
                mlp_layer_types=["sparse"] * LAYERS,
                indexer_types=["full"] * LAYERS,
            ),
            rf"num_hidden_layers={LAYERS} and num_nextn_predict_layers=1 mean layers 0\.\.{LAYERS}, the checkpoint "
            r"holds layers 0\.\.6 \(7 layers\)",
        ),
    ],
    ids=["hidden_size", "vocab_size", "num_hidden_layers"],
)
def test_config_far_larger_than_the_checkpoint_fails_fast(folder, fields, match):
    """Each of these allocated 128 GB / 128 TB or ran for minutes before transformers' shape check; the headers
    tell at once."""
    _edit_config(folder, **fields)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder)
    assert time.perf_counter() - start < 5


def test_config_object_is_checked_and_mismatch_opt_out_warns(folder, caplog):
    """The config the loader gets (``config=``) is the one compared; ``ignore_mismatched_sizes=True`` warns."""
    config = tiny_config(moe_intermediate_size=48)
    match = (
        rf"{P}layers\.1\.mlp\.experts\.0\.(gate|up)_proj\.weight \({SHARD} in .*\) has shape \[32, 64\], the config "
        r"implies \[48, 64\] \(dim 0: moe_intermediate_size=48\)"
    )
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder, config=config)
    with caplog.at_level(logging.WARNING):
        model = Glm53FlashForCausalLM.from_pretrained(folder, config=config, ignore_mismatched_sizes=True)
    assert any(re.search(match, r.getMessage()) and "ignore_mismatched_sizes=True" in r.getMessage()
               for r in caplog.records)
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (8, 96, 64)


def test_every_size_field_has_a_config_rule():
    """Each text-config size field the loader reads before building the model is checked by a rule of the table."""
    from glm53flash_hf.checkpoint_checks import _SIZE_FIELDS, CONFIG_RULES

    checked = {name for fields, _ in CONFIG_RULES for name in fields}
    assert set(_SIZE_FIELDS) <= checked, sorted(set(_SIZE_FIELDS) - checked)


def test_shared_expert_width_names_both_fields(folder):
    _edit_config(folder, n_shared_experts=2)
    match = (
        rf"{P}layers\.1\.mlp\.shared_experts\.(gate|up)_proj\.weight \({SHARD} in .*\) has shape \[32, 64\], the "
        r"config implies \[64, 64\] \(dim 0: moe_intermediate_size=32 \* n_shared_experts=2 = 64\)"
    )
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder)


def test_fewer_experts_in_config_than_in_checkpoint(folder):
    _edit_config(folder, n_routed_experts=4)
    with pytest.raises(ValueError, match=r"n_routed_experts=4, the checkpoint holds experts 0\.\.7 in layer 1"):
        Glm53FlashForCausalLM.from_pretrained(folder)


def test_one_expert_tensor_of_a_wrong_shape_names_key_and_file(folder):
    key = f"{P}layers.1.mlp.experts.3.up_proj.weight"
    shard = read_index(folder)["weight_map"][key]
    edit_shard(folder, key, torch.zeros(33, 64, dtype=torch.bfloat16))
    match = (
        rf"{re.escape(key)} \({re.escape(shard)} in .*\) has shape \[33, 64\], the config implies \[32, 64\] "
        r"\(dim 0: moe_intermediate_size=32\)"
    )
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder)


def test_one_missing_up_proj_names_key_and_file(folder):
    key = f"{P}layers.1.mlp.experts.3.up_proj.weight"
    gate_shard = read_index(folder)["weight_map"][f"{P}layers.1.mlp.experts.3.gate_proj.weight"]
    edit_shard(folder, key, None)
    match = (
        rf"1 per-expert tensors missing from the checkpoint .*: {re.escape(key)} \(1\); the checkpoint holds 7 "
        rf"per-expert tensors for this layer, the config says 8 experts \(n_routed_experts=8\); the layer's other "
        rf"expert tensors are in .*{re.escape(gate_shard)}"
    )
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder)


# ------------------------------------------------------------------------------------------------ NaN / Inf


def test_nan_in_a_weight_raises_and_opt_out_loads_it(folder, caplog):
    key = f"{P}norm.weight"
    tensor = read_all(folder)[key].clone()
    tensor[3] = float("nan")
    edit_shard(folder, key, tensor)
    match = r"1 loaded weights hold NaN or Inf values: model\.norm\.weight \(1 NaN, 0 Inf; first at index \(3,\)\)"
    with pytest.raises(ValueError, match=match + r".*allow_nonfinite_weights=True"):
        Glm53FlashForCausalLM.from_pretrained(folder)
    with caplog.at_level(logging.WARNING):
        model = Glm53FlashForCausalLM.from_pretrained(folder, allow_nonfinite_weights=True)
    assert any(re.search(match, r.getMessage()) for r in caplog.records)
    weight = model.model.norm.weight
    assert torch.isnan(weight[3]) and torch.equal(weight[:3], tensor[:3].to(weight.dtype))


def test_inf_in_one_expert_is_located_in_the_fused_stack(folder):
    """Expert 2's up_proj [0, 0] lands at gate_up_proj[2, moe_intermediate_size + 0, 0]."""
    key = f"{P}layers.1.mlp.experts.2.up_proj.weight"
    tensor = read_all(folder)[key].clone()
    tensor[0, 0] = float("-inf")
    edit_shard(folder, key, tensor)
    match = r"model\.layers\.1\.mlp\.experts\.gate_up_proj \(0 NaN, 1 Inf; first at index \(2, 32, 0\)\)"
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder)


# ------------------------------------------------------------------------------------------------ index and files


def test_index_listing_a_key_twice_is_refused(folder):
    path = os.path.join(folder, INDEX)
    index = read_index(folder)
    shard = index["weight_map"]["lm_head.weight"]
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != shard)
    text = open(path).read()
    # json.load keeps the last of two equal names: the duplicate goes first, the original (correct) entry after it
    text = text.replace('"weight_map": {', f'"weight_map": {{\n    "lm_head.weight": "{other}",', 1)
    with open(path, "w") as f:
        f.write(text)
    assert json.loads(text)["weight_map"]["lm_head.weight"] == shard
    match = rf"{re.escape(INDEX)}: 'lm_head\.weight' is listed twice \('{other}' and '{shard}'\)"
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder)


def _add_to_shard(folder, shard, tensors) -> None:
    """Write ``tensors`` into ``shard`` beside its own, leaving the index as it is."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = os.path.join(folder, shard)
    with safe_open(path, framework="pt") as f:
        content = {k: f.get_tensor(k) for k in f.keys()}
    save_file({**content, **tensors}, path, metadata={"format": "pt"})


def test_key_in_two_shards_is_refused_naming_both_files(folder):
    """The index names one shard for a tensor, another indexed shard holds a different copy: transformers reads every
    tensor of every indexed shard (the later shard's copy would be loaded, silently); every loader path refuses."""
    from transformers import AutoModelForCausalLM

    key = f"{P}embed_tokens.weight"
    weight_map = read_index(folder)["weight_map"]
    named = weight_map[key]
    later = [s for s in sorted(set(weight_map.values())) if s > named]
    assert later, "the test needs an indexed shard read after the named one"
    copy = read_all(folder)[key] + 1
    _add_to_shard(folder, later[-1], {key: copy})
    match = (
        rf"'{re.escape(key)}' is stored twice: in {re.escape(os.path.join(folder, named))} \(the shard "
        rf"model\.safetensors\.index\.json names\) and in {re.escape(os.path.join(folder, later[-1]))}"
    )
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder)
    with pytest.raises(ValueError, match=match):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)


def test_tensor_the_index_does_not_list_is_refused(folder):
    """A shard holding a tensor the index does not list: transformers would load it without the checks that read the
    index (config against headers, dtypes)."""
    index = read_index(folder)
    key = next(k for k in sorted(index["weight_map"]) if k.endswith(".post_attention_layernorm.weight"))
    shard = index["weight_map"].pop(key)
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(index, f)
    match = (
        rf"{re.escape(os.path.join(folder, shard))} holds 1 tensors that model\.safetensors\.index\.json does not "
        rf"list: {re.escape(key)}"
    )
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder)


def test_single_file_beside_an_index_is_refused_naming_both(folder, saved):
    """transformers loads model.safetensors when both exist and ignores the index: the folder is ambiguous."""
    shutil.copy(os.path.join(saved["single"], "model.safetensors"), folder)
    match = (
        rf"{re.escape(folder)} holds both model\.safetensors and model\.safetensors\.index\.json: transformers would "
        rf"load {re.escape(os.path.join(folder, 'model.safetensors'))} and ignore the index"
    )
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder)


def test_weight_map_that_is_a_list_names_the_index(folder):
    path = os.path.join(folder, INDEX)
    index = read_index(folder)
    index["weight_map"] = sorted(index["weight_map"].items())
    with open(path, "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match=rf"{re.escape(INDEX)}: 'weight_map' must be an object .*; got list"):
        Glm53FlashForCausalLM.from_pretrained(folder)


def test_corrupt_single_file_is_named(saved, tmp_path):
    folder = str(shutil.copytree(saved["single"], tmp_path / "single"))
    with open(os.path.join(folder, "model.safetensors"), "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage{{")
    with pytest.raises(ValueError, match=r"single/model\.safetensors: corrupt or truncated safetensors file"):
        Glm53FlashForCausalLM.from_pretrained(folder)


def test_truncated_config_json_is_named(folder):
    from transformers import AutoConfig

    path = os.path.join(folder, "config.json")
    text = open(path).read()
    with open(path, "w") as f:
        f.write(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"{re.escape(path)}: not a readable JSON file \(JSONDecodeError"):
        Glm53FlashForCausalLM.from_pretrained(folder)
    # the config classes' own path is transformers' PreTrainedConfig.from_pretrained, which names the file
    for load in (Glm53FlashConfig.from_pretrained, AutoConfig.from_pretrained):
        with pytest.raises(OSError, match=rf"config file at '{re.escape(path)}' is not a valid JSON file"):
            load(folder)


# ------------------------------------------------------------------------------------------------ special tokens


@pytest.mark.parametrize(
    "field, value, what",
    [
        ("eos_token_id", [2000, 5000], "an id or a list of ids"),
        ("eos_token_id", 2048, "an id or a list of ids"),
        ("bos_token_id", 2048, "an id"),
        ("bos_token_id", -1, "an id"),
        ("pad_token_id", 4096, "an id"),
    ],
)
def test_special_token_id_outside_the_vocabulary(folder, field, value, what):
    match = rf"{field} must be None or {what} in \[0, vocab_size=2048\); got {field}={re.escape(repr(value))}"
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM(tiny_config(**{field: value}))
    _edit_config(folder, **{field: value})
    with pytest.raises(ValueError, match=match):
        Glm53FlashForCausalLM.from_pretrained(folder)


def test_special_token_ids_inside_the_vocabulary_build():
    model = Glm53FlashForCausalLM(tiny_config(bos_token_id=0, eos_token_id=[2047, 3], pad_token_id=2047))
    assert model.config.text_config.eos_token_id == [2047, 3]


# ------------------------------------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_integer_or_bool_tensor_in_checkpoint_is_named(sharded_lm_folder, tmp_path, dtype):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(sharded_lm_folder, folder)
    key = "model.language_model.norm.weight"
    edit_shard(folder, key, torch.ones(64, dtype=dtype))
    with pytest.raises(ValueError, match=rf"integer or bool.*{key} \({'I32' if dtype == torch.int32 else 'BOOL'}\)"):
        Glm53FlashForCausalLM.from_pretrained(folder)


def test_load_state_dict_rejects_integer_weights(random_lm):
    state = {"model.norm.weight": torch.ones(64, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight \(torch\.int64, the model holds torch\.float32\)"):
        random_lm.load_state_dict(state, strict=False)


def test_load_state_dict_of_floats_still_loads(random_lm):
    state = {k: v.clone() for k, v in random_lm.state_dict().items()}
    before = _logits(random_lm)
    assert not random_lm.load_state_dict(state).missing_keys
    torch.testing.assert_close(_logits(random_lm), before, rtol=0, atol=0)

