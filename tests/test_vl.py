"""Vision-language model: parity with transformers' ``Glm5NextForConditionalGeneration`` on the same weights.

Images and videos are synthetic patch tensors in the vision tower's input layout (``[t*h*w, C*T*P*P]`` with
``grid_thw`` rows), and the token sequences carry the placeholder structure the processor produces:
``<|begin_of_image|><|image|>*(h*w/4)<|end_of_image|>`` for an image; for a video, per tubelet
``<|begin_of_image|><|image|>*(h*w/4)<|end_of_image|>`` + timestamp text, inside
``<|begin_of_video|> … <|end_of_video|>``.
"""

from __future__ import annotations

import pytest
import torch
from tiny import hf_reference, rel_err

IMG, BOI, EOI, BOV, EOV = 200, 201, 202, 203, 204
SPECIAL = dict(
    image_token_id=IMG,
    video_token_id=205,
    image_start_token_id=BOI,
    image_end_token_id=EOI,
    video_start_token_id=BOV,
    video_end_token_id=EOV,
)
PATCH_DIM = 3 * 2 * 14 * 14


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForConditionalGeneration

    hf = hf_reference(seed=11, top_overrides=SPECIAL)
    folder = tmp_path_factory.mktemp("hf_glm5_next_vl")
    hf.save_pretrained(folder)
    ours = Glm53FlashForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return hf, ours


def _text(gen, n):
    return torch.randint(1, 150, (n,), generator=gen).tolist()


