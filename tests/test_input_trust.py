"""Inputs off the happy path: loss arguments, tensors on the meta device, video frames of different sizes and chat
messages without a role or with ``content=None``.

Each bad input raises an error whose type and message name it; accepted inputs are checked against an independent
result (the same call with the equivalent well-formed input). Tiny models (``configuration/tiny.json``) and the
tiny trained tokenizer of tests/test_processing.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from ckpt_fixtures import tiny_config
from jinja2.exceptions import TemplateError
from PIL import Image
from tiny import randomize_
from transformers import PreTrainedTokenizerFast
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
from transformers.video_utils import VideoMetadata

from glm53flash_hf.input_checks import check_not_meta
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM, Glm53FlashForConditionalGeneration
from glm53flash_hf.processing_glm53flash import Glm53FlashProcessor, Glm53FlashVideoProcessor
from glm53flash_hf.train.sft import build_sft_example

IDS = torch.tensor([[5, 17, 300, 41, 977, 5, 1999, 18, 19, 7, 3, 2]])
PIXEL_WIDTH = 3 * 2 * 14 * 14  # in_channels * temporal_patch_size * patch_size**2


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(tiny_config()).eval()
    randomize_(model, 0)
    return model


@pytest.fixture(scope="module")
def processor():
    from glm53flash_hf.tools.make_tiny import train_tokenizer

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(2000), eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        padding_side="left", clean_up_tokenization_spaces=False,
    )
    return Glm53FlashProcessor(Glm5NextImageProcessorPil(), tokenizer, Glm53FlashVideoProcessor())


# ------------------------------------------------------------------------------------------------ loss arguments


@pytest.mark.parametrize("count, shown", [(0, "0"), (-3, "-3"), (torch.tensor(0), "0"), (torch.tensor(-1.5), "-1.5")])
def test_num_items_in_batch_must_be_positive(lm, count, shown):
    with pytest.raises(ValueError, match=rf"num_items_in_batch must be positive .*; got {shown}$"):
        lm(input_ids=IDS, labels=IDS, num_items_in_batch=count)


def test_num_items_in_batch_of_other_types(lm):
    with pytest.raises(ValueError, match=r"num_items_in_batch must be a number or a one-element tensor; got shape "
                                         r"\(2,\)"):
        lm(input_ids=IDS, labels=IDS, num_items_in_batch=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"num_items_in_batch must be a positive number; got str '11'"):
        lm(input_ids=IDS, labels=IDS, num_items_in_batch="11")


def test_num_items_in_batch_positive_tensor_equals_int(lm):
    """The Trainer's tensor count gives the loss of the same int count (sum over the 11 targets / 7)."""
    with torch.no_grad():
        as_int = lm(input_ids=IDS, labels=IDS, num_items_in_batch=7, mtp=False).loss
        as_tensor = lm(input_ids=IDS, labels=IDS, num_items_in_batch=torch.tensor(7), mtp=False).loss
        mean = lm(input_ids=IDS, labels=IDS, mtp=False).loss
    assert as_int.item() == as_tensor.item()
    torch.testing.assert_close(as_int, mean * 11 / 7)


@pytest.mark.parametrize("keep, match", [
    (-2, r"logits_to_keep must be >= 0 .*; got -2$"),
    (None, r"logits_to_keep must be an int >= 0 \(0 keeps every position\) or a tensor of positions; got NoneType"),
])
def test_logits_to_keep_checked(lm, keep, match):
    with pytest.raises(ValueError, match=match):
        lm(input_ids=IDS, logits_to_keep=keep)


def test_logits_to_keep_kept_positions(lm):
    with torch.no_grad():
        full = lm(input_ids=IDS).logits
        last = lm(input_ids=IDS, logits_to_keep=3).logits
        picked = lm(input_ids=IDS, logits_to_keep=torch.tensor([0, 5])).logits
    torch.testing.assert_close(last, full[:, -3:])
    torch.testing.assert_close(picked, full[:, [0, 5]])


# ------------------------------------------------------------------------------------------------ meta device


@pytest.mark.parametrize("name", ["input_ids", "inputs_embeds", "labels", "attention_mask", "position_ids"])
def test_meta_inputs_named(lm, name):
    inputs = {"input_ids": IDS, "labels": IDS, "attention_mask": torch.ones_like(IDS),
              "position_ids": torch.arange(IDS.shape[1])[None]}
    if name == "inputs_embeds":
        inputs.pop("input_ids")
        inputs["inputs_embeds"] = torch.zeros(1, IDS.shape[1], lm.config.get_text_config().hidden_size)
    inputs[name] = inputs[name].to("meta")
    shape = re.escape(str(tuple(inputs[name].shape)))
    with pytest.raises(ValueError, match=rf"{name} is on the meta device \(shape {shape}, no data\) but the model's "
                                         r"weights are on cpu"):
        lm(**inputs)


def test_meta_prompt_to_generate_named(lm):
    with pytest.raises(ValueError, match=r"inputs is on the meta device \(shape \(1, 12\), no data\)"):
        lm.generate(IDS.to("meta"), max_new_tokens=2)


