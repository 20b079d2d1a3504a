"""The forward's input checks (:mod:`glm53flash_hf.input_checks`): bad input ids, embeddings, labels, packing tensors,
vision inputs, loss arguments and tensors on the meta device, as a careful user and as hostile input would give them.

Each case gets an error whose type and message name the input (argument, value, what was expected); accepted inputs
are checked against an independent result (the same call with the equivalent well-formed input). Tiny models
(``configuration/tiny.json``, randomised) and a few tokens per case.
"""

from __future__ import annotations

import re

import pytest
import shared_fixtures
import torch
from ckpt_fixtures import tiny_config
from shared_fixtures import IDS

from glm53flash_hf.input_checks import check_not_meta
from glm53flash_hf.modeling_glm53flash import Glm53FlashForConditionalGeneration

random_lm, random_vl = shared_fixtures.random_lm, shared_fixtures.random_vl  # fixtures

IMAGE_TOKEN = 2016
PIXEL_WIDTH = 3 * 2 * 14 * 14  # in_channels * temporal_patch_size * patch_size**2


# ------------------------------------------------------------------------------------------------ forward


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (torch.zeros(1, 0, dtype=torch.long), ValueError, r"input_ids must hold at least one row and one token; got "
                                                           r"shape \(1, 0\)"),
        (torch.zeros(0, 5, dtype=torch.long), ValueError, r"at least one row .* shape \(0, 5\)"),
        (torch.tensor([[5, 2048, 7]]), ValueError, r"ids outside \[0, vocab_size=2048\): 2048 at \[0, 1\]"),
        (torch.tensor([[5, -1, 7]]), ValueError, r"ids outside \[0, vocab_size=2048\): -1 at \[0, 1\]"),
        (torch.tensor([[5.0, 6.7]]), ValueError, r"input_ids must be an integer tensor; got dtype torch.float32"),
        (torch.tensor([5, 6, 7]), ValueError, r"input_ids must be \[batch, seq\]; got shape \(3,\)"),
    ],
)
def test_bad_input_ids(random_lm, ids, error, match):
    with pytest.raises(error, match=match):
        random_lm(input_ids=ids)


def test_bad_inputs_embeds(random_lm):
    match = r"inputs_embeds must be \[batch, seq, hidden_size=64\]; got shape \(1, 4, 32\)"
    with pytest.raises(ValueError, match=match):
        random_lm(inputs_embeds=torch.zeros(1, 4, 32))
    with pytest.raises(ValueError, match="inputs_embeds must be a floating-point tensor; got torch.int64"):
        random_lm(inputs_embeds=torch.zeros(1, 4, 64, dtype=torch.long))


@pytest.mark.parametrize(
    "labels, match",
    [
        (torch.zeros(1, 5, dtype=torch.long), r"labels must have the shape of the inputs \[batch, seq\] = \[1, 12\]; "
                                              r"got \(1, 5\)"),
        (IDS.clone().index_fill_(1, torch.tensor([4]), 4096), r"labels holds 4096 at \[0, 4\]; entries must be ids in "
                                                              r"\[0, vocab_size=2048\) or ignore_index=-100"),
        (IDS.clone().index_fill_(1, torch.tensor([2]), -5), r"labels holds -5 at \[0, 2\]"),
        (IDS.float(), r"labels must be an integer tensor; got dtype torch.float32"),
    ],
)
def test_bad_labels(random_lm, labels, match):
    with pytest.raises(ValueError, match=match):
        random_lm(input_ids=IDS, labels=labels)


def test_float_packing_tensors_raise(random_lm):
    ids = IDS
    with pytest.raises(ValueError, match="cu_seq_lens_q must be an integer tensor; got dtype torch.float32"):
        random_lm(input_ids=ids, cu_seq_lens_q=torch.tensor([0.0, 5.5, 12.0]))
    with pytest.raises(ValueError, match="position_ids must be an integer tensor; got dtype torch.float32"):
        random_lm(input_ids=ids, position_ids=torch.arange(12.0)[None])



# ------------------------------------------------------------------------------------------------ vision


def _image_inputs(grid=((1, 2, 2),), rows=None, width=PIXEL_WIDTH):
    grid = torch.tensor(grid)
    rows = int(grid.prod(-1).sum()) if rows is None else rows
    n_tokens = int(grid.prod(-1).sum()) // 4
    ids = torch.tensor([[5, 17] + [IMAGE_TOKEN] * n_tokens + [18, 19]])
    return dict(input_ids=ids, pixel_values=torch.randn(rows, width), image_grid_thw=grid)


def test_image_inputs_that_agree_run(random_vl):
    with torch.no_grad():
        out = random_vl(**_image_inputs())
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(rows=8), r"image_grid_thw \[\[1, 2, 2\]\] describes 4 patches \(sum of t\*h\*w\) but pixel_values "
                       r"has 8 rows"),
        (dict(width=100), r"pixel_values must be \[patches, in_channels\*temporal_patch_size\*patch_size\*\*2 = "
                          r"1176\]; got shape \(4, 100\)"),
        (dict(grid=((1, 3, 2),)), r"image_grid_thw\[0\] = \[1, 3, 2\]: .* multiples of spatial_merge_size=2"),
        (dict(grid=((0, 2, 2),), rows=4), r"image_grid_thw\[0\] = \[0, 2, 2\]: t, h, w must be positive"),
    ],
)
def test_inconsistent_image_inputs(random_vl, change, match):
    with pytest.raises(ValueError, match=match):
        random_vl(**_image_inputs(**change))


