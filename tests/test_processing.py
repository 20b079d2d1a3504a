"""Glm53FlashProcessor, Glm53FlashVideoProcessor, the GLM-5.3 chat template and SFT labels.

Inputs are real pictures and the animated GIF shipped in scikit-image's ``skimage/data`` (shrunk so the tests
stay fast); the tokenizer is the byte-level BPE of ``glm53flash_hf.tools.make_tiny`` (trained on CPython's
``pydoc_data.topics``) with the GLM special tokens. Nothing is downloaded.

References: the expected template strings are spelled out character for character;
the placeholder expansion is compared with transformers' in-library ``Glm5NextProcessor`` on the same inputs;
frame sampling, the patch layout and the grid sizes are compared with transformers' ``Glm5NextVideoProcessor``
(loaded in a subprocess behind a stand-in for torchvision, which cannot be installed next to the CPU torch
here); resize/normalize/patchify are compared bit for bit with ``Glm5NextImageProcessorPil``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import skimage
import torch
from PIL import Image
from skimage import data as skdata
from transformers import PreTrainedTokenizerFast
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
from transformers.video_utils import VideoMetadata

from glm53flash_hf.processing_glm53flash import (
    CHAT_TEMPLATE_FILE,
    Glm53FlashProcessor,
    Glm53FlashVideoProcessor,
    load_chat_template,
)
from glm53flash_hf.train.sft import build_sft_example, visual_spans

GIF = os.path.join(os.path.dirname(skimage.__file__), "data", "no_time_for_that_tiny.gif")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MERGE = 2


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tokenizer():
    from glm53flash_hf.tools.make_tiny import train_tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(2000),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def make_processor(tokenizer):
    return Glm53FlashProcessor(Glm5NextImageProcessorPil(), tokenizer, Glm53FlashVideoProcessor())


@pytest.fixture(scope="module")
def processor(tokenizer):
    return make_processor(tokenizer)


def shrink(array, width, height):
    return np.asarray(Image.fromarray(array).resize((width, height), Image.BICUBIC))


@pytest.fixture(scope="module")
def photos():
    """Three skimage photos, shrunk (aspect ratios roughly kept): astronaut, chelsea (the cat), coffee."""
    return {
        "astronaut": shrink(skdata.astronaut(), 64, 64),
        "chelsea": shrink(skdata.chelsea(), 90, 60),
        "coffee": shrink(skdata.coffee(), 168, 112),
    }


@pytest.fixture(scope="module")
def gif():
    """skimage's animated GIF as an RGB video [24, 25, 14, 3] and its metadata (70 ms per frame)."""
    clip = Image.open(GIF)
    frames = []
    for index in range(clip.n_frames):
        clip.seek(index)
        frames.append(np.asarray(clip.convert("RGB")))
    video = np.stack(frames)
    assert video.shape == (24, 25, 14, 3)
    return video


def gif_metadata():
    return VideoMetadata(total_num_frames=24, fps=1000 / 70, duration=24 * 0.070)


def ids_of(tokenizer, *tokens):
    return [tokenizer.convert_tokens_to_ids(t) for t in tokens]


# ------------------------------------------------------------------------------------------------ chat template

SYSTEM_EXAMPLE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi there."},
]
MULTI_TURN = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "reasoning_content": "Add them.", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "reasoning_content": "Add again.", "content": "6"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "strict": True,
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}],
    },
    {"role": "tool", "content": "22C"},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "It is 22C and sunny."},
]
TOOLS_BLOCK = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"name": "get_weather", "description": "Get the weather.", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}\n</tools>\n\n'
    "For each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)
CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"


def render(processor, messages, **kwargs):
    """The plain GLM rendering (``end_of_text_after_assistant=False``) unless the caller says otherwise."""
    kwargs.setdefault("end_of_text_after_assistant", False)
    return processor.apply_chat_template(messages, tokenize=False, **kwargs)


