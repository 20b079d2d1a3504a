"""Trust boundaries: code and state of one folder never reach another load.

* Process-global conversions: a remote-code folder whose ``checkpoint.py`` permutes the KDA convolutions, loaded
  through the Auto classes, changes neither how the package's class nor how the Auto classes load (and save)
  another checkpoint, and it keeps its own conversions after the other copy was used. Oracle: the checkpoint's
  own tensors (``safetensors``) and the logits of this process, which never imported the modified copy.
* DCP loading (``load_sharded_checkpoint``) runs no code of the folder: a ``.metadata`` pickle that calls
  ``os.mkdir``, and a non-tensor item that does, are refused naming the file / item (torch's own reader runs both,
  checked first); a checkpoint written by ``save_sharded_checkpoint`` still loads exactly.
* ``glm53flash-export`` carries only the package's modules (byte-equal) and ``auto_map`` entries naming them,
  whatever Python files and ``auto_map`` entries SRC (or, under ``overwrite``, the previous OUT) holds;
  ``AutoProcessor`` on OUT runs none of SRC's code (SRC itself does run it, checked in the same process).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap

import fsdp2_worker
import pytest
import torch
from tiny import read_checkpoint_tensors

from glm53flash_hf.modeling_glm53flash import AUTO_MAP, Glm53FlashForCausalLM
from glm53flash_hf.tools.export import export, processor_auto_map, remote_code_files
from glm53flash_hf.tools.make_tiny import make_tiny
from glm53flash_hf.train.distributed import load_sharded_checkpoint, save_sharded_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = [[3, 17, 250, 9, 88, 41, 7, 120, 64, 5, 33, 2]]
CONV_SOURCES = '["self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight"]'
CONV_PERMUTED = '["self_attn.k_conv1d.weight", "self_attn.q_conv1d.weight", "self_attn.v_conv1d.weight"]'


def _subprocess_env(root) -> dict:
    """Offline, a fresh remote-code module cache, the package of this checkout importable."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_MODULES_CACHE=str(root / "modules"),
        PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
    )


