"""Big-model loading: ``from_pretrained(device_map="auto", max_memory=..., offload_folder=...)`` (layers offloaded
to disk, loaded by accelerate's hooks around each module's forward) and ``low_cpu_mem_usage=True`` give the plain
load's logits and greedy tokens.

Model: ``configuration/tiny.json`` (KDA, full and shared DSA, MoE, mHC, MTP, vision tower), randomised, fp32. A
2 MB CPU budget puts the later decoder layers, the final norm and ``lm_head`` on ``"disk"``, so both layer kinds
run offloaded (the KDA conv weight, the absorbed MLA ``kv_b_proj`` and the indexer's cached step read parameters
outside their module's forward: :mod:`glm53flash_hf.offload`).
"""

from __future__ import annotations

import pytest
import torch
from ckpt_fixtures import tiny_config
from tiny import randomize_

from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM, Glm53FlashForConditionalGeneration


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = Glm53FlashForConditionalGeneration(tiny_config()).float()
    randomize_(model, 0)
    folder = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(folder)
    return folder


def _ids(seed=3, length=21):
    return torch.randint(1, 2000, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cls", [Glm53FlashForCausalLM, Glm53FlashForConditionalGeneration])
def test_disk_offloaded_load_equals_plain_load(saved, tmp_path, cls):
    plain = cls.from_pretrained(saved, dtype=torch.float32).eval()
    offloaded = cls.from_pretrained(
        saved, dtype=torch.float32, device_map="auto", max_memory={"cpu": "2MB"}, offload_folder=str(tmp_path)
    ).eval()
    placement = set(offloaded.hf_device_map.values())
    assert placement == {"cpu", "disk"}, offloaded.hf_device_map
    offloaded_layers = {k for k, v in offloaded.hf_device_map.items() if v == "disk" and ".layers." in k}
    kinds = {type(offloaded.get_submodule(k).self_attn).__name__ for k in offloaded_layers}
    assert kinds >= {"Glm53FlashLinearAttention", "Glm53FlashAttention"}, kinds
    ids = _ids()
    with torch.no_grad():
        ref, got = plain(input_ids=ids).logits, offloaded(input_ids=ids).logits
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(offloaded.generate(ids, **kwargs), plain.generate(ids, **kwargs))


def test_low_cpu_mem_usage_load_equals_plain_load(saved):
    plain = Glm53FlashForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    low = Glm53FlashForCausalLM.from_pretrained(saved, dtype=torch.float32, low_cpu_mem_usage=True).eval()
    ids = _ids(4)
    with torch.no_grad():
        assert torch.equal(low(input_ids=ids).logits, plain(input_ids=ids).logits)