def test_template_default_closes_a_final_answer(processor, tokenizer):
    """Rendered whole (no generation prompt, as SFT trainers render a conversation), an assistant turn that no user
    or tool turn follows ends with <|endoftext|>, a trained stop target; a generation prompt, a closing tool call or
    end_of_text_after_assistant=False leave the plain rendering."""
    default = processor.apply_chat_template(MULTI_TURN, tokenize=False)
    assert default == render(processor, MULTI_TURN) + "<|endoftext|>"
    assert tokenizer.apply_chat_template(MULTI_TURN, chat_template=load_chat_template(), tokenize=False) == default
    masked = processor.apply_chat_template(MULTI_TURN, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
    ids, mask = masked["input_ids"][0], masked["assistant_masks"][0]
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|endoftext|>") and mask[-1] == 1
    prompt = MULTI_TURN[:3]
    assert processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == (
        render(processor, prompt) + "<|assistant|><think>"
    )
    call = TOOL_CHAT[:2]
    assert call[-1]["tool_calls"] and processor.apply_chat_template(call, tools=TOOLS, tokenize=False) == (
        render(processor, call, tools=TOOLS)
    )
    # explicitly asked for, a closing tool call ends with it too (build_sft_example's rule)
    assert render(processor, call, tools=TOOLS, end_of_text_after_assistant=True).endswith(CALL + "<|endoftext|>")


def test_template_system_user_assistant(processor, tokenizer):
    expected = (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>You are a helpful assistant."
        "<|user|>Hello!<|assistant|><think></think>Hi there."
    )
    assert render(processor, SYSTEM_EXAMPLE) == expected
    # The tokenizer renders the same template the same way.
    assert tokenizer.apply_chat_template(
        SYSTEM_EXAMPLE, chat_template=load_chat_template(), tokenize=False, end_of_text_after_assistant=False
    ) == expected


def test_template_multi_turn_thinking(processor):
    # Default clear_thinking: reasoning before the last user turn is not rendered.
    assert render(processor, MULTI_TURN) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>What is 2+2?<|assistant|><think></think>4"
        "<|user|>And 3+3?<|assistant|><think>Add again.</think>6"
    )
    assert render(processor, MULTI_TURN, clear_thinking=False) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>What is 2+2?<|assistant|><think>Add them.</think>4"
        "<|user|>And 3+3?<|assistant|><think>Add again.</think>6"
    )
    # Reasoning written inline in the content is split off the same way.
    inline = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>Inline.</think>A"}]
    assert render(processor, inline) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>Q<|assistant|><think>Inline.</think>A"
    )


def test_template_tool_call_and_observation(processor):
    assert render(processor, TOOL_CHAT, tools=TOOLS) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max" + TOOLS_BLOCK
        + "<|user|>Weather in Paris?<|assistant|><think></think>Let me check." + CALL
        + "<|observation|><tool_response>22C</tool_response><tool_response>sunny</tool_response>"
        "<|assistant|><think></think>It is 22C and sunny."
    )


def test_template_image_and_video_content(processor):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Compare."}]},
        {"role": "assistant", "content": "Same cat."},
    ]
    assert render(processor, messages) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|><|begin_of_image|><|image|><|end_of_image|>"
        "<|begin_of_video|><|video|><|end_of_video|>Compare.<|assistant|><think></think>Same cat."
    )


@pytest.mark.parametrize(
    "effort, shown",
    [("low", "Low"), ("high", "High"), ("max", "Max"), ("medium", "Max"), ("Low", "Max"), ("bogus", "Max"), (None, "Max")],
)
def test_template_reasoning_effort(processor, effort, shown):
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    got = render(processor, [{"role": "user", "content": "hi"}], add_generation_prompt=True, **kwargs)
    assert got == f"[gMASK]<sop><|system|>Reasoning Effort: {shown}<|user|>hi<|assistant|><think>"


def test_template_generation_prompt_and_thinking_off(processor):
    user = [{"role": "user", "content": "hi"}]
    assert render(processor, user) == "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>hi"
    assert render(processor, user, enable_thinking=False, add_generation_prompt=True) == (
        "[gMASK]<sop><|user|>hi<|assistant|><think></think>"
    )
    # enable_thinking=False drops the effort line whatever the effort.
    assert render(processor, user, enable_thinking=False, reasoning_effort="low") == "[gMASK]<sop><|user|>hi"


def test_template_rejects_bad_input(processor):
    with pytest.raises(Exception, match="unknown message role"):
        render(processor, [{"role": "narrator", "content": "x"}])
    bad_call = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": ["a", 1]}}]},
    ]
    with pytest.raises(Exception, match="tool call arguments must be a mapping"):
        render(processor, bad_call)
    # a JSON string (the OpenAI form, tests/test_chat_format.py) must hold one object
    bad_call[1]["tool_calls"][0]["function"]["arguments"] = '{"a": 1'
    with pytest.raises(Exception, match=r'tool call 0 \("f"\): arguments given as a string must be one JSON object'):
        render(processor, bad_call)


# ------------------------------------------------------------------------------------------------ SFT labels


def trained_runs(tokenizer, example):
    """Decode each maximal run of trained positions; labels must equal the ids there."""
    ids, labels = example["input_ids"].tolist(), example["labels"].tolist()
    assert len(ids) == len(labels) == len(example["mm_token_type_ids"]) == len(example["attention_mask"])
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label == -100:
            if current:
                runs.append(tokenizer.decode(current))
                current = []
        else:
            assert label == token
            current.append(label)
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def sft_text(tokenizer, example):
    return tokenizer.decode(example["input_ids"].tolist())


