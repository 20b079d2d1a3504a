"""Glm53FlashPackingCollator: packed SFT rows equal the samples run alone.

Inputs are real: "Explain <topic>" conversations answered with CPython's ``pydoc_data.topics`` text and
scikit-image's bundled photos (astronaut, chelsea), turned into SFT examples by ``build_sft_example`` with the
embedded processor and run through the embedded default checkpoint (``make_tiny``) loaded with remote code.
Reference: each sample run alone through the same model (logits, loss); the label/position conventions are
those of transformers' ``DataCollatorWithFlattening``. Samples without an assistant turn or without a trained token
are refused or named with a warning (``build_sft_example`` with the embedded checkpoint's processor, the collator).
"""

from __future__ import annotations

import pytest
import shared_fixtures
import torch
from tiny import rel_err

from glm53flash_hf.train.collator import Glm53FlashPackingCollator
from glm53flash_hf.train.sft import build_sft_example

tiny_checkpoint, tiny_processor = shared_fixtures.tiny_checkpoint, shared_fixtures.tiny_processor  # fixtures

TOPICS = ["assert", "break", "continue", "pass", "global", "lambda"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoProcessor

    from glm53flash_hf.tools.make_tiny import make_tiny

    folder = make_tiny(str(tmp_path_factory.mktemp("collator") / "tiny"), show_progress=False)
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    return folder, processor


def _text_example(processor, topic, chars, max_length=None):
    from pydoc_data.topics import topics

    messages = [
        {"role": "user", "content": f"Explain {topic}"},
        {"role": "assistant", "content": topics[topic][:chars]},
    ]
    return build_sft_example(processor, messages, max_length=max_length, sample_id=topic)


def _image_example(processor, name, question, answer):
    import skimage.data
    from PIL import Image

    image = Image.fromarray(getattr(skimage.data, name)()).resize((112, 112))
    messages = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": answer},
    ]
    return build_sft_example(processor, messages, sample_id=name)


def _spans(collator, examples):
    """(row, start, end) of each sample in the packed batch, from the collator's plan."""
    plan = collator.plan([len(e["input_ids"]) for e in examples])
    where = {}
    for r, row in enumerate(plan):
        start = 0
        for i in row:
            n = len(examples[i]["input_ids"])
            where[i] = (r, start, start + n)
            start += n
    return plan, where


def _check_layout(batch, examples, where):
    """Labels -100 at every sample's first token and on padding, else the sample's own; positions restart."""
    labels, pos = batch["labels"], batch["position_ids"]
    covered = torch.zeros_like(labels, dtype=torch.bool)
    for i, ex in enumerate(examples):
        r, a, b = where[i]
        covered[r, a:b] = True
        assert labels[r, a].item() == -100
        assert torch.equal(labels[r, a + 1 : b], ex["labels"][1:])
        assert torch.equal(batch["input_ids"][r, a:b], ex["input_ids"])
        assert torch.equal(batch["mm_token_type_ids"][r, a:b], ex["mm_token_type_ids"])
        assert torch.equal(pos[r, a:b], torch.arange(b - a))
    assert bool((labels[~covered] == -100).all())
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert int(batch["cu_seq_lens_q"][-1]) == labels.numel()
    assert batch["max_length_q"] == int((batch["cu_seq_lens_q"][1:] - batch["cu_seq_lens_q"][:-1]).max())


def test_text_rows_equal_samples_alone_logits_and_loss(tiny):
    from transformers import AutoModelForCausalLM

    folder, processor = tiny
    examples = [_text_example(processor, t, c, max_length=72) for t, c in zip(TOPICS, (40, 300, 90, 10, 300, 60))]
    lengths = [len(e["input_ids"]) for e in examples]
    max_length = max(lengths) + min(lengths)
    collator = Glm53FlashPackingCollator(max_length=max_length, pad_token_id=processor.tokenizer.pad_token_id)
    batch = collator(examples)
    plan, where = _spans(collator, examples)
    assert len(plan) > 1 and any(len(row) > 1 for row in plan), plan  # several rows, several samples per row
    assert batch["input_ids"].shape[1] <= max_length
    _check_layout(batch, examples, where)
    assert len(batch["cu_seq_lens_q"]) - 1 > len(examples)  # at least one padding segment

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        packed = model(**batch, mtp=False)
        total, count = 0.0, 0
        for i, ex in enumerate(examples):
            alone = model(input_ids=ex["input_ids"][None], labels=ex["labels"][None], mtp=False)
            r, a, b = where[i]
            err = rel_err(packed.logits[r, a:b], alone.logits[0])
            assert err < 1e-5, (i, err)
            n = int((ex["labels"][1:] != -100).sum())
            total, count = total + alone.loss.item() * n, count + n
    assert abs(packed.loss.item() - total / count) < 1e-5 * max(1.0, abs(total / count))


