"""glm53flash-hf: GLM-5.3-Flash for the Hugging Face ecosystem.

The flat modules are the remote code a saved checkpoint carries; ``glm53flash_hf.train`` and ``glm53flash_hf.tools``
build on them.
"""

from .configuration_glm53flash import Glm53FlashConfig, Glm53FlashTextConfig, Glm53FlashVisionConfig
from .modeling_glm53flash import (
    Glm53FlashForCausalLM,
    Glm53FlashForConditionalGeneration,
    Glm53FlashModel,
    Glm53FlashPreTrainedModel,
    Glm53FlashTextModel,
)
from .packing import DocumentLayout, build_document_layout
from .processing_glm53flash import Glm53FlashProcessor, Glm53FlashVideoProcessor

__version__ = "0.1.0"

__all__ = ["DocumentLayout", "Glm53FlashConfig", "Glm53FlashForCausalLM", "Glm53FlashForConditionalGeneration",
           "Glm53FlashModel", "Glm53FlashPackingCollator", "Glm53FlashPreTrainedModel", "Glm53FlashProcessor",
           "Glm53FlashTextConfig", "Glm53FlashTextModel", "Glm53FlashVideoProcessor", "Glm53FlashVisionConfig",
           "build_document_layout"]


def __getattr__(name: str):
    """``glm53flash_hf.Glm53FlashPackingCollator`` on first use (PEP 562), from the ``train`` sub-package."""
    if name == "Glm53FlashPackingCollator":
        import importlib

        return importlib.import_module(f"{__name__}.train.collator").Glm53FlashPackingCollator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