@pytest.mark.parametrize("name", ["pixel_values", "image_grid_thw"])
def test_meta_vision_inputs_named(name):
    torch.manual_seed(0)
    vl = Glm53FlashForConditionalGeneration(tiny_config()).eval()
    inputs = {"pixel_values": torch.randn(4, PIXEL_WIDTH), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    inputs[name] = inputs[name].to("meta")
    with pytest.raises(ValueError, match=rf"{name} is on the meta device .* but the model's weights are on cpu"):
        vl(input_ids=IDS, **inputs)


def test_meta_inputs_to_a_meta_model_pass_the_check():
    """A model itself on meta (``init_empty_weights``) may trace meta inputs: the check lets them through."""
    module = torch.nn.Linear(2, 2, device="meta")
    check_not_meta({"input_ids": IDS.to("meta")}, module)
    with pytest.raises(ValueError, match=r"input_ids is on the meta device"):
        check_not_meta({"input_ids": IDS.to("meta")}, torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------------ processor


def _frames(sizes):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in sizes]


@pytest.mark.parametrize("as_pil", [False, True])
def test_video_frames_of_different_sizes_named(processor, as_pil):
    good = _frames([(56, 56)] * 4)
    bad = _frames([(56, 56), (56, 56), (28, 56), (56, 56)])
    if as_pil:
        good, bad = [Image.fromarray(f) for f in good], [Image.fromarray(f) for f in bad]
    meta = [VideoMetadata(total_num_frames=4, fps=2.0)] * 2
    match = r"video 1: frame 2 has size \(28, 56, 3\) but frame 0 has \(56, 56, 3\)"
    with pytest.raises(ValueError, match=match):
        processor(text="<|video|><|video|>", videos=[good, bad], video_metadata=meta)
    with pytest.raises(ValueError, match=match):
        processor.video_processor(videos=[good, bad], video_metadata=meta)


def test_video_frames_of_one_size_as_list_equal_the_array(processor):
    frames = _frames([(56, 56)] * 4)
    meta = [VideoMetadata(total_num_frames=4, fps=2.0)]
    as_list = processor(text="<|video|>", videos=[frames], video_metadata=meta, return_tensors="pt")
    as_array = processor(text="<|video|>", videos=[np.stack(frames)], video_metadata=meta, return_tensors="pt")
    assert torch.equal(as_list["input_ids"], as_array["input_ids"])
    assert torch.equal(as_list["pixel_values_videos"], as_array["pixel_values_videos"])


@pytest.mark.parametrize("bad, index", [({"content": "hi"}, 0), ({"role": None, "content": "ok"}, 1)])
def test_message_without_role_named(processor, bad, index):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    messages[index] = bad
    match = rf"message {index} has no role \(keys: content\); expected role system, user, assistant or tool"
    with pytest.raises(TemplateError, match=match):
        processor.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ValueError, match=rf"sample: {match}"):
        build_sft_example(processor, messages)
    with pytest.raises(TemplateError, match=match):
        processor.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=processor.chat_template)


def test_content_none_renders_as_no_content(processor):
    """transformers drops ``None`` values from chat messages (the OpenAI ``content=None`` of a tool-calling
    assistant turn): ``content=None`` renders and trains exactly as a message without ``content``, which the
    template renders as empty text."""
    call = {"function": {"name": "f", "arguments": {"a": 1}}}
    with_none = [{"role": "user", "content": None}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    empty = [{"role": "user", "content": ""}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = processor.apply_chat_template(with_none, tokenize=False)
    assert text == processor.apply_chat_template(empty, tokenize=False)
    assert text.endswith("<|user|><|assistant|><think></think><tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>"
                         "</tool_call>")
    a, b = build_sft_example(processor, with_none), build_sft_example(processor, empty)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert (a["labels"] != -100).any()


# ------------------------------------------------------------------------------------------------ label conventions


def _packed():
    ids = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in (7, 1, 10, 6)]).expand(2, -1)
    return ids, pos


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_mtp_targets_from_row_shifted_labels_stay_in_the_document(depth):
    """transformers' row-wise ``shift_labels`` of ``labels = input_ids`` hold each document's first token at the
    previous document's last position: the MTP targets made from them equal those made from ``labels`` (targets
    inside each document only), for every depth."""
    from glm53flash_hf.mtp import mtp_targets
    from glm53flash_hf.packing import build_document_layout

    ids, pos = _packed()
    layout = build_document_layout(2, 24, "cpu", position_ids=pos)
    shift = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    expect = mtp_targets(ids, layout, depth)
    assert torch.equal(mtp_targets(shift, layout, depth, shifted=True), expect)
    assert (expect != -100).sum() == sum(max(n - 1 - depth, 0) for n in (7, 1, 10, 6)) * 2


def test_shift_labels_given_equal_labels_only(lm):
    """The head with ``labels`` and transformers' row-wise ``shift_labels`` gives the loss and MTP loss of
    ``labels`` alone (packed rows, ``labels = input_ids``)."""
    ids, pos = _packed()
    shift = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    with torch.no_grad():
        alone = lm(input_ids=ids, position_ids=pos, labels=ids)
        given = lm(input_ids=ids, position_ids=pos, labels=ids, shift_labels=shift)
    assert given.mtp_loss.item() == alone.mtp_loss.item() and given.loss.item() == alone.loss.item()
