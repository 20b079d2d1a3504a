"""The processor (:mod:`glm53flash_hf.processing_glm53flash`) off the happy path: video frame rates, frame counts and
presampled frame indices that do not describe the clip, video frames of different sizes, a folder without tokenizer,
and chat messages without a role or with ``content=None``.

Each bad input raises an error whose type and message name it; accepted inputs are checked against an independent
result (the same call with the equivalent well-formed input, the timestamps of the kept frames). Processors: the
embedded tiny checkpoint's (:func:`shared_fixtures.tiny_processor`) and one built in memory from the tiny trained
tokenizer of tests/test_processing.py (:func:`shared_fixtures.bpe_processor`).

(Beside tests/test_processing.py, which the CI's lowest-versions pass runs as it is.)
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import shared_fixtures
import torch
from jinja2.exceptions import TemplateError
from PIL import Image
from transformers.video_utils import VideoMetadata

from glm53flash_hf.processing_glm53flash import Glm53FlashProcessor
from glm53flash_hf.train.sft import build_sft_example

bpe_processor, tiny_checkpoint, tiny_processor = (  # fixtures
    shared_fixtures.bpe_processor, shared_fixtures.tiny_checkpoint, shared_fixtures.tiny_processor)


# ------------------------------------------------------------------------------------------------ video metadata


def _clip(frames=4):
    return np.random.default_rng(0).integers(0, 255, (frames, 56, 56, 3), dtype=np.uint8)


def test_processor_fps_must_be_positive(tiny_processor):
    meta = VideoMetadata(total_num_frames=4, fps=2.0)
    with pytest.raises(ValueError, match=r"fps \(frames sampled per second\) must be a finite number > 0; got fps=0"):
        tiny_processor.video_processor(videos=[_clip()], video_metadata=[meta], fps=0)
    with pytest.raises(ValueError, match=r"video_metadata.fps must be a finite number > 0; got fps=-2.0"):
        tiny_processor.video_processor(videos=[_clip()], video_metadata=[VideoMetadata(total_num_frames=4, fps=-2.0)])


@pytest.mark.parametrize("total", [100, 2])
def test_total_num_frames_must_describe_the_clip(tiny_processor, total):
    meta = VideoMetadata(total_num_frames=total, fps=2.0)
    with pytest.raises(ValueError, match=rf"video 0: video_metadata.total_num_frames={total} but the clip holds 4 "
                                         "frames"):
        tiny_processor.video_processor(videos=[_clip()], video_metadata=[meta])


@pytest.mark.parametrize(
    "indices, match",
    [
        ([0, 2, 1, 3], r"video 0: video_metadata.frames_indices decrease at position 2 \(2 then 1\)"),
        ([-4, -2, 0, 2], r"video 0: video_metadata.frames_indices starts at -4; indices must be >= 0"),
        ([0, 2, 4], r"video 0: video_metadata.frames_indices has 3 entries but the clip holds 4 frames"),
    ],
)
def test_presampled_frame_indices_are_checked(tiny_processor, indices, match):
    meta = VideoMetadata(total_num_frames=8, fps=2.0, frames_indices=indices)
    with pytest.raises(ValueError, match=match):
        tiny_processor(text="<|video|>", videos=[_clip()], video_metadata=[meta], do_sample_frames=False)


def test_presampled_frames_with_good_indices_give_their_timestamps(tiny_processor):
    meta = VideoMetadata(total_num_frames=8, fps=2.0, frames_indices=[0, 2, 4, 6])
    out = tiny_processor(text="<|video|>", videos=[_clip()], video_metadata=[meta], do_sample_frames=False)
    text = tiny_processor.tokenizer.decode(out["input_ids"][0])
    assert "0.0 seconds" in text and "2.0 seconds" in text  # tubelets start at frames 0 and 4 -> 0 s and 2 s



# ------------------------------------------------------------------------------------------------ folders


def test_processor_folder_without_tokenizer(tiny_checkpoint, tmp_path):
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    for name in ("processor_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(os.path.join(tiny_checkpoint, name), folder / name)
    with pytest.raises(FileNotFoundError, match=rf"{folder}: no tokenizer files \(looked for tokenizer.json"):
        Glm53FlashProcessor.from_pretrained(str(folder))
    with pytest.raises(FileNotFoundError, match=r"is not a folder: Glm53FlashProcessor.from_pretrained"):
        Glm53FlashProcessor.from_pretrained(str(tmp_path / "absent"))



# ------------------------------------------------------------------------------------------------ video frames


def _frames(sizes):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in sizes]


@pytest.mark.parametrize("as_pil", [False, True])
def test_video_frames_of_different_sizes_named(bpe_processor, as_pil):
    good = _frames([(56, 56)] * 4)
    bad = _frames([(56, 56), (56, 56), (28, 56), (56, 56)])
    if as_pil:
        good, bad = [Image.fromarray(f) for f in good], [Image.fromarray(f) for f in bad]
    meta = [VideoMetadata(total_num_frames=4, fps=2.0)] * 2
    match = r"video 1: frame 2 has size \(28, 56, 3\) but frame 0 has \(56, 56, 3\)"
    with pytest.raises(ValueError, match=match):
        bpe_processor(text="<|video|><|video|>", videos=[good, bad], video_metadata=meta)
    with pytest.raises(ValueError, match=match):
        bpe_processor.video_processor(videos=[good, bad], video_metadata=meta)


def test_video_frames_of_one_size_as_list_equal_the_array(bpe_processor):
    frames = _frames([(56, 56)] * 4)
    meta = [VideoMetadata(total_num_frames=4, fps=2.0)]
    as_list = bpe_processor(text="<|video|>", videos=[frames], video_metadata=meta, return_tensors="pt")
    as_array = bpe_processor(text="<|video|>", videos=[np.stack(frames)], video_metadata=meta, return_tensors="pt")
    assert torch.equal(as_list["input_ids"], as_array["input_ids"])
    assert torch.equal(as_list["pixel_values_videos"], as_array["pixel_values_videos"])



# ------------------------------------------------------------------------------------------------ chat messages


@pytest.mark.parametrize("bad, index", [({"content": "hi"}, 0), ({"role": None, "content": "ok"}, 1)])
def test_message_without_role_named(bpe_processor, bad, index):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    messages[index] = bad
    match = rf"message {index} has no role \(keys: content\); expected role system, user, assistant or tool"
    with pytest.raises(TemplateError, match=match):
        bpe_processor.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ValueError, match=rf"sample: {match}"):
        build_sft_example(bpe_processor, messages)
    with pytest.raises(TemplateError, match=match):
        bpe_processor.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=bpe_processor.chat_template)


def test_content_none_renders_as_no_content(bpe_processor):
    """transformers drops ``None`` values from chat messages (the OpenAI ``content=None`` of a tool-calling
    assistant turn): ``content=None`` renders and trains exactly as a message without ``content``, which the
    template renders as empty text."""
    call = {"function": {"name": "f", "arguments": {"a": 1}}}
    with_none = [{"role": "user", "content": None}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    empty = [{"role": "user", "content": ""}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = bpe_processor.apply_chat_template(with_none, tokenize=False)
    assert text == bpe_processor.apply_chat_template(empty, tokenize=False)
    assert text.endswith("<|user|><|assistant|><think></think><tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>"
                         "</tool_call>")
    a, b = build_sft_example(bpe_processor, with_none), build_sft_example(bpe_processor, empty)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert (a["labels"] != -100).any()

