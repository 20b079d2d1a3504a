"""Configurations of GLM-5.3-Flash, subclasses of transformers' ``Glm5Next*Config`` (``model_type = "glm5_next"``;
field meanings: transformers' ``configuration_glm5_next.py``). Out-of-range numbers and unsupported combinations
raise ``ValueError`` naming the field, its value and what is expected.
"""

import math

from huggingface_hub.dataclasses import strict
from transformers.models.glm5_next.configuration_glm5_next import (
    Glm5NextConfig,
    Glm5NextTextConfig,
    Glm5NextVisionConfig,
)

KERNEL_FAMILIES = ("kda", "mhc", "dsa", "moe")
KERNEL_CHOICES = ("auto", "torch", "fused")

# Spellings of the DSA layer type seen in released configs and transformers versions.
_INDEXED_ALIASES = {"deepseek_sparse_attention": "indexed_attention", "full_attention": "indexed_attention"}
LAYER_TYPES = ("linear_attention", "indexed_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
INDEXER_TYPES = ("full", "shared")


# Numeric fields checked field by field at construction (before transformers' own checks).
_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim",
    "n_routed_experts", "n_group", "topk_group", "num_experts_per_tok", "max_position_embeddings", "index_topk",
    "index_head_dim", "index_n_heads", "index_kpool", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
    "hc_mult", "hc_sinkhorn_iters", "mtp_depth",
)  # fmt: skip
_NON_NEGATIVE_INTS = ("n_shared_experts", "num_nextn_predict_layers", "qk_rope_head_dim", "head_dim")
_POSITIVE_FLOATS = ("rms_norm_eps", "hc_eps", "routed_scaling_factor")
_NON_NEGATIVE_FLOATS = ("initializer_range", "mtp_loss_weight", "router_aux_loss_coef")
_VISION_POSITIVE_INTS = (
    "depth", "hidden_size", "num_heads", "in_channels", "spatial_merge_size", "out_hidden_size", "intermediate_size",
    "projection_intermediate_size",
)  # fmt: skip


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_numeric_fields(config, positive_ints=(), non_negative_ints=(), positive_floats=(), non_negative_floats=()):
    """Raise ``ValueError`` naming the field, its value and the expected range for the first field of ``config`` out of
    range: ``positive_ints`` ints >= 1, ``non_negative_ints`` ints >= 0, ``positive_floats`` finite > 0,
    ``non_negative_floats`` finite >= 0. Absent or ``None`` fields are skipped.
    """
    rules = (
        (positive_ints, lambda v: _is_int(v) and v >= 1, "a positive integer"),
        (non_negative_ints, lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        (positive_floats, lambda v: _is_number(v) and v > 0, "a finite number > 0"),
        (non_negative_floats, lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    )
    for names, ok, expected in rules:
        for name in names:
            value = getattr(config, name, None)
            if value is not None and not ok(value):
                raise ValueError(f"{type(config).__name__}.{name} must be {expected}; got {name}={value!r}")


# Other transformers MoE configs' names for our fields (Mixtral / DeepSeek ``num_local_experts``, Qwen-MoE
# ``num_experts``, ``num_shared_experts``, DeepSeek-V3 / GLM-4.5 ``num_mtp_layers``), read by clients such as TRL and
# transformers' MTP drafting; set through either name.
MOE_ALIASES = {
    "num_local_experts": "n_routed_experts",
    "num_experts": "n_routed_experts",
    "num_shared_experts": "n_shared_experts",
    "num_mtp_layers": "num_nextn_predict_layers",
}


def _derived(name: str, fget, doc: str) -> property:
    """A read-only config attribute computed by ``fget``; setting it (a ``config.json`` that carries it) accepts the
    computed value and raises ``ValueError`` naming the attribute for another."""

    def fset(config, value):
        try:
            computed = fget(config)
        except AttributeError as err:
            raise ValueError(f"{name}={value!r} cannot hold: {err}") from None
        if value != computed:
            raise ValueError(f"{name}={value!r} contradicts the config: {doc} gives {computed!r}")

    return property(fget, fset, doc=doc)


def _dense_prefix(config) -> int:
    dense = [i for i, t in enumerate(config.mlp_layer_types) if t == "dense"]
    if dense != list(range(len(dense))):
        raise AttributeError(f"the dense layers {dense} of mlp_layer_types are not the first ones")
    return len(dense)


def normalize_kernels(value) -> dict:
    """``{family: choice}`` for every family of :data:`KERNEL_FAMILIES`; ``ValueError`` for an unknown one or choice."""
    if value is None:
        value = "auto"
    if isinstance(value, str):
        if value not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES} or a dict per family; got kernels={value!r}")
        return {family: value for family in KERNEL_FAMILIES}
    if not isinstance(value, dict):
        raise ValueError(f"kernels must be a string or a dict; got kernels={value!r}")
    if unknown := set(value) - set(KERNEL_FAMILIES):
        raise ValueError(f"kernels has unknown families {sorted(unknown)}; known: {KERNEL_FAMILIES}")
    out = {family: value.get(family, "auto") for family in KERNEL_FAMILIES}
    for family, choice in out.items():
        if choice not in KERNEL_CHOICES:
            raise ValueError(f"kernels[{family!r}] must be one of {KERNEL_CHOICES}; got {choice!r}")
    return out


@strict
class Glm53FlashTextConfig(Glm5NextTextConfig):
    """Text configuration of GLM-5.3-Flash (``model_type = "glm5_next_text"``): transformers' ``Glm5NextTextConfig``
    plus:

    num_nextn_predict_layers (`int`, defaults to 0):
        MTP layers stored after the main stack at ``layers.{num_hidden_layers + i}`` (1 in the release).
    kernels (`str | dict`, defaults to ``"auto"``):
        ``"auto"`` (fused kernel on CUDA when installed, else torch), ``"torch"`` or ``"fused"``, for every family or
        per family (dict over ``kda``, ``mhc``, ``dsa``, ``moe``; missing ones ``"auto"``).
    mtp_depth (`int`, defaults to 1):
        MTP depths applied with the one shared MTP layer in training (DeepSeek-V3 technical report §2.2).
    mtp_loss_weight (`float`, defaults to 0.1):
        Weight of the MTP loss added to ``loss``; 0 turns it off.

    Other MoE configs' names resolve to these fields: :data:`MOE_ALIASES` (``num_experts``, ``num_local_experts``,
    ``num_shared_experts``, ``num_mtp_layers``) and the derived ``shared_expert_intermediate_size``,
    ``mlp_only_layers``, ``decoder_sparse_step`` and ``first_k_dense_replace``. ``head_dim`` keeps transformers'
    MLA convention (the RoPE part of a head, 0 here; the full query/key head is ``qk_head_dim``).

    ``layer_types`` accepts ``"linear_attention"``, ``"indexed_attention"`` and the older
    ``"deepseek_sparse_attention"`` / ``"full_attention"`` (normalised to ``"indexed_attention"``).
    """

    num_nextn_predict_layers: int = 0
    kernels: dict | str | None = None
    mtp_depth: int = 1
    mtp_loss_weight: float = 0.1

    attribute_map = {**Glm5NextTextConfig.attribute_map, **MOE_ALIASES}
    # other MoE configs' names for quantities derived from these fields (Qwen2-MoE, DeepSeek-V3 / GLM-4.5 layouts)
    shared_expert_intermediate_size = _derived(
        "shared_expert_intermediate_size", lambda c: c.moe_intermediate_size * c.n_shared_experts,
        "moe_intermediate_size * n_shared_experts, the width of the shared expert MLP",
    )
    mlp_only_layers = _derived(
        "mlp_only_layers", lambda c: [i for i, t in enumerate(c.mlp_layer_types) if t == "dense"],
        "the dense layers of mlp_layer_types",
    )
    decoder_sparse_step = _derived(
        "decoder_sparse_step", lambda c: 1, "1: every layer not in mlp_only_layers is a MoE layer"
    )
    first_k_dense_replace = _derived(
        "first_k_dense_replace", _dense_prefix, "the number of leading dense layers of mlp_layer_types"
    )

    def __post_init__(self, **kwargs):
        if self.layer_types is not None:
            self.layer_types = [_INDEXED_ALIASES.get(t, t) for t in self.layer_types]
        if self.num_nextn_predict_layers is None:
            self.num_nextn_predict_layers = 0
        self.kernels = normalize_kernels(self.kernels)
        check_numeric_fields(self, _POSITIVE_INTS, _NON_NEGATIVE_INTS, _POSITIVE_FLOATS, _NON_NEGATIVE_FLOATS)
        dropout = self.attention_dropout
        if not (_is_number(dropout) and 0 <= dropout < 1):
            raise ValueError(f"attention_dropout must be a number in [0, 1); got attention_dropout={dropout!r}")
        # special token ids are checked when a model is built (check_special_token_ids): a config may hold the
        # release's pad id with a smaller vocab_size until the id is set
        super().__post_init__(**kwargs)

    def check_special_token_ids(self) -> None:
        """Raise ``ValueError`` naming the field unless ``pad_token_id`` / ``bos_token_id`` / ``eos_token_id`` are
        ``None`` or ids in ``[0, vocab_size)`` (``eos_token_id`` also a list of them)."""
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name, None)
            ids = value if name == "eos_token_id" and isinstance(value, (list, tuple)) else [value]
            if value is None or all(_is_int(i) and 0 <= i < self.vocab_size for i in ids):
                continue
            what = "an id or a list of ids" if name == "eos_token_id" else "an id"
            raise ValueError(
                f"{name} must be None or {what} in [0, vocab_size={self.vocab_size}); got {name}={value!r}"
            )

    def validate_architecture(self):
        """Check the combination of fields; raise ``ValueError`` naming the field and value."""
        check_numeric_fields(self, _POSITIVE_INTS, _NON_NEGATIVE_INTS, _POSITIVE_FLOATS, _NON_NEGATIVE_FLOATS)
        n = self.num_hidden_layers
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ValueError(
                f"swiglu_limit must be positive (or None for no clamp); got swiglu_limit={self.swiglu_limit}"
            )
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES),
                              ("indexer_types", INDEXER_TYPES)):
            values = getattr(self, name)
            if len(values) < n:
                raise ValueError(f"{name} has {len(values)} entries but num_hidden_layers={n}")
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name} contains unsupported value {bad[0]!r}; allowed: {allowed}")
        if self.qk_rope_head_dim != 0:
            raise ValueError(f"qk_rope_head_dim must be 0 (NoPE DSA); got qk_rope_head_dim={self.qk_rope_head_dim}")
        for num, den in (("index_topk", "index_kpool"), ("n_routed_experts", "n_group")):
            if getattr(self, num) % getattr(self, den) != 0:
                raise ValueError(f"{num} ({getattr(self, num)}) must be divisible by {den} ({getattr(self, den)})")
        # A "shared" DSA layer reuses the selection of the DSA layer right before it, which must run its own
        # ("full") indexer (the selection is handed from one layer to the next, as in transformers).
        for i in range(n):
            if self.layer_types[i] != "indexed_attention" or self.indexer_types[i] != "shared":
                continue
            if i == 0 or self.layer_types[i - 1] != "indexed_attention" or self.indexer_types[i - 1] != "full":
                raise ValueError(
                    f"indexer_types[{i}]='shared' needs layer {i - 1} to be an indexed_attention layer with a 'full' "
                    f"indexer; got layer_types[{i - 1}]={self.layer_types[i - 1] if i else None!r}, "
                    f"indexer_types[{i - 1}]={self.indexer_types[i - 1] if i else None!r}"
                )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}]; got topk_group={self.topk_group}")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ValueError(
                f"n_group={self.n_group} leaves fewer than 2 experts per group "
                f"(n_routed_experts={self.n_routed_experts})"
            )
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}]; "
                f"got num_experts_per_tok={self.num_experts_per_tok}"
            )
        if self.linear_lower_bound is not None and not self.linear_lower_bound < 0:
            raise ValueError(f"linear_lower_bound must be negative or None; got {self.linear_lower_bound}")
        if self.hidden_act != "silu":
            raise ValueError(
                f"hidden_act must be 'silu' (clamped SwiGLU, KDA conv); got hidden_act={self.hidden_act!r}"
            )
        super().validate_architecture()


