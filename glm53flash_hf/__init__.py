"""glm53flash-hf: GLM-5.3-Flash for the Hugging Face ecosystem.

Our own implementation of the model (KDA, NoPE DSA with the KPool indexer, mHC, MoE with clamped SwiGLU, MTP),
numerically equal to transformers' ``glm5_next`` on the same weights, correct on packed sequences, with
efficient torch paths on CPU. See README.md.
"""

from .configuration_glm53flash import Glm53FlashConfig, Glm53FlashTextConfig, Glm53FlashVisionConfig
from .modeling_glm53flash import Glm53FlashForCausalLM, Glm53FlashPreTrainedModel, Glm53FlashTextModel
from .packing import DocumentLayout, build_document_layout

__version__ = "0.1.0"

__all__ = [
    "Glm53FlashConfig",
    "Glm53FlashTextConfig",
    "Glm53FlashVisionConfig",
    "Glm53FlashForCausalLM",
    "Glm53FlashPreTrainedModel",
    "Glm53FlashTextModel",
    "DocumentLayout",
    "build_document_layout",
]
