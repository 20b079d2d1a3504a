"""Reading and saving checkpoint folders (:mod:`glm53flash_hf.checkpoint_io`) off the happy path: a truncated shard,
interrupted saves, saves over folders of another layout, links into another folder, a file where the folder should be.

Each case gets an error whose type and message name the input, or a verified correct result: the folder loads to
the logits of the weights its files say (the previous ones after a failed save, the new ones after a save). Tiny
models (``configuration/tiny.json``, randomised) saved in 14 shards (:func:`shared_fixtures.sharded_lm_folder`).
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import shared_fixtures
import torch
from ckpt_fixtures import INDEX, read_index, tiny_config
from safetensors.torch import save_file
from shared_fixtures import logits_of as _logits
from tiny import randomize_

from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
from glm53flash_hf.tools import export

random_lm, sharded_lm_folder = shared_fixtures.random_lm, shared_fixtures.sharded_lm_folder  # fixtures


# ------------------------------------------------------------------------------------------------ loading


def test_truncated_shard_is_named(sharded_lm_folder, tmp_path):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(sharded_lm_folder, folder)
    shard = sorted(set(read_index(folder)["weight_map"].values()))[3]
    with open(os.path.join(folder, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(folder, shard)) // 2)
    with pytest.raises(ValueError, match=rf"{shard}: corrupt or truncated"):
        Glm53FlashForCausalLM.from_pretrained(folder)



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
def test_interrupted_save_leaves_previous_checkpoint(random_lm, other, sharded_lm_folder, tmp_path, monkeypatch,
                                                     new_shard_size):
    """Same shard count (200KB), a different one (100KB: more shards; 50GB: one file): a writer failing after the
    first shard leaves the previous folder loading to the previous logits, with nothing left behind."""
    folder = str(tmp_path / "ckpt")
    shutil.copytree(sharded_lm_folder, folder)
    before = sorted(os.listdir(folder))
    _failing_writer(monkeypatch, after=1 if new_shard_size != "50GB" else 0)
    with pytest.raises(OSError, match="No space left on device"):
        other.save_pretrained(folder, max_shard_size=new_shard_size)
    monkeypatch.undo()
    assert sorted(os.listdir(folder)) == before and os.listdir(tmp_path) == ["ckpt"]
    reloaded = Glm53FlashForCausalLM.from_pretrained(folder).eval()
    assert torch.equal(_logits(reloaded), _logits(random_lm))


def test_failed_processor_save_rolls_back_the_model_save(random_lm, other, sharded_lm_folder, tmp_path):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(sharded_lm_folder, folder)

    class Broken:
        def save_pretrained(self, path):
            raise RuntimeError("processor failed (test)")

    with pytest.raises(RuntimeError, match="processor failed"):
        other.save_pretrained(folder, processor=Broken())
    assert torch.equal(_logits(Glm53FlashForCausalLM.from_pretrained(folder).eval()), _logits(random_lm))


@pytest.mark.parametrize("first, second", [("50GB", "200KB"), ("200KB", "50GB")])
def test_save_over_another_layout_reloads_the_new_weights(random_lm, other, tmp_path, first, second):
    """A single model.safetensors replaced by shards + index, and the reverse: the stale layout does not survive
    (a local load prefers model.safetensors), the new weights reload; a README and a subfolder are kept."""
    folder = str(tmp_path / "ckpt")
    random_lm.save_pretrained(folder, max_shard_size=first)
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
def test_save_over_an_export_leaves_its_source_unchanged(random_lm, other, sharded_lm_folder, tmp_path, link):
    """glm53flash-export SRC OUT (weights linked), load OUT, save other weights over OUT: SRC's files are
    untouched and still load to SRC's logits; OUT loads to the new ones."""
    src = str(tmp_path / "src")
    shutil.copytree(sharded_lm_folder, src)
    digest = {n: open(os.path.join(src, n), "rb").read() for n in os.listdir(src)}
    out = str(tmp_path / "out")
    export.export(src, out, link=link, show_progress=False)
    loaded = Glm53FlashForCausalLM.from_pretrained(out).eval()
    loaded.load_state_dict(other.state_dict())
    loaded.save_pretrained(out, max_shard_size="200KB")  # same shard names as SRC's
    assert {n: open(os.path.join(src, n), "rb").read() for n in os.listdir(src)} == digest
    assert torch.equal(_logits(Glm53FlashForCausalLM.from_pretrained(src).eval()), _logits(random_lm))
    assert torch.equal(_logits(Glm53FlashForCausalLM.from_pretrained(out).eval()), _logits(other))
    assert not any(os.path.islink(os.path.join(out, n)) for n in os.listdir(out))


def test_save_through_a_symlinked_folder_replaces_the_linked_folder(other, sharded_lm_folder, tmp_path):
    real = str(tmp_path / "real")
    shutil.copytree(sharded_lm_folder, real)
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