def test_sft_single_turn(processor, tokenizer):
    example = build_sft_example(processor, SYSTEM_EXAMPLE)
    assert sft_text(tokenizer, example) == render(processor, SYSTEM_EXAMPLE) + "<|endoftext|>"
    assert trained_runs(tokenizer, example) == ["</think>Hi there.<|endoftext|>"]
    # Thinking off: </think> is not trained; the effort line disappears.
    example = build_sft_example(processor, SYSTEM_EXAMPLE, enable_thinking=False)
    assert trained_runs(tokenizer, example) == ["Hi there.<|endoftext|>"]
    # Empty reasoning renders <think></think> like no reasoning.
    empty = SYSTEM_EXAMPLE[:2] + [{"role": "assistant", "reasoning_content": "", "content": "Hi there."}]
    assert sft_text(tokenizer, build_sft_example(processor, empty)) == sft_text(tokenizer, build_sft_example(processor, SYSTEM_EXAMPLE))
    assert trained_runs(tokenizer, build_sft_example(processor, empty)) == ["</think>Hi there.<|endoftext|>"]
    assert trained_runs(tokenizer, build_sft_example(processor, empty, enable_thinking=False)) == ["Hi there.<|endoftext|>"]


def test_sft_multi_turn_reasoning(processor, tokenizer):
    example = build_sft_example(processor, MULTI_TURN)  # clear_thinking=False: all reasoning kept and trained
    assert sft_text(tokenizer, example) == render(processor, MULTI_TURN, clear_thinking=False) + "<|endoftext|>"
    # The <|user|> closing the first assistant turn is its stop target; <think> is never trained.
    assert trained_runs(tokenizer, example) == ["Add them.</think>4<|user|>", "Add again.</think>6<|endoftext|>"]
    # With clear_thinking the first turn's reasoning is not rendered, so that turn is not trained at all.
    example = build_sft_example(processor, MULTI_TURN, clear_thinking=True)
    assert sft_text(tokenizer, example) == render(processor, MULTI_TURN) + "<|endoftext|>"
    assert trained_runs(tokenizer, example) == ["Add again.</think>6<|endoftext|>"]
    # loss=False switches a turn (and its stop target) off.
    off = [dict(m) for m in MULTI_TURN]
    off[1]["loss"] = False
    assert trained_runs(tokenizer, build_sft_example(processor, off)) == ["Add again.</think>6<|endoftext|>"]


def test_sft_tool_call_and_observation(processor, tokenizer):
    example = build_sft_example(processor, TOOL_CHAT, tools=TOOLS)
    assert sft_text(tokenizer, example) == render(processor, TOOL_CHAT, tools=TOOLS) + "<|endoftext|>"
    assert trained_runs(tokenizer, example) == [
        "</think>Let me check." + CALL + "<|observation|>",
        "</think>It is 22C and sunny.<|endoftext|>",
    ]


def test_sft_end_of_text_when_no_user_follows(processor, tokenizer):
    # An assistant turn followed by a system turn ends with <|endoftext|> (trained), unlike the plain rendering.
    messages = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "B"},
        {"role": "system", "content": "C"},
        {"role": "user", "content": "D"},
        {"role": "assistant", "content": "E"},
    ]
    example = build_sft_example(processor, messages)
    assert sft_text(tokenizer, example) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|>A<|assistant|><think></think>B<|endoftext|>"
        "<|system|>C<|user|>D<|assistant|><think></think>E<|endoftext|>"
    )
    assert trained_runs(tokenizer, example) == ["</think>B<|endoftext|>", "</think>E<|endoftext|>"]


def test_sft_vision_example(processor, tokenizer, photos, gif):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": photos["chelsea"]},
                {"type": "video", "video": gif},
                {"type": "text", "text": "Which is the cat?"},
            ],
        },
        {"role": "assistant", "reasoning_content": "Whiskers.", "content": "The photo."},
    ]
    example = build_sft_example(processor, messages, video_metadata=[gif_metadata()], sample_id="vl-0")
    assert trained_runs(tokenizer, example) == ["Whiskers.</think>The photo.<|endoftext|>"]
    types = example["mm_token_type_ids"]
    assert (example["labels"][types != 0] == -100).all()
    n_image = int(example["image_grid_thw"].prod()) // MERGE**2
    n_video = int(example["video_grid_thw"].prod()) // MERGE**2
    assert int((types == 1).sum()) == n_image and int((types == 2).sum()) == n_video
    # Same ids as the processor on the rendered text: the SFT text is the plain rendering plus <|endoftext|>.
    plain = render(processor, messages, clear_thinking=False)
    direct = processor(
        text=plain + "<|endoftext|>", images=[photos["chelsea"]], videos=[gif], video_metadata=[gif_metadata()]
    )
    assert example["input_ids"].tolist() == direct["input_ids"][0]
    assert torch.equal(example["pixel_values"], torch.as_tensor(direct["pixel_values"]))
    assert torch.equal(example["pixel_values_videos"], torch.as_tensor(direct["pixel_values_videos"]))


