"""Bad inputs, as a careful user and as hostile input would give them: each case gets an error whose type and message
name the input (argument, value, what was expected), or a verified correct result.

Areas: loading, config, forward, vision, processor, generation, training data, the command-line tools, and saving
(interrupted saves, saves over folders of another layout, links into another folder). Tiny models
(``configuration/tiny.json``, randomised) and a few tokens per case.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
from ckpt_fixtures import INDEX, edit_shard, read_index, tiny_config
from safetensors.torch import save_file
from tiny import randomize_, rel_err
from transformers import StaticCache
from transformers.video_utils import VideoMetadata

from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig, Glm53FlashTextConfig, Glm53FlashVisionConfig
from glm53flash_hf.modeling_glm53flash import (
    Glm53FlashForCausalLM,
    Glm53FlashForConditionalGeneration,
    Glm53FlashTextModel,
)
from glm53flash_hf.processing_glm53flash import Glm53FlashProcessor
from glm53flash_hf.tools import crop, demo, export, finetune
from glm53flash_hf.tools.make_tiny import make_tiny
from glm53flash_hf.train.collator import Glm53FlashPackingCollator
from glm53flash_hf.train.sft import build_sft_example

VOCAB = 2048  # tiny.json
IMAGE_TOKEN = 2016
PIXEL_WIDTH = 3 * 2 * 14 * 14  # in_channels * temporal_patch_size * patch_size**2


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(tiny_config()).eval()
    randomize_(model, 0)
    return model


@pytest.fixture(scope="module")
def vl():
    torch.manual_seed(0)
    model = Glm53FlashForConditionalGeneration(tiny_config()).eval()
    randomize_(model, 0)
    return model


@pytest.fixture(scope="module")
def saved(lm, tmp_path_factory):
    """The tiny causal LM saved in 14 shards (a folder to break)."""
    path = str(tmp_path_factory.mktemp("bad") / "saved")
    lm.save_pretrained(path, max_shard_size="200KB")
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The embedded tiny checkpoint (tokenizer, processor, vision tower)."""
    path = str(tmp_path_factory.mktemp("bad") / "tiny")
    make_tiny(path, show_progress=False)
    return path


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return Glm53FlashProcessor.from_pretrained(tiny_dir)


IDS = torch.tensor([[5, 17, 300, 41, 977, 5, 1999, 18, 19, 7, 3, 2]])


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


# ------------------------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_integer_or_bool_tensor_in_checkpoint_is_named(saved, tmp_path, dtype):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved, folder)
    key = "model.language_model.norm.weight"
    edit_shard(folder, key, torch.ones(64, dtype=dtype))
    with pytest.raises(ValueError, match=rf"integer or bool.*{key} \({'I32' if dtype == torch.int32 else 'BOOL'}\)"):
        Glm53FlashForCausalLM.from_pretrained(folder)


