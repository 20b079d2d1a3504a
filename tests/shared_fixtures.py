"""Fixtures and helpers shared by several test files: randomised tiny models, a folder to break, the embedded tiny
checkpoint and its processor, a processor built in memory, and the command-line error helper.

A test module uses a fixture by binding it at module level (``random_lm = shared_fixtures.random_lm``), together with
the fixtures it depends on; module-scoped fixtures are then built once per importing module. Models: the tiny config
(``configuration/tiny.json``), randomised (``tests/tiny.py``).
"""

from __future__ import annotations

import pytest
import torch
from ckpt_fixtures import tiny_config
from tiny import randomize_
from transformers import PreTrainedTokenizerFast
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM, Glm53FlashForConditionalGeneration
from glm53flash_hf.processing_glm53flash import Glm53FlashProcessor, Glm53FlashVideoProcessor
from glm53flash_hf.tools.make_tiny import make_tiny

IDS = torch.tensor([[5, 17, 300, 41, 977, 5, 1999, 18, 19, 7, 3, 2]])
INF, NAN = float("inf"), float("nan")


def logits_of(model, ids=IDS):
    """``model(input_ids=ids).logits`` without gradients."""
    with torch.no_grad():
        return model(input_ids=ids).logits


# ------------------------------------------------------------------------------------------------ models


@pytest.fixture(scope="module")
def random_lm():
    """The tiny causal LM, randomised (seed 0), eval mode."""
    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(tiny_config()).eval()
    randomize_(model, 0)
    return model


@pytest.fixture(scope="module")
def random_vl():
    """The tiny vision-language model, randomised (seed 0), eval mode."""
    torch.manual_seed(0)
    model = Glm53FlashForConditionalGeneration(tiny_config()).eval()
    randomize_(model, 0)
    return model


@pytest.fixture(scope="module")
def sharded_lm_folder(random_lm, tmp_path_factory):
    """The tiny causal LM saved in 14 shards (a folder to break)."""
    path = str(tmp_path_factory.mktemp("bad") / "saved")
    random_lm.save_pretrained(path, max_shard_size="200KB")
    return path


# ----------------------------------------------------------------------------------------------- checkpoint, processors


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """The embedded tiny checkpoint (tokenizer, processor, vision tower; bf16, as ``glm53flash-make-tiny`` writes it
    by default)."""
    path = str(tmp_path_factory.mktemp("tiny") / "tiny")
    make_tiny(path, show_progress=False)
    return path


@pytest.fixture(scope="module")
def tiny_processor(tiny_checkpoint):
    """The processor of :func:`tiny_checkpoint`."""
    return Glm53FlashProcessor.from_pretrained(tiny_checkpoint)


@pytest.fixture(scope="module")
def bpe_processor():
    """A processor built in memory: the tiny trained tokenizer of tests/test_processing.py (left padding) with fresh
    image and video processors; no checkpoint folder."""
    from glm53flash_hf.tools.make_tiny import train_tokenizer

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(2000), eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        padding_side="left", clean_up_tokenization_spaces=False,
    )
    return Glm53FlashProcessor(Glm5NextImageProcessorPil(), tokenizer, Glm53FlashVideoProcessor())


# ------------------------------------------------------------------------------------------------ command line


def cli_error(main, argv, capsys) -> str:
    """Run a tool's ``main`` expecting exit status 2; return its stderr (one error line after the usage)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def finetune_argv(model, out, *extra):
    """``glm53flash-finetune`` arguments of a tiny in-process run: 1 step of 2 text samples packed into rows of 128
    tokens, no reload."""
    return ["--model", model, "--output-dir", str(out), "--no-media", "--samples", "2", "--batch-size", "2",
            "--max-length", "128", "--max-steps", "1", "--no-reload", *extra]