def test_vl_rows_equal_samples_alone(tiny):
    from pydoc_data.topics import topics

    from transformers import AutoModelForImageTextToText

    folder, processor = tiny
    examples = [
        _image_example(processor, "astronaut", "Who is this?", "An astronaut."),
        _image_example(processor, "chelsea", "Describe the picture in detail.", topics["pass"][:400]),
        _text_example(processor, "assert", 120),
        _image_example(processor, "chelsea", "What animal?", "A cat."),
    ]
    for k in (0, 1, 3):
        assert int((examples[k]["mm_token_type_ids"] == 1).sum()) > 0
    lengths = [len(e["input_ids"]) for e in examples]
    assert lengths[1] >= lengths[0] + lengths[3]
    model = AutoModelForImageTextToText.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()

    # One row (max_length=None) and first-fit rows where sample 3 overtakes sample 1 (placement order != index).
    for max_length in (None, lengths[1]):
        collator = Glm53FlashPackingCollator(max_length=max_length, pad_token_id=processor.tokenizer.pad_token_id)
        batch = collator(examples)
        plan, where = _spans(collator, examples)
        if max_length is not None:
            assert plan[0][0] == 0 and 3 in plan[0] and plan[-1] == [1], plan
        _check_layout(batch, examples, where)
        order = [i for row in plan for i in row if "pixel_values" in examples[i]]
        assert torch.equal(batch["image_grid_thw"], torch.cat([examples[i]["image_grid_thw"] for i in order]))
        assert torch.equal(batch["pixel_values"], torch.cat([examples[i]["pixel_values"] for i in order]))
        with torch.no_grad():
            packed = model(**batch).logits
            for i, ex in enumerate(examples):
                kwargs = {k: ex[k] for k in ("pixel_values", "image_grid_thw") if k in ex}
                alone = model(input_ids=ex["input_ids"][None], mm_token_type_ids=ex["mm_token_type_ids"][None],
                              **kwargs).logits[0]
                r, a, b = where[i]
                err = rel_err(packed[r, a:b], alone)
                assert err < 1e-5, (max_length, i, err)


def test_first_token_never_supervised_even_when_trained():
    """A sample whose labels train its first token (labels = input_ids) still gets -100 there when packed."""
    examples = [{"input_ids": torch.arange(5) + 10 * k, "labels": torch.arange(5) + 10 * k} for k in range(3)]
    batch = Glm53FlashPackingCollator(max_length=11, pad_to_max_length=True, return_seq_idx=True)(examples)
    assert batch["labels"].tolist() == [
        [-100, 1, 2, 3, 4, -100, 11, 12, 13, 14, -100],
        [-100, 21, 22, 23, 24, -100, -100, -100, -100, -100, -100],
    ]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 10, 11, 16, 22]
    assert batch["seq_idx"].tolist() == [[0] * 5 + [1] * 5 + [2], [3] * 5 + [4] * 6]
    assert batch["max_length_q"] == 6
    assert batch["input_ids"][1, 5:].tolist() == [0] * 6


def test_layout_matches_the_models_boundaries():
    """The batch's kwargs give the model's DocumentLayout one segment per sample plus one per padding run."""
    from glm53flash_hf.packing import build_layout

    examples = [{"input_ids": [1] * n} for n in (4, 3, 6, 2)]
    batch = Glm53FlashPackingCollator(max_length=8, pad_to_max_length=True)(examples)
    R, L = batch["input_ids"].shape
    assert (R, L) == (2, 8)
    with_cu = build_layout(R, L, "cpu", position_ids=batch["position_ids"], cu_seq_lens_q=batch["cu_seq_lens_q"])
    pos_only = build_layout(R, L, "cpu", position_ids=batch["position_ids"])
    assert with_cu.cu_seqlens.tolist() == pos_only.cu_seqlens.tolist() == batch["cu_seq_lens_q"].tolist()
    assert with_cu.cu_seqlens.tolist() == [0, 4, 7, 8, 14, 16]


def test_over_long_sample_raises_naming_index_and_lengths():
    examples = [{"input_ids": [1, 2, 3]}, {"input_ids": list(range(9))}]
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens, more than the collator's max_length=8"):
        Glm53FlashPackingCollator(max_length=8)(examples)


def test_malformed_samples_raise():
    collator = Glm53FlashPackingCollator(max_length=8)
    with pytest.raises(ValueError, match="sample 0: labels has 2 entries but input_ids has 3"):
        collator([{"input_ids": [1, 2, 3], "labels": [1, 2]}])
    with pytest.raises(ValueError, match="sample 0: attention_mask has zeros"):
        collator([{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 0]}])
    with pytest.raises(ValueError, match="pixel_values and image_grid_thw must be given together"):
        collator([{"input_ids": [1, 2, 3], "pixel_values": torch.zeros(4, 8)}])
    with pytest.raises(ValueError, match=r"needs 4 rows"):
        collator([{"input_ids": [1], "pixel_values": torch.zeros(3, 8), "image_grid_thw": torch.tensor([[1, 2, 2]])}])
    with pytest.raises(ValueError, match="every example is empty"):
        collator([{"input_ids": []}])


# --------------------------------------------------------------------------------------- samples without trained tokens


def test_sft_example_without_assistant_turn(tiny_processor):
    messages = [{"role": "user", "content": "Hello!"}]
    with pytest.raises(ValueError, match=r"sample 'ex-3': the conversation has no assistant turn \(roles \['user'\]\)"):
        build_sft_example(tiny_processor, messages, sample_id="ex-3")


def test_sft_example_with_nothing_trained_warns(tiny_processor):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "loss": False}]
    with pytest.warns(UserWarning, match=r"sample 'ex-4': no trained token"):
        example = build_sft_example(tiny_processor, messages, sample_id="ex-4")
    assert (example["labels"] == -100).all()


def test_collator_names_samples_without_trained_labels():
    collator = Glm53FlashPackingCollator(max_length=16, pad_token_id=0)
    features = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "name": "good"},
                {"input_ids": [4, 5, 6], "labels": [-100, -100, -100], "name": "topic:pass"}]
    with pytest.warns(UserWarning, match=r"1 of 2 samples have no trained label .*\['topic:pass'\]"):
        batch = collator(features)
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, -100, -100]]