def test_image_grid_shape_dtype_and_absence(random_vl):
    inputs = _image_inputs()
    match = r"image_grid_thw must be \[n >= 1, 3\] rows of \(t, h, w\); got shape \(1, 2\)"
    with pytest.raises(ValueError, match=match):
        random_vl(**dict(inputs, image_grid_thw=torch.tensor([[2, 2]])))
    with pytest.raises(ValueError, match="image_grid_thw must be an integer tensor; got dtype torch.float32"):
        random_vl(**dict(inputs, image_grid_thw=inputs["image_grid_thw"].float()))
    with pytest.raises(ValueError, match="pixel_values needs image_grid_thw"):
        random_vl(**dict(inputs, image_grid_thw=None))


def test_video_grid_must_match_pixels(random_vl):
    ids = torch.tensor([[5, 2012, 2010, IMAGE_TOKEN, 2011, 2013, 7]])
    with pytest.raises(ValueError, match=r"video_grid_thw \[\[2, 2, 2\]\] describes 8 patches .* pixel_values_videos "
                                         r"has 4 rows"):
        random_vl(input_ids=ids, pixel_values_videos=torch.randn(4, PIXEL_WIDTH),
                  video_grid_thw=torch.tensor([[2, 2, 2]]))



# ------------------------------------------------------------------------------------------------ loss arguments


@pytest.mark.parametrize("count, shown", [(0, "0"), (-3, "-3"), (torch.tensor(0), "0"), (torch.tensor(-1.5), "-1.5")])
def test_num_items_in_batch_must_be_positive(random_lm, count, shown):
    with pytest.raises(ValueError, match=rf"num_items_in_batch must be positive .*; got {shown}$"):
        random_lm(input_ids=IDS, labels=IDS, num_items_in_batch=count)


def test_num_items_in_batch_of_other_types(random_lm):
    with pytest.raises(ValueError, match=r"num_items_in_batch must be a number or a one-element tensor; got shape "
                                         r"\(2,\)"):
        random_lm(input_ids=IDS, labels=IDS, num_items_in_batch=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"num_items_in_batch must be a positive number; got str '11'"):
        random_lm(input_ids=IDS, labels=IDS, num_items_in_batch="11")


def test_num_items_in_batch_positive_tensor_equals_int(random_lm):
    """The Trainer's tensor count gives the loss of the same int count (sum over the 11 targets / 7)."""
    with torch.no_grad():
        as_int = random_lm(input_ids=IDS, labels=IDS, num_items_in_batch=7, mtp=False).loss
        as_tensor = random_lm(input_ids=IDS, labels=IDS, num_items_in_batch=torch.tensor(7), mtp=False).loss
        mean = random_lm(input_ids=IDS, labels=IDS, mtp=False).loss
    assert as_int.item() == as_tensor.item()
    torch.testing.assert_close(as_int, mean * 11 / 7)


@pytest.mark.parametrize("keep, match", [
    (-2, r"logits_to_keep must be >= 0 .*; got -2$"),
    (None, r"logits_to_keep must be an int >= 0 \(0 keeps every position\) or a tensor of positions; got NoneType"),
])
def test_logits_to_keep_checked(random_lm, keep, match):
    with pytest.raises(ValueError, match=match):
        random_lm(input_ids=IDS, logits_to_keep=keep)


def test_logits_to_keep_kept_positions(random_lm):
    with torch.no_grad():
        full = random_lm(input_ids=IDS).logits
        last = random_lm(input_ids=IDS, logits_to_keep=3).logits
        picked = random_lm(input_ids=IDS, logits_to_keep=torch.tensor([0, 5])).logits
    torch.testing.assert_close(last, full[:, -3:])
    torch.testing.assert_close(picked, full[:, [0, 5]])



# ------------------------------------------------------------------------------------------------ meta device


@pytest.mark.parametrize("name", ["input_ids", "inputs_embeds", "labels", "attention_mask", "position_ids"])
def test_meta_inputs_named(random_lm, name):
    inputs = {"input_ids": IDS, "labels": IDS, "attention_mask": torch.ones_like(IDS),
              "position_ids": torch.arange(IDS.shape[1])[None]}
    if name == "inputs_embeds":
        inputs.pop("input_ids")
        inputs["inputs_embeds"] = torch.zeros(1, IDS.shape[1], random_lm.config.get_text_config().hidden_size)
    inputs[name] = inputs[name].to("meta")
    shape = re.escape(str(tuple(inputs[name].shape)))
    with pytest.raises(ValueError, match=rf"{name} is on the meta device \(shape {shape}, no data\) but the model's "
                                         r"weights are on cpu"):
        random_lm(**inputs)


def test_meta_prompt_to_generate_named(random_lm):
    with pytest.raises(ValueError, match=r"inputs is on the meta device \(shape \(1, 12\), no data\)"):
        random_lm.generate(IDS.to("meta"), max_new_tokens=2)



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