def _run(script: str, root, *args) -> dict:
    out = str(root / "result.pt")
    result = subprocess.run(
        [sys.executable, "-c", script, *map(str, args), out],
        cwd=str(root), env=_subprocess_env(root), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("isolation") / "tiny"
    make_tiny(str(folder), seed=0, show_progress=False)
    return folder


# ------------------------------------------------------------------------------------------- conversions

ISOLATION_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from transformers import AutoModelForCausalLM
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    hostile, good, saved, ids, out = sys.argv[1:6]
    ids = torch.tensor(eval(ids))
    res = {}

    def record(name, model):
        model.eval()
        res[name + "_module"] = type(model).__module__
        res[name + "_conv"] = {k: v for k, v in model.state_dict().items() if k.endswith("self_attn.conv1d.weight")}
        with torch.no_grad():
            res[name + "_logits"] = model(input_ids=ids).logits

    record("hostile", AutoModelForCausalLM.from_pretrained(hostile, trust_remote_code=True, dtype=torch.float32))
    package = Glm53FlashForCausalLM.from_pretrained(good, dtype=torch.float32)
    record("package", package)
    fresh = Glm53FlashForCausalLM(package.config)  # no conversions attached: save_pretrained asks the registry
    fresh.load_state_dict(package.state_dict())
    fresh.save_pretrained(saved)
    record("auto", AutoModelForCausalLM.from_pretrained(good, trust_remote_code=True, dtype=torch.float32))
    record("hostile_again", AutoModelForCausalLM.from_pretrained(hostile, trust_remote_code=True,
                                                                 dtype=torch.float32))
    torch.save(res, out)
    """
)


def _file_conv(tensors: dict, model_key: str, order=("q", "k", "v")) -> torch.Tensor:
    """The in-memory ``conv1d.weight`` from the checkpoint's split convolutions, concatenated in ``order``."""
    prefix = "model.language_model." + model_key[len("model."):].removesuffix("conv1d.weight")
    return torch.cat([tensors[f"{prefix}{p}_conv1d.weight"] for p in order]).float()


def test_modified_remote_copy_changes_no_other_load(tiny, tmp_path):
    hostile, good = tmp_path / "hostile", tmp_path / "good"
    shutil.copytree(tiny, hostile)
    shutil.copytree(tiny, good)
    source = (hostile / "checkpoint.py").read_text()
    assert source.count(CONV_SOURCES) == 1
    (hostile / "checkpoint.py").write_text(source.replace(CONV_SOURCES, CONV_PERMUTED))
    res = _run(ISOLATION_SCRIPT, tmp_path, hostile, good, tmp_path / "saved", IDS)

    assert res["hostile_module"].startswith("transformers_modules.")
    assert res["auto_module"].startswith("transformers_modules.") and res["auto_module"] != res["hostile_module"]
    assert res["package_module"] == "glm53flash_hf.modeling_glm53flash"
    tensors = read_checkpoint_tensors(str(good))
    keys = sorted(res["package_conv"])
    assert len(keys) >= 2
    for key in keys:
        assert torch.equal(res["package_conv"][key], _file_conv(tensors, key)), key
        assert torch.equal(res["auto_conv"][key], _file_conv(tensors, key)), key
        # the modified copy keeps its own conversions, also after the other copy loaded and saved
        for name in ("hostile", "hostile_again"):
            assert torch.equal(res[f"{name}_conv"][key], _file_conv(tensors, key, order=("k", "q", "v"))), key
    with torch.no_grad():
        reference = Glm53FlashForCausalLM.from_pretrained(str(good), dtype=torch.float32).eval()(
            input_ids=torch.tensor(IDS)
        ).logits
    assert torch.equal(res["package_logits"], reference)
    assert torch.equal(res["auto_logits"], reference)
    assert not torch.equal(res["hostile_logits"], reference)  # the permutation is visible in the logits
    saved = read_checkpoint_tensors(str(tmp_path / "saved"))
    convs = [k for k in tensors if re.search(r"\.[qkv]_conv1d\.weight$", k)]
    assert convs and all(torch.equal(saved[k], tensors[k].float()) for k in convs)


# ------------------------------------------------------------------------------------------- DCP


class _MakesDirectory:
    """Pickles as a call of ``os.mkdir(path)``: unpickling it creates ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _trained(seed: int):
    model = fsdp2_worker.make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor(IDS)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def test_dcp_checkpoint_of_the_package_loads(tmp_path):
    model, optimizer = _trained(0)
    save_sharded_checkpoint(tmp_path / "dcp", model, optimizer)
    fresh = fsdp2_worker.make_model(1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=5e-2)
    load_sharded_checkpoint(tmp_path / "dcp", fresh, fresh_optimizer)
    expected, got = model.state_dict(), fresh.state_dict()
    assert sorted(expected) == sorted(got)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert fresh_optimizer.param_groups[0]["lr"] == 1e-3  # a non-tensor item (read through torch.load)
    names = {p: n for n, p in model.named_parameters()}
    fresh_params = dict(fresh.named_parameters())
    assert optimizer.state
    for param, state in optimizer.state.items():
        loaded = fresh_optimizer.state[fresh_params[names[param]]]
        assert sorted(loaded) == sorted(state)
        assert all(torch.equal(torch.as_tensor(loaded[k]), torch.as_tensor(state[k])) for k in state)


def test_dcp_metadata_that_runs_code_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder, marker = tmp_path / "dcp", tmp_path / "ran"
    folder.mkdir()
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(_MakesDirectory(marker), f)
    with pytest.raises(Exception):  # noqa: B017 (torch's reader: whatever follows the unpickling)
        dcp.FileSystemReader(str(folder)).read_metadata()
    assert marker.is_dir()  # torch's own reader runs the folder's code
    marker.rmdir()
    model = fsdp2_worker.make_model(0)
    message = rf"{re.escape(str(folder / '.metadata'))}: refusing to unpickle \w+\.mkdir"
    with pytest.raises(ValueError, match=message):
        load_sharded_checkpoint(folder, model)
    with pytest.raises(ValueError, match=message):
        load_sharded_checkpoint(folder, model, torch.optim.AdamW(model.parameters()))
    assert not marker.exists()


def test_dcp_item_that_runs_code_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    folder, marker = tmp_path / "dcp", tmp_path / "ran"
    model = fsdp2_worker.make_model(0)
    state = get_model_state_dict(model)
    key = "model.embed_tokens.weight"
    state[key] = _MakesDirectory(marker)
    dcp.save({"model": state}, checkpoint_id=str(folder))
    assert not marker.exists()
    dcp.load({"model": get_model_state_dict(model)}, checkpoint_id=str(folder))
    assert marker.is_dir()  # torch's own planner runs the item's code (torch.load(weights_only=False))
    marker.rmdir()
    with pytest.raises(ValueError, match=rf"{re.escape(str(folder))}: the item 'model\.{re.escape(key)}' pickles"):
        load_sharded_checkpoint(folder, model)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- export

HOSTILE = "import pathlib\npathlib.Path({marker!r}).write_text(__name__)\n"

PROCESSOR_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    from transformers import AutoProcessor

    exported, source, markers, out = sys.argv[1:5]
    res = {}
    processor = AutoProcessor.from_pretrained(exported, trust_remote_code=True)
    res["class"] = type(processor).__name__
    res["module"] = type(processor).__module__
    res["markers_after_out"] = sorted(os.listdir(markers))
    try:
        AutoProcessor.from_pretrained(source, trust_remote_code=True)
    except Exception as error:
        res["source_error"] = repr(error)
    res["markers_after_src"] = sorted(os.listdir(markers))
    torch.save(res, out)
    """
)