def _image_tokens(h, w):
    return [BOI] + [IMG] * (h * w // 4) + [EOI]


def _video_tokens(t, h, w):
    ids = [BOV]
    for i in range(t):
        ids += _image_tokens(h, w) + [150 + i, 151]  # stand-ins for the "{ts:.1f} seconds" text
    return ids + [EOV]


def _batch(kind, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids, kwargs = _text(gen, 7), {}
    if kind in ("image", "both"):
        grids = torch.tensor([[1, 4, 4], [1, 2, 6]])
        for g in grids.tolist():
            ids += _image_tokens(g[1], g[2]) + _text(gen, 3)
        kwargs["pixel_values"] = torch.randn(int(grids.prod(-1).sum()), PATCH_DIM, generator=gen)
        kwargs["image_grid_thw"] = grids
    if kind in ("video", "both"):
        grid = torch.tensor([[2, 4, 2]])
        ids += _video_tokens(2, 4, 2) + _text(gen, 4)
        kwargs["pixel_values_videos"] = torch.randn(int(grid.prod()), PATCH_DIM, generator=gen)
        kwargs["video_grid_thw"] = grid
    ids += _text(gen, 5)
    return torch.tensor([ids]), kwargs


@pytest.mark.parametrize("kind", ["text", "image", "video", "both"])
def test_vl_parity_logits_and_grads(pair, kind):
    hf, ours = pair
    input_ids, kwargs = _batch(kind)
    hf.zero_grad()
    ours.zero_grad()
    ref = hf(input_ids=input_ids, use_cache=False, **kwargs).logits
    got = ours(input_ids=input_ids, **kwargs).logits
    assert rel_err(got, ref) < 1e-4
    ref.float().square().mean().backward()
    got.float().square().mean().backward()
    hf_params = dict(hf.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        r = hf_params[name]
        if r.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        assert p.grad is not None, name
        assert rel_err(p.grad, r.grad) < 1e-4, name
        checked += 1
    if kind != "text":
        assert any(n.startswith("model.visual.") and hf_params[n].grad is not None for n in hf_params)
    assert checked > 50


def test_placeholder_feature_mismatch_names_both_counts(pair):
    _, ours = pair
    input_ids, kwargs = _batch("image")
    # second image shrunk from 2x6 to 2x2 patches: 4 + 3 placeholders in the text, 4 + 1 feature rows
    kwargs["pixel_values"] = kwargs["pixel_values"][:20]
    kwargs["image_grid_thw"] = torch.tensor([[1, 4, 4], [1, 2, 2]])
    with pytest.raises(ValueError, match=r"7 image placeholder tokens in the input, 5 image feature rows"):
        ours(input_ids=input_ids, **kwargs)


def test_mm_token_type_ids_select_modalities(pair):
    """With mm_token_type_ids the modality comes from it, not from the video span markers."""
    _, ours = pair
    input_ids, kwargs = _batch("both", seed=3)
    image_mask = input_ids == IMG
    in_video = (input_ids == BOV).cumsum(-1) > (input_ids == EOV).cumsum(-1)
    types = torch.zeros_like(input_ids)
    types[image_mask & ~in_video] = 1
    types[image_mask & in_video] = 2
    with torch.no_grad():
        a = ours(input_ids=input_ids, **kwargs).logits
        b = ours(input_ids=input_ids, mm_token_type_ids=types, **kwargs).logits
    assert torch.equal(a, b)


def test_packed_vl_rows_equal_samples_alone(pair):
    _, ours = pair
    samples = [_batch("image", seed=5), _batch("video", seed=6), _batch("text", seed=7)]
    ids = torch.cat([s[0][0] for s in samples])[None]
    pos = torch.cat([torch.arange(s[0].shape[1]) for s in samples])[None]
    kwargs = {
        "pixel_values": samples[0][1]["pixel_values"],
        "image_grid_thw": samples[0][1]["image_grid_thw"],
        "pixel_values_videos": samples[1][1]["pixel_values_videos"],
        "video_grid_thw": samples[1][1]["video_grid_thw"],
    }
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=pos, **kwargs).logits[0]
        start = 0
        for s_ids, s_kwargs in samples:
            alone = ours(input_ids=s_ids, **s_kwargs).logits[0]
            assert rel_err(packed[start : start + s_ids.shape[1]], alone) < 1e-5
            start += s_ids.shape[1]


def test_embedded_default_end_to_end_with_real_photo(tmp_path):
    """make-tiny folder → AutoProcessor + AutoModelForImageTextToText (remote code) on scikit-image's astronaut."""
    import skimage.data
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from glm53flash_hf.tools.make_tiny import make_tiny

    folder = make_tiny(str(tmp_path / "tiny"), show_progress=False)
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForImageTextToText.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    assert type(processor).__module__.startswith("transformers_modules.")
    assert type(model).__module__.startswith("transformers_modules.")
    image = Image.fromarray(skimage.data.astronaut()).resize((112, 112))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    merge = model.config.vision_config.spatial_merge_size
    assert int((inputs["mm_token_type_ids"] == 1).sum()) == int(inputs["image_grid_thw"].prod()) // merge**2
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()


def test_vl_save_writes_the_published_layout(tmp_path):
    """Load the embedded default with the VL class, save it: same published keys (vision included), same values."""
    import os

    from safetensors.torch import load_file

    from glm53flash_hf.modeling_glm53flash import Glm53FlashForConditionalGeneration
    from glm53flash_hf.tools.make_tiny import make_tiny

    def tensors(folder):
        out = {}
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(folder, name)))
        return out

    src = make_tiny(str(tmp_path / "tiny"), show_progress=False)
    model = Glm53FlashForConditionalGeneration.from_pretrained(src)
    model.save_pretrained(tmp_path / "saved")
    a, b = tensors(src), tensors(tmp_path / "saved")
    assert set(a) == set(b)
    assert any(k.startswith("model.visual.") for k in b) and any(".mlp.experts.0.gate_proj." in k for k in b)
    assert all(torch.equal(a[k].float(), b[k].float()) for k in a)


def test_placeholders_without_pixels_or_inconsistent_types_raise(pair):
    _, ours = pair
    input_ids, kwargs = _batch("image", seed=8)
    with pytest.raises(ValueError, match="7 image placeholder tokens but no pixel_values"):
        ours(input_ids=input_ids)
    types = (input_ids == IMG).long()
    types[0, 0] = 1  # a text token marked as an image
    with pytest.raises(ValueError, match="must agree token for token"):
        ours(input_ids=input_ids, mm_token_type_ids=types, **kwargs)