def test_sft_truncation(processor, tokenizer, photos):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": photos["astronaut"]}, {"type": "text", "text": "Who?"}]},
        {"role": "assistant", "content": "An astronaut."},
    ]
    full = build_sft_example(processor, messages)
    (kind, first, last), = visual_spans(processor, full["input_ids"])
    assert kind == "image" and last - first + 1 == 2 + int(full["image_grid_thw"].prod()) // MERGE**2
    length = len(full["input_ids"])
    with pytest.raises(ValueError, match=rf"sample 'ex-7': truncating {length} tokens to max_length={first + 3} cuts through the image span at tokens {first}..{last}"):
        build_sft_example(processor, messages, max_length=first + 3, sample_id="ex-7")
    with pytest.raises(ValueError, match="cuts through the image span"):
        build_sft_example(processor, messages, max_length=last)  # <|end_of_image|> cut off
    # A cut before the image drops it and its pixels; a cut after it keeps them.
    before = build_sft_example(processor, messages, max_length=first)
    assert len(before["input_ids"]) == first and "pixel_values" not in before and "image_grid_thw" not in before
    assert (before["mm_token_type_ids"] == 0).all()
    after = build_sft_example(processor, messages, max_length=last + 2)
    assert after["input_ids"].tolist() == full["input_ids"][: last + 2].tolist()
    assert after["labels"].tolist() == full["labels"][: last + 2].tolist()
    assert torch.equal(after["pixel_values"], full["pixel_values"])


# ------------------------------------------------------------------------------------------------ placeholders


def image_token_runs(processor, ids):
    """Lengths of the <|image|> runs between each <|begin_of_image|> and <|end_of_image|>, in order."""
    boi, eoi, image = ids_of(processor.tokenizer, "<|begin_of_image|>", "<|end_of_image|>", "<|image|>")
    runs, count = [], None
    for token in ids:
        if token == boi:
            count = 0
        elif token == eoi:
            runs.append(count)
            count = None
        elif token == image:
            assert count is not None, "<|image|> outside a begin/end-of-image wrapper"
            count += 1
    return runs


