"""Configuration: subclassing transformers' glm5_next configs, new fields, validation messages."""

from __future__ import annotations

import json

import pytest

from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig, Glm53FlashTextConfig, normalize_kernels


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
