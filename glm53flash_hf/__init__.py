"""glm53flash-hf: GLM-5.3-Flash for the Hugging Face ecosystem.

Our own implementation of the model (KDA, NoPE DSA with the KPool indexer, mHC, MoE with clamped SwiGLU, MTP) and
its processor, numerically equal to transformers' ``glm5_next`` on the same weights, correct on packed sequences;
torch paths everywhere and fused kernels on CUDA.

The flat modules of this package are the remote code a saved checkpoint carries; ``glm53flash_hf.train`` (collator,
Trainer helpers, distributed setup) and ``glm53flash_hf.tools`` (the command-line tools) build on them.
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

__all__ = [
    "DocumentLayout",
    "Glm53FlashConfig",
    "Glm53FlashForCausalLM",
    "Glm53FlashForConditionalGeneration",
    "Glm53FlashModel",
    "Glm53FlashPackingCollator",
    "Glm53FlashPreTrainedModel",
    "Glm53FlashProcessor",
    "Glm53FlashTextConfig",
    "Glm53FlashTextModel",
    "Glm53FlashVideoProcessor",
    "Glm53FlashVisionConfig",
    "build_document_layout",
]


def __getattr__(name: str):
    """``glm53flash_hf.Glm53FlashPackingCollator`` on first use (PEP 562): the collator lives in the ``train``
    sub-package, which the flat modules never import."""
    if name == "Glm53FlashPackingCollator":
        import importlib

        return importlib.import_module(f"{__name__}.train.collator").Glm53FlashPackingCollator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
