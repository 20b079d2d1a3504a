"""PEFT adapters of the VL model in the two layouts PEFT's Auto classes load.

The VL model names the language model's modules ``model.language_model.*``, ``Glm53FlashForCausalLM`` ``model.*``.
PEFT's Auto classes build the base from the adapter config's ``task_type`` (``CAUSAL_LM``: ``AutoModelForCausalLM``)
or, without one, its ``auto_mapping``, then load the adapter's keys by name: a VL adapter labelled ``CAUSAL_LM`` (as
``PeftModel.save_pretrained`` writes it for :func:`glm53flash_hf.train.trainer.default_lora_config`) is built as the
causal LM and none of its LoRA keys match (PEFT only warns). :func:`mark_vl_adapter` relabels it for
``peft.AutoPeftModel``; :func:`write_causal_lm_adapter` writes its causal-LM copy for
``peft.AutoPeftModelForCausalLM``. Both keep ``base_model_name_or_path``.
"""

from __future__ import annotations

import os

#: The PEFT-serialized prefix of the VL model's language model and the causal LM's (same modules, other names).
VL_TEXT_PREFIX = "base_model.model.model.language_model."
CAUSAL_LM_TEXT_PREFIX = "base_model.model.model."
#: The LM head (``modules_to_save`` / LoRA on it): the same name in both classes.
HEAD_PREFIX = "base_model.model.lm_head."
#: ``auto_mapping`` of a VL adapter: ``peft.AutoPeftModel`` builds its base with transformers'
#: ``AutoModelForImageTextToText`` (in PEFT's default import allowlist).
VL_AUTO_MAPPING = {"base_model_class": "AutoModelForImageTextToText", "parent_library": "transformers"}
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def causal_lm_adapter_key(key: str) -> str:
    """The causal LM's name of the VL adapter tensor ``key`` (PEFT-serialized, ``base_model.model.`` prefix).

    Raises:
        ValueError: ``key`` is neither under the language model nor the LM head (e.g. the vision tower's): the
            causal LM has no such module.
    """
    if key.startswith(VL_TEXT_PREFIX):
        return CAUSAL_LM_TEXT_PREFIX + key[len(VL_TEXT_PREFIX):]
    if key.startswith(HEAD_PREFIX):
        return key
    raise ValueError(f"adapter tensor {key!r} is outside the language model ({VL_TEXT_PREFIX}*) and the LM head "
                     f"({HEAD_PREFIX}*): Glm53FlashForCausalLM has no module for it")


def _check_folder(adapter_dir) -> None:
    for name in ("adapter_config.json", ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(adapter_dir, name)):
            raise FileNotFoundError(f"{os.path.join(adapter_dir, name)} is missing (a PEFT adapter saved with "
                                    "safe_serialization=True has both files)")


def mark_vl_adapter(adapter_dir) -> None:
    """Rewrite ``adapter_dir/adapter_config.json`` of an adapter trained on the VL model so that
    ``peft.AutoPeftModel.from_pretrained(adapter_dir, trust_remote_code=True)`` builds the base with
    ``AutoModelForImageTextToText``: no ``task_type`` (PEFT has none for image-text-to-text; with one,
    ``AutoPeftModel`` refuses the folder) and ``auto_mapping`` :data:`VL_AUTO_MAPPING`. The weights are unchanged.

    Raises:
        FileNotFoundError: the config or ``adapter_model.safetensors`` is missing.
        ValueError: the adapter's keys are not the VL model's (e.g. an adapter of the causal LM).
    """
    from peft import PeftConfig
    from safetensors import safe_open

    _check_folder(adapter_dir)
    with safe_open(os.path.join(adapter_dir, ADAPTER_WEIGHTS), "pt") as f:
        other = [k for k in f.keys() if k.startswith(CAUSAL_LM_TEXT_PREFIX)
                 and not k.startswith((VL_TEXT_PREFIX, CAUSAL_LM_TEXT_PREFIX + "visual."))]
    if other:
        raise ValueError(f"{adapter_dir} is not an adapter of the VL model: {other[0]!r} (and {len(other) - 1} more) "
                         f"are outside its language model ({VL_TEXT_PREFIX}*) and vision tower")
    config = PeftConfig.from_pretrained(os.fspath(adapter_dir))
    config.task_type = None
    config.save_pretrained(os.fspath(adapter_dir), auto_mapping_dict=dict(VL_AUTO_MAPPING))