def test_load_state_dict_rejects_integer_weights(lm):
    state = {"model.norm.weight": torch.ones(64, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight \(torch\.int64, the model holds torch\.float32\)"):
        lm.load_state_dict(state, strict=False)


def test_load_state_dict_of_floats_still_loads(lm):
    state = {k: v.clone() for k, v in lm.state_dict().items()}
    before = _logits(lm)
    assert not lm.load_state_dict(state).missing_keys
    torch.testing.assert_close(_logits(lm), before, rtol=0, atol=0)


def test_truncated_shard_is_named(saved, tmp_path):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved, folder)
    shard = sorted(set(read_index(folder)["weight_map"].values()))[3]
    with open(os.path.join(folder, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(folder, shard)) // 2)
    with pytest.raises(ValueError, match=rf"{shard}: corrupt or truncated"):
        Glm53FlashForCausalLM.from_pretrained(folder)


# ------------------------------------------------------------------------------------------------ config


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


def test_negative_size_in_config_json_names_the_field(saved, tmp_path):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved, folder)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config["text_config"]["moe_intermediate_size"] = -32
    json.dump(config, open(path, "w"))
    match = "moe_intermediate_size must be a positive integer; got moe_intermediate_size=-32"
    with pytest.raises(ValueError, match=match):
        Glm53FlashConfig.from_pretrained(folder)


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
def test_bad_input_ids(lm, ids, error, match):
    with pytest.raises(error, match=match):
        lm(input_ids=ids)


def test_bad_inputs_embeds(lm):
    match = r"inputs_embeds must be \[batch, seq, hidden_size=64\]; got shape \(1, 4, 32\)"
    with pytest.raises(ValueError, match=match):
        lm(inputs_embeds=torch.zeros(1, 4, 32))
    with pytest.raises(ValueError, match="inputs_embeds must be a floating-point tensor; got torch.int64"):
        lm(inputs_embeds=torch.zeros(1, 4, 64, dtype=torch.long))


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
def test_bad_labels(lm, labels, match):
    with pytest.raises(ValueError, match=match):
        lm(input_ids=IDS, labels=labels)


def test_float_packing_tensors_raise(lm):
    ids = IDS
    with pytest.raises(ValueError, match="cu_seq_lens_q must be an integer tensor; got dtype torch.float32"):
        lm(input_ids=ids, cu_seq_lens_q=torch.tensor([0.0, 5.5, 12.0]))
    with pytest.raises(ValueError, match="position_ids must be an integer tensor; got dtype torch.float32"):
        lm(input_ids=ids, position_ids=torch.arange(12.0)[None])


def test_additive_attention_mask_is_refused(lm):
    mask = torch.zeros(1, 12)
    mask[0, :3] = float("-inf")
    with pytest.raises(ValueError, match=r"attention_mask must be a 0/1 \(or bool\) padding mask.*got the value -inf"):
        lm(input_ids=IDS, attention_mask=mask)


def test_all_ignored_labels_give_zero_loss_and_zero_mtp_loss(lm):
    """The documented convention: no supervised token -> loss 0.0 and mtp_loss 0.0 with zero (finite) gradients,
    for the mean reduction and with num_items_in_batch; a normal batch is unchanged (negative control)."""
    labels = torch.full_like(IDS, -100)
    lm.zero_grad()
    out = lm(input_ids=IDS, labels=labels)
    assert out.loss.item() == 0.0 and out.mtp_loss.item() == 0.0
    out.loss.backward()
    grads = [p.grad for p in lm.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and not g.any() for g in grads)
    lm.zero_grad()
    out = lm(input_ids=IDS, labels=labels, num_items_in_batch=torch.tensor(7))
    assert out.loss.item() == 0.0 and out.mtp_loss.item() == 0.0
    out = lm(input_ids=IDS, labels=IDS)
    assert out.loss.item() > 1.0 and torch.isfinite(out.loss)


@pytest.mark.parametrize("nan_doc", [0, 1])
def test_nan_in_one_packed_document_stays_there(lm, nan_doc):
    """A NaN in one token's embedding: the other packed documents give their logits alone (finite), and the tokens
    of its own document before it stay finite (causal), while the NaN reaches the token itself and later ones."""
    lengths = [80, 70, 20]  # docs longer than a 64-token KDA chunk and than index_topk (sparse selection)
    gen = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 2000, (n,), generator=gen) for n in lengths]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    start = sum(lengths[:nan_doc])
    nan_at = start + 30

    def poison(_module, _inputs, output):
        output = output.clone()
        output[0, nan_at, 3] = float("nan")
        return output

    hook = lm.model.embed_tokens.register_forward_hook(poison)
    try:
        with torch.no_grad():
            packed = lm(input_ids=ids, position_ids=pos).logits[0]
    finally:
        hook.remove()
    assert torch.isnan(packed[nan_at]).any()
    assert torch.isfinite(packed[start:nan_at]).all()
    offset = 0
    for i, doc in enumerate(docs):
        if i != nan_doc:
            alone = _logits(lm, doc[None])[0]
            assert torch.isfinite(packed[offset : offset + len(doc)]).all(), f"document {i}"
            assert rel_err(packed[offset : offset + len(doc)], alone) < 1e-5, f"document {i}"
        offset += len(doc)


# ------------------------------------------------------------------------------------------------ vision


def _image_inputs(grid=((1, 2, 2),), rows=None, width=PIXEL_WIDTH):
    grid = torch.tensor(grid)
    rows = int(grid.prod(-1).sum()) if rows is None else rows
    n_tokens = int(grid.prod(-1).sum()) // 4
    ids = torch.tensor([[5, 17] + [IMAGE_TOKEN] * n_tokens + [18, 19]])
    return dict(input_ids=ids, pixel_values=torch.randn(rows, width), image_grid_thw=grid)


