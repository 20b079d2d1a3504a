"""transformers' own common model tests (``ModelTesterMixin``) on our models, and the same tester on the built-in.

The mixin comes from the source distribution of the installed transformers version, fetched from the package
registry by ``scripts/fetch_transformers_tests.py`` (``.ci/run`` runs it; the module is skipped, with that reason,
when the tests folder is not there). Tester: ``configuration/tiny.json`` cut to two main layers (KDA, then DSA; dense
and MoE MLP; mHC; the MTP layer), batch 2 x 16
tokens per row holding one image and one video (see the tester). Classes: ``Glm53FlashModel`` and
``Glm53FlashForConditionalGeneration``, the counterparts of the built-in's ``Glm5NextModel`` and
``Glm5NextForConditionalGeneration``, and (text only) our ``Glm53FlashForCausalLM``.

``GLM53FLASH_HF_COMMON_BUILTIN=1`` also runs the identical tester on transformers' built-in classes (same config, same
inputs), which is how the counts of the two are compared; CI runs ours only. Tests that cannot apply to this
architecture are skipped below with the reason.
"""

from __future__ import annotations

import os
import sys
import unittest

import pytest
import torch
from transformers.models.auto import modeling_auto

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from fetch_transformers_tests import tests_folder  # noqa: E402

_TESTS = tests_folder()
if not os.path.isfile(os.path.join(_TESTS, "test_modeling_common.py")):
    pytest.skip(
        f"transformers' common tests are not fetched ({_TESTS}): run python scripts/fetch_transformers_tests.py",
        allow_module_level=True,
    )
pytest.importorskip("parameterized", reason="transformers' common tests need the parameterized package")
sys.path.insert(0, os.path.dirname(_TESTS))

from ckpt_fixtures import tiny_config  # noqa: E402
from parameterized import parameterized  # noqa: E402
from transformers_tests.test_modeling_common import (  # noqa: E402
    TEST_EAGER_MATCHES_SDPA_INFERENCE_PARAMETERIZATION,
    ModelTesterMixin,
    _test_eager_matches_sdpa_inference,
    floats_tensor,
    ids_tensor,
)

from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig, Glm53FlashTextConfig  # noqa: E402
from glm53flash_hf.modeling_glm53flash import (  # noqa: E402
    Glm53FlashForCausalLM,
    Glm53FlashForConditionalGeneration,
    Glm53FlashModel,
    Glm53FlashTextModel,
)

# two main layers (the mixin's test_num_layers_is_small allows at most 2): one KDA, one DSA; dense and MoE MLP
TWO_LAYERS = dict(
    num_hidden_layers=2,
    layer_types=["linear_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse"],
    indexer_types=["full", "full"],
)