def write_causal_lm_adapter(vl_adapter_dir, save_directory) -> int:
    """Write into ``save_directory`` the adapter of ``vl_adapter_dir`` (trained on the VL model) for
    ``Glm53FlashForCausalLM``: the same tensors under the causal LM's names (:func:`causal_lm_adapter_key`), the same
    config with ``task_type="CAUSAL_LM"`` and no ``auto_mapping``, so that
    ``peft.AutoPeftModelForCausalLM.from_pretrained(save_directory, trust_remote_code=True)`` loads every tensor.
    Returns the number of tensors written.

    Raises:
        FileNotFoundError: the config or ``adapter_model.safetensors`` of ``vl_adapter_dir`` is missing.
        ValueError: a tensor has no place in the causal LM (the vision tower's), or two map to one name.
    """
    from peft import PeftConfig
    from safetensors import safe_open
    from safetensors.torch import save_file

    _check_folder(vl_adapter_dir)
    with safe_open(os.path.join(vl_adapter_dir, ADAPTER_WEIGHTS), "pt") as f:
        metadata = f.metadata() or {}
        tensors = {}
        for key in f.keys():
            new = causal_lm_adapter_key(key)
            if new in tensors:
                raise ValueError(f"two adapter tensors map to {new!r}")
            tensors[new] = f.get_tensor(key)
    config = PeftConfig.from_pretrained(os.fspath(vl_adapter_dir))
    config.task_type = "CAUSAL_LM"
    config.auto_mapping = None
    os.makedirs(save_directory, exist_ok=True)
    save_file(tensors, os.path.join(save_directory, ADAPTER_WEIGHTS), metadata={**metadata, "format": "pt"})
    config.save_pretrained(os.fspath(save_directory))
    return len(tensors)


def add_router_biases(adapter_dir, peft_model) -> int:
    """Add the router biases of ``peft_model`` (each router's ``e_score_correction_bias``, fp32 ``[E]``, a buffer the
    aux-loss-free balancing updates and PEFT does not save) to ``adapter_dir/adapter_model.safetensors`` under their
    PEFT-serialized names (``base_model.model.<module>.e_score_correction_bias``). PEFT passes tensors that are no
    adapter parameter through to ``load_state_dict``, so ``PeftModel.from_pretrained`` (and the Auto classes, and a
    merge) loads them into the base model's buffers. Returns the number of biases added.

    Raises:
        FileNotFoundError: the config or ``adapter_model.safetensors`` is missing.
        ValueError: ``peft_model`` has no router.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from .trainer import find_routers

    _check_folder(adapter_dir)
    routers = find_routers(peft_model)
    if not routers:
        raise ValueError(f"{type(peft_model).__name__} has no MoE router: no biases to add")
    path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    with safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    for name, router in routers.items():
        bias = router.e_score_correction_bias.detach()
        bias = bias.full_tensor() if hasattr(bias, "full_tensor") else bias  # a DTensor under FSDP2
        name = name.removeprefix("_fsdp_wrapped_module.").replace("._fsdp_wrapped_module", "")
        tensors[f"{name}.e_score_correction_bias"] = bias.to("cpu", copy=True).contiguous()
    save_file(tensors, path, metadata={**metadata, "format": "pt"})
    return len(routers)


__all__ = [
    "VL_AUTO_MAPPING", "add_router_biases", "causal_lm_adapter_key", "mark_vl_adapter", "write_causal_lm_adapter",
]