def test_image_inputs_that_agree_run(vl):
    with torch.no_grad():
        out = vl(**_image_inputs())
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
def test_inconsistent_image_inputs(vl, change, match):
    with pytest.raises(ValueError, match=match):
        vl(**_image_inputs(**change))


def test_image_grid_shape_dtype_and_absence(vl):
    inputs = _image_inputs()
    match = r"image_grid_thw must be \[n >= 1, 3\] rows of \(t, h, w\); got shape \(1, 2\)"
    with pytest.raises(ValueError, match=match):
        vl(**dict(inputs, image_grid_thw=torch.tensor([[2, 2]])))
    with pytest.raises(ValueError, match="image_grid_thw must be an integer tensor; got dtype torch.float32"):
        vl(**dict(inputs, image_grid_thw=inputs["image_grid_thw"].float()))
    with pytest.raises(ValueError, match="pixel_values needs image_grid_thw"):
        vl(**dict(inputs, image_grid_thw=None))


def test_video_grid_must_match_pixels(vl):
    ids = torch.tensor([[5, 2012, 2010, IMAGE_TOKEN, 2011, 2013, 7]])
    with pytest.raises(ValueError, match=r"video_grid_thw \[\[2, 2, 2\]\] describes 8 patches .* pixel_values_videos "
                                         r"has 4 rows"):
        vl(input_ids=ids, pixel_values_videos=torch.randn(4, PIXEL_WIDTH), video_grid_thw=torch.tensor([[2, 2, 2]]))


# ------------------------------------------------------------------------------------------------ processor


def _clip(frames=4):
    return np.random.default_rng(0).integers(0, 255, (frames, 56, 56, 3), dtype=np.uint8)


def test_processor_fps_must_be_positive(processor):
    meta = VideoMetadata(total_num_frames=4, fps=2.0)
    with pytest.raises(ValueError, match=r"fps \(frames sampled per second\) must be a finite number > 0; got fps=0"):
        processor.video_processor(videos=[_clip()], video_metadata=[meta], fps=0)
    with pytest.raises(ValueError, match=r"video_metadata.fps must be a finite number > 0; got fps=-2.0"):
        processor.video_processor(videos=[_clip()], video_metadata=[VideoMetadata(total_num_frames=4, fps=-2.0)])


@pytest.mark.parametrize("total", [100, 2])
def test_total_num_frames_must_describe_the_clip(processor, total):
    meta = VideoMetadata(total_num_frames=total, fps=2.0)
    with pytest.raises(ValueError, match=rf"video 0: video_metadata.total_num_frames={total} but the clip holds 4 "
                                         "frames"):
        processor.video_processor(videos=[_clip()], video_metadata=[meta])


@pytest.mark.parametrize(
    "indices, match",
    [
        ([0, 2, 1, 3], r"video 0: video_metadata.frames_indices decrease at position 2 \(2 then 1\)"),
        ([-4, -2, 0, 2], r"video 0: video_metadata.frames_indices starts at -4; indices must be >= 0"),
        ([0, 2, 4], r"video 0: video_metadata.frames_indices has 3 entries but the clip holds 4 frames"),
    ],
)
def test_presampled_frame_indices_are_checked(processor, indices, match):
    meta = VideoMetadata(total_num_frames=8, fps=2.0, frames_indices=indices)
    with pytest.raises(ValueError, match=match):
        processor(text="<|video|>", videos=[_clip()], video_metadata=[meta], do_sample_frames=False)


def test_presampled_frames_with_good_indices_give_their_timestamps(processor):
    meta = VideoMetadata(total_num_frames=8, fps=2.0, frames_indices=[0, 2, 4, 6])
    out = processor(text="<|video|>", videos=[_clip()], video_metadata=[meta], do_sample_frames=False)
    text = processor.tokenizer.decode(out["input_ids"][0])
    assert "0.0 seconds" in text and "2.0 seconds" in text  # tubelets start at frames 0 and 4 -> 0 s and 2 s


