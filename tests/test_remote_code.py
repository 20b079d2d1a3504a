"""Remote code and Auto classes: a ``glm53flash-make-tiny`` folder and a ``glm53flash-export`` folder load in a
fresh process (``HF_HUB_OFFLINE=1``, fresh ``HF_MODULES_CACHE``) through ``AutoConfig`` / ``AutoModelForCausalLM``
/ ``AutoModel`` / ``AutoTokenizer`` with the classes taken from ``transformers_modules``; the same folder loads in
transformers' built-in ``Glm5NextForConditionalGeneration`` without remote code with the same logits; the round
trip load → save → load is bit-identical.

Tolerances: the same implementation in two processes must agree exactly; ours vs the built-in class uses the
parity tests' 1e-4 relative (max abs error / max abs reference).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny import randomize_, read_checkpoint_tensors, rel_err

from glm53flash_hf.modeling_glm53flash import AUTO_MAP, Glm53FlashForCausalLM
from glm53flash_hf.tools.export import export, link_file, remote_code_files
from glm53flash_hf.tools.export import main as export_main
from glm53flash_hf.tools.make_tiny import DEFAULT_CONFIG, make_tiny

TOL = 1e-4
TEXT = "The if statement is used for conditional execution: if x > 0: print(x) else: pass"


_tensors = read_checkpoint_tensors


def _assert_bit_identical(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


def _builtin_config():
    """transformers' Glm5NextConfig from configuration/tiny.json (the built-in class has no MTP layer), with 8
    indexer heads: tiny.json's 2 heads give exactly tied pool scores (relu zeros) even for random weights, and the
    two implementations may break such ties differently once selection is sparse."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig

    data = json.load(open(DEFAULT_CONFIG))
    for field in ("num_nextn_predict_layers", "kernels"):
        data["text_config"].pop(field)
    data["text_config"]["index_n_heads"] = 8
    data["architectures"] = ["Glm5NextForConditionalGeneration"]
    return Glm5NextConfig(**data)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The make-tiny folder, a checkpoint written by the built-in class (randomised) and its export."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    root = tmp_path_factory.mktemp("remote")
    tiny = str(root / "tiny")
    make_tiny(tiny, seed=0, show_progress=False)
    config = _builtin_config()
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    builtin = Glm5NextForConditionalGeneration(config).float().eval()
    randomize_(builtin, seed=3)
    builtin_dir = str(root / "builtin")
    builtin.save_pretrained(builtin_dir)
    exported = str(root / "exported")
    written = export(builtin_dir, exported, show_progress=False)
    return {"root": root, "tiny": tiny, "builtin": builtin, "builtin_dir": builtin_dir, "exported": exported,
            "written": written}


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    tiny, exported, out, text, threads = sys.argv[1:6]
    torch.set_num_threads(int(threads))  # the parent's: the two processes compare bit for bit
    res = {}
    tok = AutoTokenizer.from_pretrained(tiny)
    res["tokenizer_class"] = type(tok).__name__
    ids = torch.tensor([tok(text).input_ids])
    res["ids"] = ids
    config = AutoConfig.from_pretrained(tiny, trust_remote_code=True)
    res["config_module"] = type(config).__module__
    lm = AutoModelForCausalLM.from_pretrained(tiny, trust_remote_code=True, dtype=torch.float32).eval()
    res["lm_module"] = type(lm).__module__
    with torch.no_grad():
        res["lm_logits"] = lm(input_ids=ids).logits
    try:  # recorded, checked by test_auto_model
        base = AutoModel.from_pretrained(tiny, trust_remote_code=True, dtype=torch.float32).eval()
        res["base_module"] = type(base).__module__
        with torch.no_grad():
            res["base_hidden"] = base(input_ids=ids).last_hidden_state
    except Exception as error:
        res["base_error"] = f"{type(error).__name__}: {error}"
    ex = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True, dtype=torch.float32).eval()
    res["export_module"] = type(ex).__module__
    with torch.no_grad():
        res["export_logits"] = ex(input_ids=ids).logits
    res["package_imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "glm53flash_hf")
    torch.save(res, out)
    """
)


@pytest.fixture(scope="module")
def remote(folders):
    """Run the Auto classes in a fresh process: offline, fresh module cache, cwd outside the repository."""
    root = folders["root"]
    out = str(root / "remote.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(root / "modules"))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, folders["tiny"], folders["exported"], out, TEXT, str(torch.get_num_threads())],
        cwd=str(root), env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=False)


def test_auto_classes_fresh_process(folders, remote):
    assert remote["package_imported"] == []  # everything came from the folder's code files
    for key in ("config_module", "lm_module", "export_module"):
        assert remote[key].startswith("transformers_modules."), (key, remote[key])
    assert remote["config_module"].endswith(".configuration_glm53flash")
    assert remote["lm_module"].endswith(".modeling_glm53flash")
    assert remote["tokenizer_class"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    from transformers import AutoTokenizer

    ids = torch.tensor([AutoTokenizer.from_pretrained(folders["tiny"])(TEXT).input_ids])
    assert torch.equal(remote["ids"], ids)
    ours = Glm53FlashForCausalLM.from_pretrained(folders["tiny"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ours(input_ids=ids).logits
    assert torch.equal(remote["lm_logits"], logits)


def test_auto_model(folders, remote):
    assert "base_error" not in remote, remote.get("base_error")
    assert remote["base_module"].startswith("transformers_modules.")
    ours = Glm53FlashForCausalLM.from_pretrained(folders["tiny"], dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = ours.model(input_ids=remote["ids"]).last_hidden_state
    assert torch.equal(remote["base_hidden"], hidden)


def test_builtin_class_without_remote_code(folders):
    """The make-tiny folder in transformers' own glm5_next (no trust_remote_code): all weights, vision included,
    load; only the MTP layer (which the built-in class lacks) is unexpected; same logits as ours."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tiny = folders["tiny"]
    builtin, info = AutoModelForImageTextToText.from_pretrained(
        tiny, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert type(builtin).__module__ == "transformers.models.glm5_next.modeling_glm5_next"
    n = builtin.config.text_config.num_hidden_layers
    assert not info["missing_keys"] and not info["mismatched_keys"]
    mtp = f"model.language_model.layers.{n}."
    assert info["unexpected_keys"] and all(k.startswith(mtp) for k in info["unexpected_keys"])
    ours = Glm53FlashForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    # Shorter than index_topk + index_kpool - 1: every pool is selected, so the default init's exactly tied pool
    # scores (gate ones, ape zeros) cannot make the two top-k implementations pick differently.
    text = ours.config.get_text_config()
    ids = torch.tensor([AutoTokenizer.from_pretrained(tiny)(TEXT).input_ids[:12]])
    assert ids.shape[1] < text.index_topk + text.index_kpool - 1
    with torch.no_grad():
        err = rel_err(ours(input_ids=ids).logits, builtin.eval()(input_ids=ids).logits)
    assert err < TOL, err


def test_our_save_matches_builtin_on_long_input(folders, tmp_path):
    """Non-degenerate weights and a sequence long enough for sparse KPool selection: built-in save → our load →
    our save → built-in load gives the built-in model's logits."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    reference = folders["builtin"]
    ours = Glm53FlashForCausalLM.from_pretrained(folders["builtin_dir"], dtype=torch.float32).eval()
    ours.save_pretrained(tmp_path)
    builtin, info = Glm5NextForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert info["missing_keys"] and all(k.startswith("model.visual.") for k in info["missing_keys"])
    assert not info["unexpected_keys"]
    text = reference.config.text_config
    ids = torch.randint(0, 2000, (1, 48), generator=torch.Generator().manual_seed(0))
    assert ids.shape[1] > 2 * (text.index_topk + text.index_kpool)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        err_ours = rel_err(ours(input_ids=ids).logits, expected)
        err_builtin = rel_err(builtin.eval()(input_ids=ids).logits, expected)
    assert err_ours < TOL, err_ours
    assert err_builtin < TOL, err_builtin


def test_round_trip_bit_identical(folders, tmp_path):
    source = _tensors(folders["tiny"])
    Glm53FlashForCausalLM.from_pretrained(folders["tiny"]).save_pretrained(tmp_path / "a")
    Glm53FlashForCausalLM.from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "b")
    a, b = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    _assert_bit_identical(a, b)
    # ... and equal to the make-tiny tensors (the text-only class drops the vision tower).
    _assert_bit_identical(a, {k: v for k, v in source.items() if not k.startswith("model.visual.")})
    config_a = json.load(open(tmp_path / "a" / "config.json"))
    assert config_a == json.load(open(tmp_path / "b" / "config.json"))
    assert config_a["auto_map"] == AUTO_MAP


def test_exported_folder_loads_as_remote_code(folders, remote):
    exported, source = folders["exported"], folders["builtin_dir"]
    written = folders["written"]
    assert written["model.safetensors"] == "symlink"
    link = os.path.join(exported, "model.safetensors")
    assert os.path.islink(link) and os.path.samefile(link, os.path.join(source, "model.safetensors"))
    assert written["generation_config.json"] == "copy"
    assert not os.path.islink(os.path.join(exported, "generation_config.json"))
    assert {n for n, kind in written.items() if kind == "code"} == {os.path.basename(p) for p in remote_code_files()}
    config = json.load(open(os.path.join(exported, "config.json")))
    original = json.load(open(os.path.join(source, "config.json")))
    assert config.pop("auto_map") == AUTO_MAP and "auto_map" not in original
    assert config == original
    assert remote["export_module"].startswith("transformers_modules.")
    text = folders["builtin"].config.text_config
    assert remote["ids"].shape[1] >= text.index_topk + text.index_kpool  # sparse KPool selection
    with torch.no_grad():
        reference = folders["builtin"](input_ids=remote["ids"]).logits
    assert rel_err(remote["export_logits"], reference) < TOL


def test_export_links_index_and_shards_copies_the_rest(folders, tmp_path):
    tiny = folders["tiny"]
    written = export(tiny, str(tmp_path / "out"), show_progress=False)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name in ["model.safetensors.index.json"] + shards:
        assert written[name] == "symlink" and os.path.islink(tmp_path / "out" / name)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert written[name] == "copy"
        assert open(tmp_path / "out" / name, "rb").read() == open(os.path.join(tiny, name), "rb").read()
    assert written["modeling_glm53flash.py"] == "code"


def test_export_link_fallbacks_warn(folders, tmp_path, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise OSError("refused by the test")

    source = os.path.join(folders["builtin_dir"], "model.safetensors")
    monkeypatch.setattr(os, "symlink", refuse)
    with caplog.at_level("WARNING"):
        written = export(folders["builtin_dir"], str(tmp_path / "hard"), show_progress=False)
    assert written["model.safetensors"] == "hardlink"
    assert os.stat(tmp_path / "hard" / "model.safetensors").st_ino == os.stat(source).st_ino
    assert "could not symlink" in caplog.text and "refused by the test" in caplog.text
    monkeypatch.setattr(os, "link", refuse)
    caplog.clear()
    with caplog.at_level("WARNING"):
        written = export(folders["builtin_dir"], str(tmp_path / "copy"), show_progress=False)
    assert written["model.safetensors"] == "copy" and "could not hard-link" in caplog.text
    assert open(tmp_path / "copy" / "model.safetensors", "rb").read() == open(source, "rb").read()


def test_link_file_refuses_an_unknown_mode(tmp_path):
    (tmp_path / "src").write_bytes(b"x")
    with pytest.raises(ValueError, match="link mode must be one of .*; got 'move'"):
        link_file(str(tmp_path / "src"), str(tmp_path / "dst"), mode="move")
    assert not (tmp_path / "dst").exists()


def test_export_errors(folders, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export(str(bad), str(tmp_path / "o1"), show_progress=False)
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'"):
        export(str(bad), str(tmp_path / "o2"), show_progress=False)
    with pytest.raises(ValueError, match="OUT must differ from SRC"):
        export(folders["builtin_dir"], folders["builtin_dir"], show_progress=False)
    with pytest.raises(ValueError, match="not empty"):
        export(folders["builtin_dir"], folders["tiny"], show_progress=False)


def test_export_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("SRC", "OUT", "--link", "--overwrite", "--quiet", "auto_map", "symlink", "hardlink"):
        assert option in text
