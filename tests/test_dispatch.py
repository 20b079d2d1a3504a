"""Per-call backend choice: torch on CPU tensors, 'fused' without a usable kernel warns once and falls back."""

from __future__ import annotations

import warnings

import pytest
import torch

import glm53flash_hf.dispatch as dispatch
from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig


def test_auto_and_torch_pick_torch_on_cpu():
    x = torch.zeros(2)
    assert dispatch.choose_backend("kda", "auto", x) == "torch"
    assert dispatch.choose_backend("dsa", "torch", x) == "torch"


def test_fused_on_cpu_warns_once_per_reason(monkeypatch):
    dispatch._warned.clear()
    monkeypatch.setitem(dispatch.FUSED_AVAILABILITY, "mhc", lambda *t: (True, ""))
    x = torch.zeros(2)
    with pytest.warns(UserWarning, match="not on a CUDA device"):
        assert dispatch.choose_backend("mhc", "fused", x) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.choose_backend("mhc", "fused", x) == "torch"  # same reason: no second warning


def test_requested_backend_reads_config():
    config = Glm53FlashTextConfig(num_hidden_layers=4, index_kpool=4, kernels={"moe": "torch"})
    assert dispatch.requested_backend(config, "moe") == "torch"
    assert dispatch.requested_backend(config, "kda") == "auto"
    with pytest.raises(ValueError, match="family"):
        dispatch.requested_backend(config, "attention")
    with pytest.raises(ValueError, match="must be one of"):
        dispatch.choose_backend("kda", "triton")


# the op each family's layer reaches (torch path) and the frame the count starts after: the decoder layer's forward
FAMILY_OPS = {
    "kda": "_chunk_kda_core",  # chunk_kda_torch's chunked scan (its custom-op boundary sits between)
    "mhc hc_pre": "hc_pre_torch",
    "mhc hc_post": "hc_post_torch",
    "dsa": "sparse_mla_torch",
    "moe": "experts_forward_torch",
}


@pytest.mark.parametrize("family", sorted(FAMILY_OPS))
def test_frames_from_the_decoder_layer_to_each_family_op(family):
    """In a model forward on the torch path, from the decoder layer's forward to each family's op: at most 3 frames of
    the package's own code below ``Glm53FlashDecoderLayer.forward`` (the family's module, the op). The fused path has
    the same call sites (``op_for`` returns the fused function); its frames to the Triton launch are held in each
    ``tests/test_*_fused.py`` interpreter child. Torch, transformers and test frames are not counted
    (:func:`tiny.package_frames_at`)."""
    from tiny import frames_below_decoder_layer

    target = FAMILY_OPS[family]
    below = frames_below_decoder_layer(lambda code: code.co_name == target)
    print(f"{family}: {' -> '.join(below)}")
    assert below[-1].endswith(target) and len(below) <= 3, below