def test_processor_folder_without_tokenizer(tiny_dir, tmp_path):
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    for name in ("processor_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(os.path.join(tiny_dir, name), folder / name)
    with pytest.raises(FileNotFoundError, match=rf"{folder}: no tokenizer files \(looked for tokenizer.json"):
        Glm53FlashProcessor.from_pretrained(str(folder))
    with pytest.raises(FileNotFoundError, match=r"is not a folder: Glm53FlashProcessor.from_pretrained"):
        Glm53FlashProcessor.from_pretrained(str(tmp_path / "absent"))


# ------------------------------------------------------------------------------------------------ generation


def test_static_cache_shorter_than_prompt_plus_new_tokens(lm):
    for name in ("cache", "past_key_values"):
        cache = StaticCache(config=lm.config, max_cache_len=16)
        with pytest.raises(ValueError, match=r"StaticCache of max_cache_len=16 but generate needs 20 positions "
                                             r"\(prompt 12 \+ max_new_tokens 8\)"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # past_key_values: the older spelling
            lm.generate(IDS, max_new_tokens=8, do_sample=False, **{name: cache})
    cache = StaticCache(config=lm.config, max_cache_len=8)
    match = r"holds 8 tokens \(max_cache_len\) but this call needs 12 \(0 cached \+ 12 new\)"
    with pytest.raises(ValueError, match=match):
        lm(input_ids=IDS, past_key_values=cache, use_cache=True)


def test_static_cache_that_fits_generates(lm):
    cache = StaticCache(config=lm.config, max_cache_len=20)
    out = lm.generate(IDS, cache=cache, max_new_tokens=8, do_sample=False)
    ref = lm.generate(IDS, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, ref)


def test_static_cache_with_assisted_generation_raises(lm):
    """A StaticCache's KDA layers cannot roll back into a verification call (transformers 5.25 calls them croppable
    and failed inside crop)."""
    cache = StaticCache(config=lm.config, max_cache_len=32)
    match = r"needs a cache whose KDA layers can be cropped; the StaticCache given has \d+ plain linear-attention"
    with pytest.raises(ValueError, match=match + r" layers \(the first: layer 0\)"):
        lm.generate(IDS, cache=cache, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=3)


# ------------------------------------------------------------------------------------------------ training data


def test_sft_example_without_assistant_turn(processor):
    messages = [{"role": "user", "content": "Hello!"}]
    with pytest.raises(ValueError, match=r"sample 'ex-3': the conversation has no assistant turn \(roles \['user'\]\)"):
        build_sft_example(processor, messages, sample_id="ex-3")


def test_sft_example_with_nothing_trained_warns(processor):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "loss": False}]
    with pytest.warns(UserWarning, match=r"sample 'ex-4': no trained token"):
        example = build_sft_example(processor, messages, sample_id="ex-4")
    assert (example["labels"] == -100).all()


def test_collator_names_samples_without_trained_labels():
    collator = Glm53FlashPackingCollator(max_length=16, pad_token_id=0)
    features = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "name": "good"},
                {"input_ids": [4, 5, 6], "labels": [-100, -100, -100], "name": "topic:pass"}]
    with pytest.warns(UserWarning, match=r"1 of 2 samples have no trained label .*\['topic:pass'\]"):
        batch = collator(features)
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, -100, -100]]


# ------------------------------------------------------------------------------------------------ command line