class Glm53FlashModelTester:
    def __init__(self, parent, batch_size=2, seq_length=16, is_training=True, builtin=False, text_only=False):
        self.parent = parent
        self.text_only = text_only
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.builtin = builtin
        text = self.get_config().get_text_config()
        self.vocab_size = text.vocab_size
        self.hidden_size = text.hidden_size
        self.num_hidden_layers = text.num_hidden_layers
        self.num_attention_heads = text.num_attention_heads

    def get_config(self):
        config = tiny_config(**TWO_LAYERS)
        if self.builtin:
            from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig

            return Glm5NextConfig(**{k: v for k, v in config.to_dict().items() if k not in ("auto_map",)})
        return config

    def prepare_config_and_inputs_for_common(self):
        """Each row: ``[BOI, 4 image tokens, EOI, BOV, 4 image tokens, EOV, text]``; one 4x4-patch image and one
        two-frame 4x4-patch video per row (merge 2: 4 placeholder tokens each)."""
        config = self.get_config()
        input_ids = ids_tensor([self.batch_size, self.seq_length], 2000)  # text below the special tokens
        if self.text_only:
            return config, {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        image = [config.image_start_token_id] + [config.image_token_id] * 4 + [config.image_end_token_id]
        # a video's placeholders are image tokens inside a video span (glm5_next's get_placeholder_mask)
        video = [config.video_start_token_id] + [config.image_token_id] * 4 + [config.video_end_token_id]
        input_ids[:, : len(image) + len(video)] = torch.tensor(image + video)
        vision = config.vision_config
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        grid = torch.tensor([[1, 4, 4]] * self.batch_size)
        return config, {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "pixel_values": floats_tensor([self.batch_size * 16, patch_dim]),
            "image_grid_thw": grid,
            "pixel_values_videos": floats_tensor([self.batch_size * 16, patch_dim]),
            "video_grid_thw": grid.clone(),
        }


# The mixin treats a class by its name's place in transformers' auto mappings (base models are not trained, LM heads
# get labels, ...). Remote-code classes are in none, so ours are entered under a model type of their own (no config
# resolves to it), which gives them the treatment the built-in classes get.
modeling_auto.MODEL_MAPPING_NAMES.setdefault("glm53flash_hf_test", "Glm53FlashModel")
modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.setdefault(
    "glm53flash_hf_test", "Glm53FlashForConditionalGeneration"
)
modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("glm53flash_hf_test", "Glm53FlashForCausalLM")
# The base model of each of our config classes, as transformers' MODEL_MAPPING holds it for the built-in configs (the
# mixin looks a config's base class up there, e.g. test_torch_save_load). Our configs keep model_type glm5_next, so
# they are registered by class, which leaves the built-in Glm5NextConfig's entry as it is.
modeling_auto.MODEL_MAPPING.register(Glm53FlashConfig, Glm53FlashModel, exist_ok=True)
modeling_auto.MODEL_MAPPING.register(Glm53FlashTextConfig, Glm53FlashTextModel, exist_ok=True)


def _xfail(name: str, reason: str):
    """An override of the mixin's ``name`` expected to fail (strict: it must fail), with the reason."""

    @pytest.mark.xfail(strict=True, reason=reason)
    def test(self):
        getattr(super(type(self), self), name)()

    test.__name__ = name
    return test


def _skip(name: str, reason: str):
    def test(self):
        self.skipTest(reason)

    test.__name__ = name
    return test


NO_GENERATION_MIXIN = "GenerationTesterMixin (tests/generation/test_utils.py) is not shipped in the transformers sdist"
class _TextRowsForSdpaTest:
    """``test_eager_matches_sdpa_inference_*`` feeds ``input_ids`` alone (plus ``attention_mask``), without the
    tester's ``pixel_values``. Our models refuse image/video placeholder tokens without their pixels (ValueError,
    tests/test_vl.py; the built-in embeds them as text tokens), so here the test gets the tester's rows without the
    image and video spans; the comparison itself (eager vs sdpa, both our kernels, every padding side and dtype) is the
    mixin's, unchanged."""

    @parameterized.expand(TEST_EAGER_MATCHES_SDPA_INFERENCE_PARAMETERIZATION)
    def test_eager_matches_sdpa_inference(
        self, name, dtype, padding_side, use_attention_mask, output_attentions, enable_kernels
    ):
        text_only, self.model_tester.text_only = self.model_tester.text_only, True
        try:
            _test_eager_matches_sdpa_inference(
                self, name, dtype, padding_side, use_attention_mask, output_attentions, enable_kernels
            )
        finally:
            self.model_tester.text_only = text_only


BUILTIN_FAILS_TOO = "transformers' built-in glm5_next fails this test on the same tester as well"
# the mixin's expectations that the built-in glm5_next does not meet either (same tester, same inputs)
_AS_BUILTIN = {
    # it expects one attention tensor per layer; KDA layers have none (the built-in returns the DSA layers' only)
    "test_attention_outputs": BUILTIN_FAILS_TOO + " (no attention weights from KDA layers)",
    # it expects num_hidden_layers + 1 tensors of [B, S, hidden]; the mHC model's layer inputs are 4 streams
    "test_hidden_states_output": BUILTIN_FAILS_TOO + " (hidden states of an mHC model)",
    # with return_dict False / None the tower's tuple has no pooler_output to split (Glm5NextModel's contract)
    "test_get_image_features_output_0": BUILTIN_FAILS_TOO,
    "test_get_image_features_output_2": BUILTIN_FAILS_TOO,
    "test_get_video_features_output_0": BUILTIN_FAILS_TOO,
    "test_get_video_features_output_2": BUILTIN_FAILS_TOO,
}


class Glm53FlashCommonTest(_TextRowsForSdpaTest, ModelTesterMixin, unittest.TestCase):
    all_model_classes = (Glm53FlashModel, Glm53FlashForConditionalGeneration)
    # the KPool indexer gets no gradient: its top-k selection is not differentiable and neither this model nor the
    # built-in trains it with a loss of its own (set for the built-in's tester below as well)
    test_all_params_have_gradient = False
    # the mixin runs this test only for models whose config file carries a "# Copyright <year>" header of 2023 or
    # later (its prioritisation of transformers' own models); ours has none, the test applies all the same
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        self.model_tester = Glm53FlashModelTester(self)

    test_generation_tester_mixin_inheritance = _skip("test_generation_tester_mixin_inheritance", NO_GENERATION_MIXIN)
    locals().update({name: _xfail(name, reason) for name, reason in _AS_BUILTIN.items()})


class Glm53FlashCausalLMCommonTest(ModelTesterMixin, unittest.TestCase):
    """The text-only causal LM (no built-in counterpart) on the same tester without the image and video."""

    all_model_classes = (Glm53FlashForCausalLM,)
    test_all_params_have_gradient = False
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        self.model_tester = Glm53FlashModelTester(self, text_only=True)

    test_generation_tester_mixin_inheritance = _skip("test_generation_tester_mixin_inheritance", NO_GENERATION_MIXIN)
    test_multimodal_outputs_are_returned = _skip(
        "test_multimodal_outputs_are_returned", "text-only class: no vision tower (the config has a vision_config)"
    )
    test_reverse_loading_mapping = _skip(
        "test_reverse_loading_mapping",
        "the causal LM also loads the language_model.* layout of other exporters (a second source of its prefix "
        "renaming, load-only by design: save_pretrained writes model.language_model.*), which the test requires to "
        "come back from a save; there is no built-in causal LM to compare",
    )
    test_attention_outputs = _xfail("test_attention_outputs", _AS_BUILTIN["test_attention_outputs"])
    test_hidden_states_output = _xfail("test_hidden_states_output", _AS_BUILTIN["test_hidden_states_output"])


if os.environ.get("GLM53FLASH_HF_COMMON_BUILTIN") == "1":
    from transformers.models.glm5_next.modeling_glm5_next import (
        Glm5NextForConditionalGeneration,
        Glm5NextModel,
    )

    class Glm5NextBuiltinCommonTest(ModelTesterMixin, unittest.TestCase):
        all_model_classes = (Glm5NextModel, Glm5NextForConditionalGeneration)
        test_all_params_have_gradient = False

        def setUp(self):
            self.model_tester = Glm53FlashModelTester(self, builtin=True)