def test_image_placeholders_per_image(processor, photos):
    text = "<|user|>" + "".join(f"<|begin_of_image|><|image|><|end_of_image|>{name}." for name in photos)
    out = processor(text=text, images=list(photos.values()), return_tensors="pt")
    grids = out["image_grid_thw"]
    assert grids.shape == (3, 3) and (grids[:, 0] == 1).all()
    expected = [int(g.prod()) // MERGE**2 for g in grids]
    assert image_token_runs(processor, out["input_ids"][0].tolist()) == expected
    assert len(set(map(tuple, grids.tolist()))) == 3, "the three photos should give three different grids"
    assert out["pixel_values"].shape == (int(grids.prod(-1).sum()), 3 * 2 * 14 * 14)
    assert out["mm_token_type_ids"][0].tolist() == [int(t == processor.image_token_id) for t in out["input_ids"][0].tolist()]
    # The counts agree with the processor's size-only estimate.
    sizes = [p.shape[:2] for p in photos.values()]
    assert processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"] == expected


def test_video_placeholders_and_timestamps(processor, tokenizer, gif):
    text = "<|user|><|begin_of_video|><|video|><|end_of_video|>What happens?"
    out = processor(text=text, videos=[gif], video_metadata=[gif_metadata()], return_tensors="pt")
    (t, h, w), = out["video_grid_thw"].tolist()
    # 1.68 s at 2 fps: frames 0, 4, 8 (+8 repeated) -> 2 tubelets; 25x14 frames are enlarged to 112x84.
    assert (t, h, w) == (2, 8, 6)
    per = h * w // MERGE**2
    body = "<|image|>" * per
    assert tokenizer.decode(out["input_ids"][0].tolist()) == (
        "<|user|><|begin_of_video|>"
        f"<|begin_of_image|>{body}<|end_of_image|>0.0 seconds"
        f"<|begin_of_image|>{body}<|end_of_image|>0.6 seconds"
        "<|end_of_video|>What happens?"
    )
    assert image_token_runs(processor, out["input_ids"][0].tolist()) == [per] * t
    assert processor.video_token_id not in out["input_ids"][0].tolist()
    types = out["mm_token_type_ids"][0]
    assert int((types == 2).sum()) == t * per and int((types == 1).sum()) == 0
    assert out["pixel_values_videos"].shape == (t * h * w, 1176)
    estimate = processor._get_num_multimodal_tokens(video_sizes=[(4, 25, 14)])["num_video_tokens"]
    assert estimate == [t * per]


def expected_types(processor, ids):
    boi_v, eoi_v = processor.video_start_id, processor.video_end_id
    inside, types = False, []
    for token in ids:
        if token == boi_v:
            inside = True
        elif token == eoi_v:
            inside = False
        types.append((2 if inside else 1) if token == processor.image_token_id else 0)
    return types


def test_mm_token_type_ids_image_video_mix(processor, photos, gif):
    texts = [
        "<|user|><|begin_of_image|><|image|><|end_of_image|>A<|begin_of_video|><|video|><|end_of_video|>B"
        "<|begin_of_image|><|image|><|end_of_image|>C",
        "<|user|>only text",
    ]
    out = processor(
        text=texts, images=[photos["astronaut"], photos["coffee"]], videos=[gif], video_metadata=[gif_metadata()],
        padding=True, return_tensors="pt",
    )
    ids, types = out["input_ids"], out["mm_token_type_ids"]
    assert ids.shape == types.shape
    for row in range(2):
        assert types[row].tolist() == expected_types(processor, ids[row].tolist())
    assert (types[1] == 0).all()  # left padding and text only
    assert out["attention_mask"][1].sum() < out["attention_mask"][0].sum()
    grids_i, grids_v = out["image_grid_thw"], out["video_grid_thw"]
    assert int((types == 1).sum()) == int(grids_i.prod(-1).sum()) // MERGE**2
    assert int((types == 2).sum()) == int(grids_v.prod(-1).sum()) // MERGE**2
    # Image spans outside the video: image 0, then the video's tubelets, then image 1.
    runs = image_token_runs(processor, ids[0].tolist())
    per_tubelet = int(grids_v[0, 1] * grids_v[0, 2]) // MERGE**2
    assert runs == [int(grids_i[0].prod()) // 4] + [per_tubelet] * int(grids_v[0, 0]) + [int(grids_i[1].prod()) // 4]


def test_video_without_metadata_warns_once_and_uses_24_fps(tokenizer, gif):
    processor = make_processor(tokenizer)  # a fresh instance: the warning is once per processor
    text = "<|begin_of_video|><|video|><|end_of_video|>"
    with pytest.raises(ValueError, match="do_sample_frames=False"):
        processor(text=text, videos=[gif])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = processor(text=text, videos=[gif], do_sample_frames=False)
        second = processor(text=text, videos=[gif], do_sample_frames=False)
    fps_warnings = [w for w in caught if "fps" in str(w.message)]
    assert len(fps_warnings) == 1 and "24 fps" in str(fps_warnings[0].message)
    assert first["input_ids"] == second["input_ids"]
    decoded = tokenizer.decode(first["input_ids"][0])
    stamps = [part.split("<|end_of_image|>")[1] for part in decoded.split("<|begin_of_image|>")[1:]]
    stamps[-1] = stamps[-1].replace("<|end_of_video|>", "")
    # 24 frames -> 12 tubelets starting at frames 0, 2, 4, ... -> index / 24 s.
    assert stamps == [f"{i / 24:.1f} seconds" for i in range(0, 24, 2)]
    assert stamps[:4] == ["0.0 seconds", "0.1 seconds", "0.2 seconds", "0.2 seconds"]


def test_missing_special_tokens_raise():
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    raw.add_special_tokens(["<|endoftext|>", "<|image|>"])
    bare = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    with pytest.raises(ValueError, match=r"lacks the GLM special tokens \['<\|video\|>', '<\|begin_of_image\|>'"):
        Glm53FlashProcessor(Glm5NextImageProcessorPil(), bare, Glm53FlashVideoProcessor())


def test_image_token_in_the_vocabulary_but_not_added_names_the_tokenizer(tokenizer, photos):
    """``<|image|>`` as a plain vocabulary entry (no added token): the id lookup finds it, but tokenizing the text
    splits it into pieces, so a prompt holds no image token. The processor refuses the tokenizer when it is built,
    naming the token, what tokenizing gives and what was expected (before: an error on mm_token_type_ids counts at
    the first call)."""
    from tokenizers import Tokenizer

    raw = json.loads(tokenizer.backend_tokenizer.to_str())
    for added in raw["added_tokens"]:
        if added["content"] == "<|image|>":
            added["content"] = "<|unused|>"
    vocab = raw["model"]["vocab"]
    last = max(vocab, key=vocab.get)  # the last merge's result: the entry that becomes <|image|>
    image_id = vocab.pop(last)
    vocab["<|image|>"] = image_id
    raw["model"]["merges"] = [m for m in raw["model"]["merges"] if "".join(m) != last]
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(raw)), eos_token="<|endoftext|>")
    assert plain.convert_tokens_to_ids("<|image|>") == image_id and plain.convert_ids_to_tokens(image_id) == "<|image|>"
    pieces = plain.encode("<|image|>", add_special_tokens=False)
    assert len(pieces) > 1
    match = (
        rf"the tokenizer \(TokenizersBackend, {len(plain)} tokens\) holds '<\|image\|>' \(id {image_id}\) in its "
        rf"vocabulary but does not read it as one token: tokenizing '<\|image\|>' gives ids "
        rf"{re.escape(str(pieces))} .*, expected \[{image_id}\]\..* must be an added token of the tokenizer: "
        rf"tokenizer\.add_tokens\(\['<\|image\|>'\], special_tokens=True\)"
    )
    with pytest.raises(ValueError, match=match):
        make_processor(plain)
    plain.add_tokens(["<|image|>"], special_tokens=True)  # the remedy the error gives
    out = make_processor(plain)(text="<|begin_of_image|><|image|><|end_of_image|>", images=[photos["coffee"]])
    assert 1 in out["mm_token_type_ids"][0]