def _cli_error(main, argv, capsys) -> str:
    """Run a tool's ``main`` expecting exit status 2; return its stderr (one error line after the usage)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_finetune_missing_model_is_one_line(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    err = _cli_error(finetune.main, ["--model", missing, "--output-dir", str(tmp_path / "out")], capsys)
    assert f"--model {missing!r}: no such folder" in err
    assert not os.path.exists(tmp_path / "out")


def test_finetune_missing_model_in_a_fresh_process_is_one_line(tmp_path):
    """As a user runs it: a missing folder and an unknown Hub id (offline) each end with exit status 2 and one
    ``error:`` line, no traceback, nothing written."""
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for model, says in ((str(tmp_path / "nope"), "no such folder"), ("org/missing-model", "couldn't")):
        proc = subprocess.run(
            [sys.executable, "-m", "glm53flash_hf.tools.finetune", "--model", model, "--output-dir",
             str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"glm53flash-finetune: error: --model {model!r}: ") and says in last, last
        assert "Traceback" not in proc.stderr and not os.path.exists(tmp_path / "out")


def test_finetune_model_folder_without_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = _cli_error(finetune.main, ["--model", str(tmp_path / "empty")], capsys)
    assert "the folder holds no config.json, so no checkpoint" in err


def test_finetune_output_dir_equal_to_model_is_refused(tiny_dir, capsys):
    err = _cli_error(finetune.main, ["--model", tiny_dir, "--output-dir", tiny_dir], capsys)
    assert f"--output-dir={tiny_dir!r} is the input {tiny_dir!r}" in err and "must differ from --model" in err


def test_finetune_output_dir_inside_or_linking_into_model_is_refused(tiny_dir, tmp_path, capsys):
    err = _cli_error(finetune.main, ["--model", tiny_dir, "--output-dir", os.path.join(tiny_dir, "sub")], capsys)
    assert "lies inside the input" in err
    linked = str(tmp_path / "exported")
    export.export(tiny_dir, linked, show_progress=False)  # weights symlinked into tiny_dir
    err = _cli_error(finetune.main, ["--model", tiny_dir, "--output-dir", linked], capsys)
    assert "links into the input" in err and "model.safetensors.index.json" in err
    alias = str(tmp_path / "alias")
    os.symlink(tiny_dir, alias)
    err = _cli_error(finetune.main, ["--model", alias, "--output-dir", tiny_dir], capsys)
    assert "is the input" in err


def test_export_and_crop_refuse_their_input(tiny_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"OUT=.* is the input .*OUT must differ from SRC"):
        export.export(tiny_dir, tiny_dir, show_progress=False)
    with pytest.raises(ValueError, match=r"OUT=.* lies inside the input"):
        export.export(tiny_dir, os.path.join(tiny_dir, "exported"), show_progress=False)
    os.mkdir(tmp_path / "hard")
    for name in os.listdir(tiny_dir):
        if name.endswith(".safetensors"):
            os.link(os.path.join(tiny_dir, name), tmp_path / "hard" / name)
    with pytest.raises(ValueError, match=r"links into the input .* is a hard link to one of its files"):
        export.export(tiny_dir, str(tmp_path / "hard"), overwrite=False, show_progress=False)
    err = _cli_error(crop.main, [tiny_dir, tiny_dir, "--layers", "2", "--no-progress"], capsys)
    assert "is the input" in err


@pytest.mark.parametrize("make", [False, True])
def test_demo_does_not_create_a_checkpoint_where_there_is_none(tmp_path, capsys, make):
    path = tmp_path / "not-a-checkpoint"
    if make:
        path.mkdir()
    err = _cli_error(demo.main, ["--model", str(path)], capsys)
    assert ("holds no config.json" if make else "does not exist") in err
    assert (not path.exists()) if not make else os.listdir(path) == []


# ------------------------------------------------------------------------------------------------ saving


def _two_models():
    torch.manual_seed(1)
    other = Glm53FlashForCausalLM(tiny_config()).eval()
    randomize_(other, 1)
    return other


@pytest.fixture(scope="module")
def other():
    return _two_models()


def _failing_writer(monkeypatch, after: int = 1):
    """Make transformers' shard writer fail after ``after`` shards (a full disk in the middle of a save)."""
    import transformers.modeling_utils as modeling_utils

    real, calls = modeling_utils.safe_save_file, [0]

    def write(*args, **kwargs):
        calls[0] += 1
        if calls[0] > after:
            raise OSError("No space left on device (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_save_file", write)


@pytest.mark.parametrize("new_shard_size", ["200KB", "100KB", "50GB"])
def test_interrupted_save_leaves_previous_checkpoint(lm, other, saved, tmp_path, monkeypatch, new_shard_size):
    """Same shard count (200KB), a different one (100KB: more shards; 50GB: one file): a writer failing after the
    first shard leaves the previous folder loading to the previous logits, with nothing left behind."""
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved, folder)
    before = sorted(os.listdir(folder))
    _failing_writer(monkeypatch, after=1 if new_shard_size != "50GB" else 0)
    with pytest.raises(OSError, match="No space left on device"):
        other.save_pretrained(folder, max_shard_size=new_shard_size)
    monkeypatch.undo()
    assert sorted(os.listdir(folder)) == before and os.listdir(tmp_path) == ["ckpt"]
    reloaded = Glm53FlashForCausalLM.from_pretrained(folder).eval()
    assert torch.equal(_logits(reloaded), _logits(lm))


