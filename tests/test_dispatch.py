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