# ------------------------------------------------------------------------------------------------ references


class _ReferenceProcessor(Glm5NextProcessor):
    """transformers' Glm5NextProcessor with the one change it needs to be built without torchvision: its class
    check looks up ``transformers.VideoProcessorMixin``, which transformers only exports with torchvision."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor":
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


def test_matches_transformers_glm5_next_processor(processor, tokenizer, photos, gif):
    reference = _ReferenceProcessor(
        image_processor=processor.image_processor,
        tokenizer=tokenizer,
        video_processor=processor.video_processor,
        chat_template=processor.chat_template,
    )
    cases = [
        dict(text="<|user|><|begin_of_image|><|image|><|end_of_image|>Hi", images=[photos["chelsea"]]),
        dict(text="<|begin_of_video|><|video|><|end_of_video|>Go", videos=[gif], video_metadata=[gif_metadata()]),
        dict(
            text=["<|begin_of_image|><|image|><|end_of_image|>x<|begin_of_video|><|video|><|end_of_video|>",
                  "<|begin_of_image|><|image|><|end_of_image|>y"],
            images=[photos["astronaut"], photos["coffee"]], videos=[gif], video_metadata=[gif_metadata()], padding=True,
        ),
        dict(text="<|begin_of_video|><|video|><|end_of_video|>", videos=[gif], do_sample_frames=False),
    ]
    for case in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = processor(**case, return_tensors="pt")
            theirs = reference(**case, return_tensors="pt")
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), key


def test_video_pixels_match_image_processor(processor, photos):
    # Two identical frames are one tubelet, which the image processor builds from one image: the same canvas,
    # the same PIL resize, normalisation and patch order must give bit-identical pixels.
    for name, photo in photos.items():
        image = processor.image_processor(images=[photo], return_tensors="np")
        video = processor.video_processor(videos=[np.stack([photo, photo])], do_sample_frames=False, return_tensors="np")
        assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist(), name
        assert np.array_equal(video["pixel_values_videos"], image["pixel_values"]), name


ORACLE = textwrap.dedent(
    r"""
    # Load transformers' Glm5NextVideoProcessor behind a stand-in torchvision module (its import needs one; the
    # methods compared here never call it) and report its results as JSON.
    import importlib.util, json, sys, types
    import numpy as np, torch
    import transformers.models.glm5_next as pkg
    import transformers.video_processing_utils, transformers.image_processing_backends  # before the stand-in
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["torchvision.transforms.v2"].functional = sys.modules["torchvision.transforms.v2.functional"]
    spec = importlib.util.spec_from_file_location(
        "transformers.models.glm5_next._oracle_video", pkg.__path__[0] + "/video_processing_glm5_next.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from transformers.video_utils import VideoMetadata
    cases = json.loads(sys.argv[1])
    ref = module.Glm5NextVideoProcessor()
    out = {"samples": [], "patches": [], "canvas": []}
    for meta, kwargs in cases["samples"]:
        ref.max_frames = kwargs.pop("max_frames", 2048)
        out["samples"].append(ref.sample_frames(VideoMetadata(**meta), **kwargs).tolist())
    for frames, height, width in cases["patches"]:
        out["patches"].append(ref.get_num_of_video_patches(frames, height, width))
        out["canvas"].append(list(module.smart_resize(frames, height, width, 2, 28, 16, 240000)))
    video = torch.from_numpy(np.load(cases["clip"]))
    patches, t, h, w = ref.patchify(video[None], patch_size=14, merge_size=2, temporal_patch_size=2)
    np.save(cases["clip_out"], patches[0].numpy())
    out["clip_grid"] = [t, h, w]
    print(json.dumps(out))
    """
)


def test_video_processor_matches_transformers_reference(tmp_path, processor):
    ours = processor.video_processor
    samples = [
        ({"total_num_frames": 24, "fps": 1000 / 70, "duration": 1.68}, {}),
        ({"total_num_frames": 300, "fps": 30.0}, {}),
        ({"total_num_frames": 301, "fps": 29.97, "duration": 10.04}, {"fps": 1}),
        ({"total_num_frames": 3, "fps": 1.0, "duration": 3.0}, {"fps": 4}),
        ({"total_num_frames": 1000, "fps": 25.0}, {"max_frames": 9}),
        ({"total_num_frames": 7, "fps": 2.0}, {}),
    ]
    sizes = [(4, 25, 14), (2, 64, 64), (16, 480, 640), (5, 300, 451), (60, 1080, 1920), (1, 10, 1000)]
    rng = np.random.default_rng(0)
    clip = rng.standard_normal((5, 3, 56, 84)).astype(np.float32)  # odd frame count: last frame repeated
    np.save(tmp_path / "clip.npy", clip)
    cases = {
        "samples": [[meta, dict(kwargs)] for meta, kwargs in samples],
        "patches": sizes,
        "clip": str(tmp_path / "clip.npy"),
        "clip_out": str(tmp_path / "clip_out.npy"),
    }
    result = subprocess.run(
        [sys.executable, "-c", ORACLE, json.dumps(cases)], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reference = json.loads(result.stdout.strip().splitlines()[-1])

    for (meta, kwargs), expected in zip(samples, reference["samples"]):
        kwargs = dict(kwargs)
        saved = ours.max_frames
        ours.max_frames = kwargs.pop("max_frames", 2048)
        try:
            assert ours.sample_frames(VideoMetadata(**meta), **kwargs).tolist() == expected, (meta, kwargs)
        finally:
            ours.max_frames = saved
    for (frames, height, width), n_patches, canvas in zip(sizes, reference["patches"], reference["canvas"]):
        assert ours.get_num_of_video_patches(frames, height, width) == n_patches
        assert list(ours._canvas(frames, height, width, 28, 2, 16, 240000)[:2]) == canvas
    patches, t, h, w = ours.patchify(clip, 14, 2, 2)
    assert [t, h, w] == reference["clip_grid"]
    assert np.array_equal(patches, np.load(tmp_path / "clip_out.npy"))


# ------------------------------------------------------------------------------------------------ save / load

ROUND_TRIP = textwrap.dedent(
    r"""
    import json, sys, warnings
    import numpy as np
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata
    folder, inputs = sys.argv[1], np.load(sys.argv[2])
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    sys.path.insert(0, sys.argv[4])  # the package, for build_sft_example only (after the remote code is loaded)
    from glm53flash_hf.train.sft import build_sft_example
    meta = VideoMetadata(total_num_frames=24, fps=1000 / 70, duration=24 * 0.070)
    out = processor(text=str(inputs["text"]), images=[inputs["image"]], videos=[inputs["video"]],
                    video_metadata=[meta], return_tensors="np")
    messages = [{"role": "user", "content": [{"type": "image", "image": inputs["image"]}, {"type": "text", "text": "Hi"}]},
                {"role": "assistant", "reasoning_content": "R", "content": "A"}]
    sft = build_sft_example(processor, messages, return_tensors="np")
    arrays = {k: np.asarray(v) for k, v in out.items()}
    arrays.update({"sft_" + k: np.asarray(v) for k, v in sft.items()})
    np.savez(sys.argv[3], **arrays)
    print(json.dumps({"class": type(processor).__module__ + "." + type(processor).__name__,
                      "video": type(processor.video_processor).__module__,
                      "template": processor.chat_template}))
    """
)


def test_save_and_auto_processor_round_trip(tmp_path, processor, photos, gif):
    folder = tmp_path / "proc"
    processor.save_pretrained(folder)
    config = json.loads((folder / "processor_config.json").read_text())
    assert config["auto_map"] == {"AutoProcessor": "processing_glm53flash.Glm53FlashProcessor"}
    assert config["processor_class"] == "Glm53FlashProcessor"
    assert config["video_processor"]["video_processor_type"] == "Glm53FlashVideoProcessor"
    assert (folder / "processing_glm53flash.py").is_file()
    with open(CHAT_TEMPLATE_FILE, encoding="utf-8") as f:
        assert (folder / "chat_template.jinja").read_text(encoding="utf-8") == f.read()

    text = "<|user|><|begin_of_image|><|image|><|end_of_image|>and<|begin_of_video|><|video|><|end_of_video|>?"
    image = photos["coffee"]
    np.savez(tmp_path / "inputs.npz", text=np.array(text), image=image, video=gif)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), PYTHONPATH="")
    result = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP, str(folder), str(tmp_path / "inputs.npz"), str(tmp_path / "out.npz"),
         REPO],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["class"].startswith("transformers_modules.") and info["class"].endswith(".Glm53FlashProcessor")
    assert info["video"].startswith("transformers_modules.")
    assert info["template"] == processor.chat_template

    loaded = np.load(tmp_path / "out.npz")
    here = processor(text=text, images=[image], videos=[gif], video_metadata=[gif_metadata()], return_tensors="np")
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Hi"}]},
                {"role": "assistant", "reasoning_content": "R", "content": "A"}]
    sft = build_sft_example(processor, messages, return_tensors="np")
    expected = {k: np.asarray(v) for k, v in here.items()}
    expected.update({"sft_" + k: np.asarray(v) for k, v in sft.items()})
    assert sorted(loaded.files) == sorted(expected)
    for key, value in expected.items():
        assert np.array_equal(loaded[key], value), key


def _folder_without_tokenizer_config(processor, folder) -> str:
    """The processor and the tiny model's ``config.json`` saved into ``folder``, then ``tokenizer_config.json``
    deleted (the folder keeps ``tokenizer.json``)."""
    from ckpt_fixtures import tiny_config

    processor.save_pretrained(folder)
    tiny_config().save_pretrained(folder)
    os.remove(os.path.join(folder, "tokenizer_config.json"))
    assert os.path.isfile(os.path.join(folder, "tokenizer.json"))
    return str(folder)


def test_folder_without_tokenizer_config_restores_pad_eos_and_left_padding(tmp_path, processor):
    """Without tokenizer_config.json transformers gives pad None, eos None, right padding, no warning. Our processor,
    and AutoProcessor through the folder's remote code, restore what every GLM-5.3 processor saves (pad / EOS from
    config.json, left padding, the length limit, the special tokens) and warn, naming the folder and the values."""
    from transformers import AutoProcessor, AutoTokenizer

    folder = _folder_without_tokenizer_config(processor, tmp_path / "no_tokenizer_config")
    bare = AutoTokenizer.from_pretrained(folder)  # transformers' own reading of the folder
    assert (bare.pad_token, bare.eos_token, bare.padding_side) == (None, None, "right")
    config = json.loads(open(os.path.join(folder, "config.json")).read())["text_config"]
    assert config["pad_token_id"] == config["eos_token_id"][0] == processor.tokenizer.pad_token_id
    warning = (
        rf"{re.escape(folder)} has no tokenizer_config\.json: transformers would leave the tokenizer without pad and "
        rf"EOS tokens, padding on the right\. Restored as every GLM-5\.3 processor saves it: "
        rf"pad_token='<\|endoftext\|>' \(id {config['pad_token_id']}, pad_token_id of config\.json\), "
        rf"eos_token='<\|endoftext\|>' .*padding_side='left'.*model_max_length={config['max_position_embeddings']}"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "R", "content": "A"}]
    texts = ["<|user|>a longer prompt<|assistant|>", "<|user|>hi"]
    expected = processor(text=texts, padding=True, return_tensors="np")
    for load in (Glm53FlashProcessor.from_pretrained, lambda f: AutoProcessor.from_pretrained(f, trust_remote_code=True)):
        with pytest.warns(UserWarning, match=warning):
            loaded = load(folder)
        tok = loaded.tokenizer
        assert (tok.pad_token, tok.eos_token, tok.padding_side) == ("<|endoftext|>", "<|endoftext|>", "left")
        assert tok.model_max_length == config["max_position_embeddings"]
        special = {t.content for t in processor.tokenizer.added_tokens_decoder.values() if t.special}
        assert set(tok.all_special_tokens) == special and len(special) > 10  # as make_tiny saves them
        out = loaded(text=texts, padding=True, return_tensors="np")
        assert out["input_ids"][1, 0] == tok.pad_token_id and out["attention_mask"][1, 0] == 0  # left padding
        for key in expected:
            assert np.array_equal(out[key], expected[key]), key
        sft, ref = build_sft_example(loaded, messages), build_sft_example(processor, messages)
        assert all(torch.equal(torch.as_tensor(sft[k]), torch.as_tensor(ref[k])) for k in ref)


def test_folder_without_tokenizer_config_or_token_ids_is_refused(tmp_path, processor):
    """Nothing in the folder says which token pads: a clear error, not a tokenizer with pad None."""
    folder = _folder_without_tokenizer_config(processor, tmp_path / "no_ids")
    path = os.path.join(folder, "config.json")
    config = json.loads(open(path).read())
    for section in (config, config["text_config"]):
        section.pop("pad_token_id", None)
    with open(path, "w") as f:
        json.dump(config, f)
    match = (
        rf"{re.escape(folder)} has no tokenizer_config\.json, so the tokenizer has no pad_token .* neither "
        rf"{re.escape(path)} nor {re.escape(os.path.join(folder, 'generation_config.json'))} gives an pad_token_id"
    )
    with pytest.raises(ValueError, match=match):
        Glm53FlashProcessor.from_pretrained(folder)
    # generation_config.json is read next; what the caller passes is kept
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"pad_token_id": 2001}, f)
    with pytest.warns(UserWarning, match=r"pad_token='\[MASK\]' \(id 2001, pad_token_id of generation_config\.json\)"):
        loaded = Glm53FlashProcessor.from_pretrained(folder, padding_side="right")
    assert (loaded.tokenizer.pad_token_id, loaded.tokenizer.padding_side) == (2001, "right")


def test_hf_apply_chat_template_assistant_masks_agree(processor, photos):
    # transformers' own route (processor.apply_chat_template with return_assistant_tokens_mask) reads the same
    # {% generation %} spans: its mask equals our trained positions, the closing <|endoftext|> included.
    messages = [
        {"role": "user", "content": [{"type": "image", "image": photos["astronaut"]}, {"type": "text", "text": "Q"}]},
        {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "reasoning_content": "R2", "content": "A2"},
    ]
    hf = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, clear_thinking=False,
        return_tensors="pt",
    )
    ours = build_sft_example(processor, messages)
    assert ours["input_ids"].tolist() == hf["input_ids"][0].tolist()
    assert ours["mm_token_type_ids"].tolist() == hf["mm_token_type_ids"][0].tolist()
    assert (ours["labels"] != -100).long().tolist() == hf["assistant_masks"][0].tolist()
    assert ours["labels"][-1].item() == processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
