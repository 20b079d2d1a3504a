"""Every Auto class transformers maps ``glm5_next`` to is named in the ``auto_map`` of every folder the package writes
(make-tiny, ``save_pretrained``, export), and loads our class from it with ``trust_remote_code=True``. The list comes
from transformers' own auto mappings (``modeling_auto``), not from the package, so a new Auto class that transformers
maps this model type to fails here until ``AUTO_MAP`` names it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

from glm53flash_hf.modeling_glm53flash import Glm53FlashForConditionalGeneration, Glm53FlashModel
from glm53flash_hf.tools.export import export
from glm53flash_hf.tools.make_tiny import make_tiny

MODEL_TYPE = "glm5_next"


def auto_classes_for(model_type: str) -> dict[str, str]:
    """``{Auto class name: built-in class name}`` of every ``transformers.AutoModel*`` whose mapping names
    ``model_type``."""
    found = {}
    for name in dir(modeling_auto):
        cls = getattr(modeling_auto, name)
        mapping = getattr(cls, "_model_mapping", None)
        if not (isinstance(cls, type) and name.startswith("AutoModel") and mapping is not None):
            continue
        names = getattr(mapping, "_model_mapping", {})
        if model_type in names and hasattr(transformers, name):
            found[name] = names[model_type]
    return found


def test_transformers_maps_glm5_next_to_the_multimodal_classes():
    # What transformers 5.23-5.25 map this model type to; transformers serve loads it with AutoModelForMultimodalLM.
    classes = auto_classes_for(MODEL_TYPE)
    assert {"AutoModel", "AutoModelForImageTextToText"} <= set(classes), classes
    if hasattr(transformers, "AutoModelForMultimodalLM"):
        assert classes["AutoModelForMultimodalLM"] == "Glm5NextForConditionalGeneration"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    tiny = make_tiny(str(root / "tiny"), seed=0, show_progress=False)
    saved = str(root / "saved")
    Glm53FlashForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).save_pretrained(saved)
    exported = str(root / "exported")
    export(tiny, exported, show_progress=False)
    return {"make-tiny": tiny, "save_pretrained": saved, "export": exported}


@pytest.mark.parametrize("kind", ["make-tiny", "save_pretrained", "export"])
def test_every_mapped_auto_class_is_in_auto_map(folders, kind):
    auto_map = json.load(open(os.path.join(folders[kind], "config.json")))["auto_map"]
    for auto_name, builtin in auto_classes_for(MODEL_TYPE).items():
        assert auto_name in auto_map, (kind, auto_name, sorted(auto_map))
        # the same kind of model as the built-in's: the base model for AutoModel, the VL model for the others
        ours = Glm53FlashModel if builtin == "Glm5NextModel" else Glm53FlashForConditionalGeneration
        assert auto_map[auto_name] == f"modeling_glm53flash.{ours.__name__}", (kind, auto_name)
    assert auto_map["AutoModelForCausalLM"] == "modeling_glm53flash.Glm53FlashForCausalLM"


@pytest.mark.parametrize("auto_name", sorted(auto_classes_for(MODEL_TYPE)) + ["AutoModelForCausalLM"])
def test_each_auto_class_loads_our_class(folders, auto_name):
    auto_cls = getattr(transformers, auto_name)
    model = auto_cls.from_pretrained(folders["export"], trust_remote_code=True, dtype=torch.float32)
    expected = json.load(open(os.path.join(folders["export"], "config.json")))["auto_map"][auto_name].split(".")[-1]
    assert type(model).__name__ == expected and type(model).__module__.endswith("modeling_glm53flash")
    if auto_name != "AutoModel":
        ids = torch.tensor([[5, 17, 42, 99]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        assert logits.shape[:2] == (1, 4) and torch.isfinite(logits).all()