@strict
class Glm53FlashVisionConfig(Glm5NextVisionConfig):
    """Vision-tower configuration, transformers' ``Glm5NextVisionConfig``; non-positive sizes raise ``ValueError``."""

    def __post_init__(self, **kwargs):
        check_numeric_fields(self, _VISION_POSITIVE_INTS, positive_floats=("rms_norm_eps",))
        for name in ("patch_size", "temporal_patch_size", "image_size"):
            value = getattr(self, name)
            values = value if isinstance(value, (list, tuple)) else [value]
            if not all(_is_int(v) and v >= 1 for v in values):
                raise ValueError(
                    f"Glm53FlashVisionConfig.{name} must be a positive integer (or a list of them); "
                    f"got {name}={value!r}"
                )
        super().__post_init__(**kwargs)


@strict
class Glm53FlashConfig(Glm5NextConfig):
    """Top-level GLM-5.3-Flash configuration (``model_type = "glm5_next"``): ``text_config`` and ``vision_config``
    (flat text-only configs go to ``text_config``). The MoE / MTP attributes of :data:`VL_TEXT_ATTRIBUTES` read and
    set ``text_config``'s.
    """

    sub_configs_defaults = {"vision_config": Glm53FlashVisionConfig, "text_config": Glm53FlashTextConfig}


def _from_text_config(name: str) -> property:
    return property(lambda config: getattr(config.text_config, name),
                    lambda config, value: setattr(config.text_config, name, value), doc=f"``text_config.{name}``")


# the MoE / MTP names clients read from a model's config, on the VL config too (read and set on text_config)
VL_TEXT_ATTRIBUTES = (
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef",
    "output_router_logits", "num_nextn_predict_layers", *MOE_ALIASES, "shared_expert_intermediate_size",
    "mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace",
)  # fmt: skip
for _name in VL_TEXT_ATTRIBUTES:
    setattr(Glm53FlashConfig, _name, _from_text_config(_name))


__all__ = ["MOE_ALIASES", "VL_TEXT_ATTRIBUTES", "Glm53FlashConfig", "Glm53FlashTextConfig", "Glm53FlashVisionConfig",
           "normalize_kernels"]