def test_failed_processor_save_rolls_back_the_model_save(lm, other, saved, tmp_path):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved, folder)

    class Broken:
        def save_pretrained(self, path):
            raise RuntimeError("processor failed (test)")

    with pytest.raises(RuntimeError, match="processor failed"):
        other.save_pretrained(folder, processor=Broken())
    assert torch.equal(_logits(Glm53FlashForCausalLM.from_pretrained(folder).eval()), _logits(lm))


@pytest.mark.parametrize("first, second", [("50GB", "200KB"), ("200KB", "50GB")])
def test_save_over_another_layout_reloads_the_new_weights(lm, other, tmp_path, first, second):
    """A single model.safetensors replaced by shards + index, and the reverse: the stale layout does not survive
    (a local load prefers model.safetensors), the new weights reload; a README and a subfolder are kept."""
    folder = str(tmp_path / "ckpt")
    lm.save_pretrained(folder, max_shard_size=first)
    (tmp_path / "ckpt" / "README.md").write_text("my notes")
    (tmp_path / "ckpt" / "adapter").mkdir()
    (tmp_path / "ckpt" / "adapter" / "adapter_config.json").write_text("{}")
    other.save_pretrained(folder, max_shard_size=second)
    names = os.listdir(folder)
    assert ("model.safetensors" in names) == (second == "50GB") and (INDEX in names) == (second != "50GB")
    assert not any(n.startswith("model-") for n in names) if second == "50GB" else True
    assert (tmp_path / "ckpt" / "README.md").read_text() == "my notes"
    assert (tmp_path / "ckpt" / "adapter" / "adapter_config.json").is_file()
    assert torch.equal(_logits(Glm53FlashForCausalLM.from_pretrained(folder).eval()), _logits(other))


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_save_over_an_export_leaves_its_source_unchanged(lm, other, saved, tmp_path, link):
    """glm53flash-export SRC OUT (weights linked), load OUT, save other weights over OUT: SRC's files are
    untouched and still load to SRC's logits; OUT loads to the new ones."""
    src = str(tmp_path / "src")
    shutil.copytree(saved, src)
    digest = {n: open(os.path.join(src, n), "rb").read() for n in os.listdir(src)}
    out = str(tmp_path / "out")
    export.export(src, out, link=link, show_progress=False)
    loaded = Glm53FlashForCausalLM.from_pretrained(out).eval()
    loaded.load_state_dict(other.state_dict())
    loaded.save_pretrained(out, max_shard_size="200KB")  # same shard names as SRC's
    assert {n: open(os.path.join(src, n), "rb").read() for n in os.listdir(src)} == digest
    assert torch.equal(_logits(Glm53FlashForCausalLM.from_pretrained(src).eval()), _logits(lm))
    assert torch.equal(_logits(Glm53FlashForCausalLM.from_pretrained(out).eval()), _logits(other))
    assert not any(os.path.islink(os.path.join(out, n)) for n in os.listdir(out))


def test_save_through_a_symlinked_folder_replaces_the_linked_folder(other, saved, tmp_path):
    real = str(tmp_path / "real")
    shutil.copytree(saved, real)
    os.symlink(real, tmp_path / "alias")
    other.save_pretrained(str(tmp_path / "alias"))
    assert os.path.islink(tmp_path / "alias") and os.path.isfile(os.path.join(real, "model.safetensors"))
    assert torch.equal(_logits(Glm53FlashForCausalLM.from_pretrained(real).eval()), _logits(other))


def test_save_into_a_file_path_raises(other, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"save_directory=.*file' is a file; expected a folder"):
        other.save_pretrained(str(tmp_path / "file"))


def test_save_writes_new_files_only(other, tmp_path):
    """No file of the saved folder is a link, and no stray temporary or backup folder is left beside it."""
    folder = tmp_path / "ckpt"
    other.save_pretrained(str(folder))
    other.save_pretrained(str(folder), max_shard_size="200KB")
    assert os.listdir(tmp_path) == ["ckpt"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        files = os.listdir(folder)
    assert all(not os.path.islink(folder / n) and os.stat(folder / n).st_nlink == 1 for n in files)
    save_file({"x": torch.zeros(1)}, str(folder / "stray.safetensors"))
    other.save_pretrained(str(folder), max_shard_size="200KB")
    assert "stray.safetensors" in os.listdir(folder)  # not a model weight name: kept, never read by a load
