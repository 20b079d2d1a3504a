"""Configuration: subclassing transformers' glm5_next configs, new fields, validation messages (out-of-range numbers
name the field, the value and the range, also from a ``config.json``)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import shared_fixtures

from glm53flash_hf.configuration_glm53flash import (
    Glm53FlashConfig,
    Glm53FlashTextConfig,
    Glm53FlashVisionConfig,
    normalize_kernels,
)
from glm53flash_hf.modeling_glm53flash import Glm53FlashTextModel

random_lm, sharded_lm_folder = shared_fixtures.random_lm, shared_fixtures.sharded_lm_folder  # fixtures


def test_tiny_config_has_every_layer_kind():
    config = Glm53FlashConfig.from_json_file("configuration/tiny.json")
    text = config.text_config
    assert config.model_type == "glm5_next" and text.model_type == "glm5_next_text"
    assert set(text.layer_types) == {"linear_attention", "indexed_attention"}
    assert set(text.mlp_layer_types) == {"dense", "sparse"}
    dsa = [t for lt, t in zip(text.layer_types, text.indexer_types) if lt == "indexed_attention"]
    assert set(dsa) == {"full", "shared"}
    assert text.num_nextn_predict_layers == 1
    assert text.index_kpool > 1 and text.index_topk % text.index_kpool == 0


def test_release_spellings_and_defaults(tmp_path):
    text = Glm53FlashTextConfig(
        num_hidden_layers=4,
        index_kpool=4,
        layer_types=["linear_attention"] * 3 + ["deepseek_sparse_attention"],
    )
    assert text.layer_types[-1] == "indexed_attention"
    assert text.num_nextn_predict_layers == 0
    assert text.kernels == {"kda": "auto", "mhc": "auto", "dsa": "auto", "moe": "auto"}
    config = Glm53FlashConfig(text_config=text.to_dict())
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "glm5_next"
    assert Glm53FlashConfig.from_pretrained(tmp_path).text_config.kernels["dsa"] == "auto"


def test_kernels_setting():
    assert normalize_kernels("torch")["moe"] == "torch"
    assert normalize_kernels({"kda": "fused"}) == {"kda": "fused", "mhc": "auto", "dsa": "auto", "moe": "auto"}
    with pytest.raises(ValueError, match="kernels"):
        normalize_kernels("gpu")
    with pytest.raises(ValueError, match="unknown families"):
        normalize_kernels({"attention": "torch"})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
        (dict(index_topk=10, index_kpool=4), r"index_topk \(10\).*index_kpool \(4\)"),
        (dict(index_kpool=4, n_routed_experts=10, n_group=4), "n_group"),
        (dict(index_kpool=4, num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(index_kpool=4, hidden_act="gelu"), "hidden_act"),
        (dict(index_kpool=0), "index_kpool must be a positive integer; got index_kpool=0"),
        (dict(index_kpool=4, linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
        (dict(index_kpool=4, hc_mult=0), "hc_mult"),
        (dict(index_kpool=4, hc_sinkhorn_iters=0), "hc_sinkhorn_iters"),
        (dict(index_kpool=4, swiglu_limit=-1.0), "swiglu_limit"),
        (dict(index_kpool=4, num_hidden_layers=2, mlp_layer_types=["dense", "moe"]), "mlp_layer_types"),
        (
            dict(
                index_kpool=4,
                num_hidden_layers=4,
                layer_types=["linear_attention"] * 3 + ["indexed_attention"],
                indexer_types=["full", "full", "full", "shared"],
            ),
            r"indexer_types\[3\]='shared'",
        ),
    ],
)
def test_validation_names_field_and_value(kwargs, match):
    with pytest.raises(Exception, match=match):
        Glm53FlashTextConfig(**kwargs)


def test_moe_names_of_other_configs_resolve(tmp_path):
    """The MoE / MTP names of other transformers MoE configs that clients read (TRL's aux loss reads ``num_experts``,
    transformers' FP8 experts ``num_local_experts``, its MTP drafting ``num_mtp_layers``, TRL's FLOP count
    ``decoder_sparse_step``) give this config's values, on the text config and on the VL config; the aliases set
    their field; derived values reject a contradicting one; nothing extra is saved."""
    config = Glm53FlashConfig.from_json_file("configuration/tiny.json")
    text = config.text_config
    # configuration/tiny.json: 8 routed experts of width 32, 1 shared, top-2, one MTP layer, layer 0 dense
    expected = {
        "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "num_shared_experts": 1,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_mtp_layers": 1, "num_nextn_predict_layers": 1,
        "mlp_only_layers": [0], "decoder_sparse_step": 1, "first_k_dense_replace": 1,
        "router_aux_loss_coef": 0.001, "output_router_logits": False,
    }  # fmt: skip
    for owner in (text, config):
        assert {name: getattr(owner, name) for name in expected} == expected, type(owner).__name__
    config.output_router_logits = True  # what TRL and users set on model.config
    assert text.output_router_logits is True
    text.num_experts = 16
    assert text.n_routed_experts == 16 and config.num_local_experts == 16
    text.num_experts = 8
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not {"num_experts", "num_local_experts", "first_k_dense_replace"} & (set(saved) | set(saved["text_config"]))
    assert Glm53FlashConfig.from_pretrained(tmp_path).text_config.num_experts == 8

    # released configs carry first_k_dense_replace next to mlp_layer_types: accepted when they agree
    released = Glm53FlashTextConfig(index_kpool=4, num_hidden_layers=5, first_k_dense_replace=3)
    assert released.mlp_only_layers == [0, 1, 2]
    with pytest.raises(ValueError, match=r"first_k_dense_replace=2 contradicts the config: .* gives 3"):
        Glm53FlashTextConfig(index_kpool=4, num_hidden_layers=5, first_k_dense_replace=2)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=7"):
        Glm53FlashTextConfig(index_kpool=4, num_hidden_layers=5, shared_expert_intermediate_size=7)
    # no leading-dense layout, no first_k_dense_replace
    mixed = Glm53FlashTextConfig(index_kpool=4, num_hidden_layers=3, mlp_layer_types=["sparse", "dense", "sparse"])
    assert getattr(mixed, "first_k_dense_replace", None) is None and mixed.mlp_only_layers == [1]


# --------------------------------------------------------------------------------------------- validation of bad values


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("rms_norm_eps", 0.0, "a finite number > 0"),
        ("rms_norm_eps", -1e-6, "a finite number > 0"),
        ("rms_norm_eps", float("nan"), "a finite number > 0"),
        ("hidden_size", -64, "a positive integer"),
        ("vocab_size", 0, "a positive integer"),
        ("num_attention_heads", -1, "a positive integer"),
        ("n_shared_experts", -1, "an integer >= 0"),
        ("routed_scaling_factor", 0.0, "a finite number > 0"),
    ],
)
def test_invalid_config_number_names_field_value_and_range(field, value, expected):
    with pytest.raises(ValueError, match=rf"{field} must be {expected}; got {field}={value!r}"):
        Glm53FlashTextConfig(index_kpool=4, **{field: value})


def test_attention_dropout_and_pad_token_ranges():
    with pytest.raises(ValueError, match=r"attention_dropout must be a number in \[0, 1\); got attention_dropout=1.5"):
        Glm53FlashTextConfig(index_kpool=4, attention_dropout=1.5)
    # as transformers' config, the config itself accepts the id (the vocabulary may be cut before the id is set);
    # building a model from it raises
    config = Glm53FlashTextConfig(index_kpool=4, vocab_size=100, pad_token_id=100)
    with pytest.raises(ValueError, match=r"pad_token_id must be None or an id in \[0, vocab_size=100\); got "
                                         r"pad_token_id=100"):
        Glm53FlashTextModel(config)


def test_vision_config_sizes():
    with pytest.raises(ValueError, match="depth must be a positive integer; got depth=0"):
        Glm53FlashVisionConfig(depth=0)
    with pytest.raises(ValueError, match=r"patch_size must be a positive integer .*got patch_size=-14"):
        Glm53FlashVisionConfig(patch_size=-14)


def test_negative_size_in_config_json_names_the_field(sharded_lm_folder, tmp_path):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(sharded_lm_folder, folder)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config["text_config"]["moe_intermediate_size"] = -32
    json.dump(config, open(path, "w"))
    match = "moe_intermediate_size must be a positive integer; got moe_intermediate_size=-32"
    with pytest.raises(ValueError, match=match):
        Glm53FlashConfig.from_pretrained(folder)