def _hostile_source(tiny, root):
    """A copy of ``tiny`` with SRC-side code: a foreign module, a foreign ``processing_glm53flash.py``, code in a
    subfolder and ``__pycache__``, and ``auto_map`` entries naming the foreign module at top level and nested."""
    src, markers = root / "src", root / "markers"
    shutil.copytree(tiny, src)
    markers.mkdir()
    (src / "evil.py").write_text(HOSTILE.format(marker=str(markers / "evil")))
    (src / "processing_glm53flash.py").write_text(HOSTILE.format(marker=str(markers / "processing")))
    (src / "extra").mkdir()
    (src / "extra" / "helper.py").write_text(HOSTILE.format(marker=str(markers / "helper")))
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "evil.cpython-311.pyc").write_bytes(b"\0")
    processor = json.loads((src / "processor_config.json").read_text())
    processor["auto_map"] = {"AutoProcessor": "evil.Glm53FlashProcessor"}
    processor["image_processor"]["auto_map"] = {"AutoImageProcessor": "evil.ImageProcessor"}
    (src / "processor_config.json").write_text(json.dumps(processor))
    tokenizer = json.loads((src / "tokenizer_config.json").read_text())
    tokenizer["auto_map"] = {"AutoProcessor": "evil.Glm53FlashProcessor", "AutoTokenizer": ["evil.Tok", None]}
    (src / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    config = json.loads((src / "config.json").read_text())
    config["auto_map"]["AutoModelForSequenceClassification"] = "other/repo--evil.Classifier"
    (src / "config.json").write_text(json.dumps(config))
    return src, markers


def _auto_maps(data, found=None) -> list:
    found = [] if found is None else found
    if isinstance(data, dict):
        for key, value in data.items():
            found.append(value) if key == "auto_map" else _auto_maps(value, found)
    elif isinstance(data, list):
        for value in data:
            _auto_maps(value, found)
    return found


def _assert_only_our_code(out) -> None:
    ours = {os.path.basename(p): p for p in remote_code_files()}
    assert "processing_glm53flash.py" in ours and "modeling_glm53flash.py" in ours
    code = sorted(
        os.path.relpath(os.path.join(r, n), out)
        for r, dirs, files in os.walk(out) for n in files + dirs if n.endswith((".py", ".pyc")) or n == "__pycache__"
    )
    assert code == sorted(ours)
    for name, path in ours.items():
        assert open(os.path.join(out, name), "rb").read() == open(path, "rb").read(), name
    checked = 0
    for root, _, files in os.walk(out):
        for name in files:
            if name.endswith(".json"):
                maps = _auto_maps(json.load(open(os.path.join(root, name))))
                expected = AUTO_MAP if name == "config.json" else processor_auto_map()
                assert all(m == expected for m in maps), (name, maps)
                checked += len(maps)
    assert checked >= 5  # config, processor (3 with the nested ones), tokenizer


def test_export_carries_only_our_code(tiny, tmp_path, caplog):
    src, markers = _hostile_source(tiny, tmp_path)
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        written = export(str(src), str(out), show_progress=False)
    _assert_only_our_code(out)
    assert written["processor_config.json"] == written["tokenizer_config.json"] == "config"
    for name in ("evil.py", "extra/helper.py", "__pycache__", "processing_glm53flash.py",
                 "AutoModelForSequenceClassification", "processor_config.json", "tokenizer_config.json"):
        assert name in caplog.text, name
    res = _run(PROCESSOR_SCRIPT, tmp_path, out, src, markers)
    assert res["class"] == "Glm53FlashProcessor"
    assert res["module"].startswith("transformers_modules.") and res["module"].endswith(".processing_glm53flash")
    assert res["markers_after_out"] == []
    assert res["markers_after_src"]  # the same process runs SRC's code when it loads SRC


def test_export_overwrite_drops_code_kept_from_the_previous_out(tiny, tmp_path, caplog):
    out = tmp_path / "out"
    export(str(tiny), str(out), show_progress=False)
    (out / "evil.py").write_text("raise SystemExit\n")
    (out / "notes.txt").write_text("kept\n")
    hostile_map = {"auto_map": {"AutoImageProcessor": "evil.ImageProcessor"}, "image_processor_type": "X"}
    (out / "preprocessor_config.json").write_text(json.dumps(hostile_map))
    with caplog.at_level("WARNING"):
        export(str(tiny), str(out), overwrite=True, show_progress=False)
    _assert_only_our_code(out)
    assert (out / "notes.txt").read_text() == "kept\n"
    assert json.loads((out / "preprocessor_config.json").read_text()) == {
        "auto_map": processor_auto_map(), "image_processor_type": "X"
    }
    assert "evil.py" in caplog.text and "preprocessor_config.json" in caplog.text
