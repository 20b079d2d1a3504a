"""GLM-5.3-Flash models: the text decoder stack, the causal LM and the vision-language model.

Data path (as transformers' ``models/glm5_next/modeling_glm5_next.py``)::

    input_ids ─ embed_tokens ─ expand to hc_mult streams X [B,S,N,D]
      for each main layer:
        hc_pre → input_layernorm → KDA | DSA (+ KPool indexer) → hc_post
        hc_pre → post_attention_layernorm → dense MLP | MoE     → hc_post
      mean over streams → norm → lm_head                        → logits, loss

Module and parameter names are transformers' ``glm5_next`` in-memory names; the published on-disk layout is read and
written through :mod:`.checkpoint`. The MTP layers sit at ``layers.{num_hidden_layers + i}``.
"""

import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling, MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import accepts_precomputed_kwargs
from transformers.utils.output_capturing import OutputRecorder

from .checkpoint import VISION_KEY_PATTERNS, register_conversions
from .configuration_glm53flash import Glm53FlashConfig, Glm53FlashTextConfig
from .dispatch import op_for, requested_backend
from .dsa import Glm53FlashAttention, init_dsa_weights
from .generation_cache import check_cache, check_cache_continuation, check_cache_layers, check_left_padding
from .graph_ops import in_graph, module_op, module_parameters, register_module
from .input_checks import (
    check_input_ids,
    check_inputs_embeds,
    check_labels,
    check_loss_arguments,
    check_not_meta,
    check_vision_inputs,
    patch_width,
)
from .kda import Glm53FlashLinearAttention, init_kda_weights
from .mhc import Glm53FlashHyperConnection, hc_expand, hc_head, init_mhc_weights
from .mhc_ops import hc_post_torch
from .moe import Glm53FlashMLP, Glm53FlashTopkRouter, clamped_swiglu
from .moe_ops import experts_forward_torch
from .mtp import doc_roll, mtp_loss, note_trainer_tags, register_fused_head_mtp
from .norm import Glm53FlashRMSNorm
from .packing import DocumentLayout, build_layout

logger = logging.get_logger(__name__)

register_conversions()

# The outputs' cache field: ``cache`` from transformers 5.25 on, ``past_key_values`` before (5.23, 5.24); generation
# reads the field of that name, and forward accepts both keywords.
CACHE_FIELD = "cache" if "cache" in MoeModelOutputWithPast.__dataclass_fields__ else "past_key_values"

# Auto classes served by the remote code; written into config.json by save_pretrained. Every Auto class whose
# mapping names ``glm5_next`` (AutoModel, AutoModelForImageTextToText and AutoModelForMultimodalLM, which
# ``transformers serve`` loads this model type with), plus AutoModelForCausalLM for the text-only model.
AUTO_MAP = {
    "AutoConfig": "configuration_glm53flash.Glm53FlashConfig",
    "AutoModel": "modeling_glm53flash.Glm53FlashModel",
    "AutoModelForCausalLM": "modeling_glm53flash.Glm53FlashForCausalLM",
    "AutoModelForImageTextToText": "modeling_glm53flash.Glm53FlashForConditionalGeneration",
    "AutoModelForMultimodalLM": "modeling_glm53flash.Glm53FlashForConditionalGeneration",
}


@use_experts_implementation
class Glm53FlashExperts(nn.Module):
    """Routed experts in transformers' layout: ``gate_up_proj [E, 2I, H]`` (gate rows first), ``down_proj [E, H, I]``.

    Carries ``@use_experts_implementation``: ``config._experts_implementation`` may pick transformers'
    ``"grouped_mm"``, ``"batched_mm"`` or hub kernels (all use :meth:`_apply_gate`, the clamped SwiGLU); ``"eager"``
    or ``None`` run this forward, :func:`.moe_ops.experts_forward_torch` or its fused alternative, chosen per call by
    :func:`.dispatch.op_for` for ``config.kernels["moe"]``. Forward:
    ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` in ``hidden.dtype``. PEFT's
    ``target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`` works.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.swiglu_limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        experts = op_for(experts_forward_torch, requested_backend(self.config, "moe"), hidden_states, self.gate_up_proj,
                         self.down_proj, top_k_weights)
        return experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self.swiglu_limit,
                       drop_out_of_range=getattr(self, "_is_expert_parallel", False))

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[S, 2I]`` gate/up projection -> ``[S, I]`` clamped SwiGLU (for transformers' implementations)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return clamped_swiglu(gate, up, self.swiglu_limit)


class Glm53FlashMoE(nn.Module):
    """MoE block (``Glm5NextTextMoE``): ``experts`` weighted by ``gate`` plus ``shared_experts``, added unscaled.

    ``h [..., H]`` -> same shape and dtype; with ``return_router_logits`` also ``router_logits`` fp32 ``[T, E]``.
    ``token_dispatch`` (``None``: ``experts`` called on the tokens) may be set from outside to ``fn(experts, hidden
    [T, H], top_k_index, top_k_weights) -> [T, H]``, which moves the tokens to the processes holding their experts
    and back (the package's ``train`` applies expert parallelism through it).
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.experts = Glm53FlashExperts(config)
        self.gate = Glm53FlashTopkRouter(config)
        self.shared_experts = Glm53FlashMLP(
            config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
        )
        self.token_dispatch = None

    def forward(self, hidden_states: torch.Tensor, return_router_logits: bool = False):
        shape = hidden_states.shape
        router_logits, topk_weights, topk_indices = self.gate(hidden_states)
        tokens = hidden_states.reshape(-1, shape[-1])
        if self.token_dispatch is None:
            routed = self.experts(tokens, topk_indices, topk_weights)
        else:
            routed = self.token_dispatch(self.experts, tokens, topk_indices, topk_weights)
        out = routed.view(shape) + self.shared_experts(hidden_states)
        return (out, router_logits) if return_router_logits else out


def init_moe_weights(module: nn.Module, config) -> None:
    """MoE init as ``Glm5NextPreTrainedModel._init_weights``: expert weights and router ``weight`` ~
    ``N(0, initializer_range)``, ``e_score_correction_bias`` 0 (loaded tensors are skipped)."""
    std = config.initializer_range
    if isinstance(module, Glm53FlashExperts):
        init.normal_(module.gate_up_proj, mean=0.0, std=std)
        init.normal_(module.down_proj, mean=0.0, std=std)
    elif isinstance(module, Glm53FlashTopkRouter):
        init.normal_(module.weight, mean=0.0, std=std)
        init.zeros_(module.e_score_correction_bias)


class Glm53FlashDecoderLayer(GradientCheckpointingLayer):
    """One main-stack layer (``Glm5NextTextDecoderLayer``): mHC sites (DeepSeek, "mHC: Manifold-Constrained
    Hyper-Connections") around the token mixer (KDA or DSA) and the MLP (dense or MoE).

    ``forward(hidden_states [B,S,N,D], layout, prev_topk_indices=None, cache=None, output_attentions=False)`` ->
    ``(hidden_states [B,S,N,D], topk_indices, attn_weights)``: the ids when the next layer is a "shared" indexer
    layer, a DSA layer's weights ``[B, H, S, S_kv]`` with ``output_attentions``, else ``None``.
    """

    def __init__(self, config: Glm53FlashTextConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.self_attn = Glm53FlashLinearAttention(config, layer_idx)
        else:
            self.self_attn = Glm53FlashAttention(config, layer_idx)
        self.mlp = Glm53FlashMoE(config) if config.mlp_layer_types[layer_idx] == "sparse" else Glm53FlashMLP(config)
        self.input_layernorm = Glm53FlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Glm53FlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = Glm53FlashHyperConnection(config)
        self.ffn_hc = Glm53FlashHyperConnection(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        layout: DocumentLayout,
        prev_topk_indices: torch.Tensor | None = None,
        cache=None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        post, comb, x = self.attn_hc(hidden_states)
        x, topk_indices, weights = self.self_attn(self.input_layernorm(x), layout=layout,
                                                  prev_topk_indices=prev_topk_indices, cache=cache,
                                                  output_attentions=output_attentions)
        mhc = requested_backend(self.config, "mhc")  # hc_post called here: one frame from the layer to its kernel
        hidden_states = op_for(hc_post_torch, mhc, x, hidden_states, post, comb)(x, hidden_states, post, comb)
        post, comb, x = self.ffn_hc(hidden_states)
        x = self.mlp(self.post_attention_layernorm(x))
        hidden_states = op_for(hc_post_torch, mhc, x, hidden_states, post, comb)(x, hidden_states, post, comb)
        return hidden_states, topk_indices, weights


class Glm53FlashMTPLayer(GradientCheckpointingLayer):
    """Multi-token-prediction layer (DeepSeek-V3 technical report §2.2) at ``layers.{num_hidden_layers + i}``:
    ``x = eh_proj([enorm(embeds), hnorm(h)])``, then a pre-norm residual block of DSA attention and MoE (no mHC).

    ``forward(inputs_embeds [B,S,D], hidden_states [B,S,D], layout, cache=None)`` -> ``(shared_head.norm(x), x)``,
    both ``[B,S,D]``; the caller rolls ``inputs_embeds`` per document.
    """

    def __init__(self, config: Glm53FlashTextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.enorm = Glm53FlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = Glm53FlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.input_layernorm = Glm53FlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Glm53FlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Glm53FlashAttention(config, layer_idx, indexer_type="full")
        self.mlp = Glm53FlashMoE(config)
        # the published key shared_head.norm; logits go through the main lm_head
        self.shared_head = nn.ModuleDict({"norm": Glm53FlashRMSNorm(config.hidden_size, config.rms_norm_eps)})

    def forward(
        self, inputs_embeds: torch.Tensor, hidden_states: torch.Tensor, layout: DocumentLayout, cache=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(inputs_embeds), self.hnorm(hidden_states)], dim=-1))
        x = x + self.self_attn(self.input_layernorm(x), layout=layout, cache=cache)[0]
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x), x


@dataclass
class Glm53FlashTextModelOutput(MoeModelOutputWithPast):
    """``MoeModelOutputWithPast`` plus, when MTP ran: ``pre_norm_hidden_state`` ``[B,S,D]`` (before the final norm),
    ``mtp_hidden_states`` (one ``[B,S,D]`` per depth) and ``document_layout``; with ``output_mtp_inputs=True``:
    ``pre_norm_hidden_state`` and ``mtp_inputs_embeds`` ``[B,S,D]`` (the embeddings the layers read)."""

    pre_norm_hidden_state: torch.FloatTensor | None = None
    mtp_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    document_layout: DocumentLayout | None = None
    mtp_inputs_embeds: torch.FloatTensor | None = None


class Glm53FlashPreTrainedModel(PreTrainedModel):
    """Base class: initialisation, fp32-kept parameters and loading rules shared by the GLM-5.3-Flash models."""

    config_class = Glm53FlashConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _can_compile_fullgraph = True  # training forward/backward and static-cache decoding (tests/test_compile.py)
    # as the built-in declares them; "eager" and "sdpa" both run this package's DSA / KDA kernels
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # what output_attentions / output_hidden_states / output_router_logits return (the text model collects them;
    # transformers' ModelTesterMixin reads this to pick its output tests; docs/design.md)
    _can_record_outputs = {
        "attentions": OutputRecorder(Glm53FlashAttention, index=2),
        "hidden_states": Glm53FlashDecoderLayer,
        "router_logits": OutputRecorder(Glm53FlashTopkRouter, index=0),
    }
    _no_split_modules = ["Glm53FlashDecoderLayer", "Glm53FlashMTPLayer"]
    _keep_in_fp32_modules_strict = [
        "e_score_correction_bias",
        "gate.weight",
        "conv1d",
        "dt_bias",
        "A_log",
        "attn_hc.base",
        "attn_hc.scale",
        "ffn_hc.base",
        "ffn_hc.scale",
    ]

    def add_model_tags(self, tags: list[str] | str) -> None:
        """``PreTrainedModel.add_model_tags``; on a causal LM, a TRL trainer's tags also tell which loss its fused LM
        head computes, hence whether the MTP layer is trained (:func:`.mtp.note_trainer_tags`)."""
        super().add_model_tags(tags)
        if self.get_output_embeddings() is not None:
            note_trainer_tags(self, tags)

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """``requested_experts`` when given (checked by ``PreTrainedModel``), else ``"eager"``: this package's experts
        forward (:func:`.moe_ops.experts_forward_torch` or its fused alternative)."""
        return "eager" if requested_experts is None else super().get_correct_experts_implementation(requested_experts)

    def _init_weights(self, module):
        super()._init_weights(module)
        config = self.config.get_text_config(decoder=True)
        init_kda_weights(module, config)
        init_dsa_weights(module, config)
        init_mhc_weights(module, config)
        init_moe_weights(module, config)

    def save_pretrained(self, save_directory, *args, processor=None, allow_nonfinite_weights: bool = False, **kwargs):
        """``PreTrainedModel.save_pretrained`` in the published layout (``model.language_model.*``, per-expert weights,
        split KDA convolutions, ``hc_*``), with ``model_type: glm5_next``, this package's ``auto_map`` and the
        remote-code modules, written atomically (:func:`.checkpoint_io.atomic_save`): a failure or a kill leaves the old
        folder or the new one; the old folder's entries that are not checkpoint files are kept. ``processor`` is saved
        into the same folder in the same swap; ``is_main_process=False`` writes nothing; ``distributed_checkpoint=True``
        saves in place, not atomically.

        Raises:
            ValueError: ``save_directory`` is a file; a weight holds NaN or Inf without ``allow_nonfinite_weights``.
        """
        import tempfile

        from .checkpoint import own_conversions
        from .checkpoint_checks import check_finite_for_save
        from .checkpoint_io import atomic_save

        if not allow_nonfinite_weights:
            state_dict = kwargs.get("state_dict")
            check_finite_for_save(self.state_dict() if state_dict is None else state_dict, type(self).__name__)

        self.config.auto_map = dict(getattr(self.config, "auto_map", None) or {}, **AUTO_MAP)
        super_save = super().save_pretrained

        def parent(*a, **kw):  # reverts this module's conversions, whichever copy registered last
            with own_conversions():
                return super_save(*a, **kw)

        if kwargs.get("distributed_checkpoint"):
            return parent(save_directory, *args, **kwargs)
        is_main = args[0] if args else kwargs.get("is_main_process", True)
        if not self.should_save_on_this_rank(is_main):
            with tempfile.TemporaryDirectory() as scratch:  # gathers happen on every rank; nothing is written
                return parent(scratch, *args, **kwargs)
        if kwargs.get("push_to_hub"):
            kwargs.setdefault("repo_id", os.path.basename(os.path.abspath(os.fspath(save_directory))))

        def write(folder: str) -> None:
            parent(folder, *args, **kwargs)
            if processor is not None:
                processor.save_pretrained(folder)

        atomic_save(save_directory, write)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; ``ValueError`` naming integer or bool tensors given for float weights."""
        from .checkpoint_checks import check_state_dict_dtypes

        check_state_dict_dtypes(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """``PreTrainedModel.from_pretrained`` with checkpoint checks and strict key accounting
        (:func:`.checkpoint.load_pretrained`); reads the key-prefix variants of :mod:`.checkpoint` and FP8
        checkpoints; a text-only class skips vision tensors (one info line).

        Raises:
            ValueError: missing, unexpected or mismatched keys (unless ``allow_missing_keys`` /
                ``allow_unexpected_keys`` / ``ignore_mismatched_sizes`` / ``output_loading_info``); a corrupt shard;
                integer or bool tensors for weights; config sizes disagreeing with the headers; a bad index; NaN or
                Inf weights (unless ``allow_nonfinite_weights=True``).
        """
        from .checkpoint import load_pretrained, own_conversions

        with own_conversions():  # this module's conversions, whichever copy registered last
            return load_pretrained(cls, super().from_pretrained, pretrained_model_name_or_path, *args, **kwargs)


class Glm53FlashTextModel(Glm53FlashPreTrainedModel):
    """The GLM-5.3-Flash decoder stack (state dict as ``Glm5NextTextModel``).

    ``forward(input_ids [B,S] | inputs_embeds [B,S,D], attention_mask?, position_ids?, **packing_kwargs)`` ->
    :class:`Glm53FlashTextModelOutput` with ``last_hidden_state = norm(mean_streams(X))`` ``[B,S,D]``; as
    transformers' glm5_next, ``hidden_states`` (the streams ``[B,S,N,D]`` after the embedding and each layer but the
    last, then ``last_hidden_state``; a list of indices keeps those) and ``attentions`` (one ``[B, H, S, S_kv]`` per
    DSA main layer, from a dense torch path). Packing kwargs: ``cu_seq_lens_q`` / ``cu_seqlens`` (int ``[N+1]``),
    ``seq_idx`` ``[B,S]`` (:func:`.packing.build_layout`). Generation: ``cache`` / ``past_key_values`` (a
    ``DynamicCache(config=...)`` or ``StaticCache``) or ``use_cache=True``; new tokens continue the cached rows
    (``attention_mask`` ``[B, past + S]`` or ``None``, left padding allowed). ``mtp_depth=D > 0`` (uncached) also
    runs :meth:`mtp_forward`; ``output_mtp_inputs=True`` returns what MTP drafting reads.

    Raises:
        ValueError: both or neither of ``input_ids`` / ``inputs_embeds``; an input on the meta device while the
            weights hold data; bad ids, embeddings (:mod:`.input_checks`), attention mask, positions or packing; a
            cache with packed documents, padding after a real token or more tokens than a static cache holds;
            ``mtp_depth > 0`` with a cache or without an MTP layer; at construction, special token ids outside
            ``[0, vocab_size)``.
        NotImplementedError: a ``cache`` that is not a transformers ``Cache``.
    """

    config_class = Glm53FlashTextConfig
    _keys_to_ignore_on_load_unexpected = list(VISION_KEY_PATTERNS) + [r"^lm_head\.weight$"]
    _skips_vision_tower = True

    def __init__(self, config: Glm53FlashTextConfig):
        super().__init__(config)
        config.check_special_token_ids()
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        n = config.num_hidden_layers
        layers = [Glm53FlashDecoderLayer(config, i) for i in range(n)]
        layers += [Glm53FlashMTPLayer(config, n + i) for i in range(config.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = Glm53FlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        # None, or fn(batch_size, seq_len, device, **forward kwargs) -> DocumentLayout, set from outside for a
        # forward over a part of longer rows (the package's train applies sequence parallelism through it)
        self.layout_builder = None
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        past_key_values=None,
        cache=None,
        mtp_depth: int = 0,
        output_mtp_inputs: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Glm53FlashTextModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        check_not_meta({"input_ids": input_ids, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                        "position_ids": position_ids}, self)
        if input_ids is not None:
            check_input_ids(input_ids, self.config.vocab_size)
        else:
            check_inputs_embeds(inputs_embeds, self.config.hidden_size)
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = DynamicCache(config=self.config)
        if mtp_depth and (cache is not None or self.config.num_nextn_predict_layers == 0):
            raise ValueError(
                f"mtp_depth={mtp_depth} needs an uncached forward of a model with an MTP layer; got "
                f"num_nextn_predict_layers={self.config.num_nextn_predict_layers}, cache={type(cache).__name__}"
            )
        output_router_logits, output_attentions, output_hidden_states = (
            getattr(self.config, name, False) if value is None else value for name, value in (
                ("output_router_logits", kwargs.pop("output_router_logits", None)),
                ("output_attentions", kwargs.pop("output_attentions", None)),
                ("output_hidden_states", output_hidden_states)))  # fmt: skip
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_len = inputs_embeds.shape[:2]
        if cache is not None:
            check_cache(cache, type(self).__name__)
            check_cache_layers(cache, self.config, type(self).__name__)
        layout = (self.layout_builder or build_layout)(
            batch_size, seq_len, inputs_embeds.device, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, **kwargs,
        )
        if self.gradient_checkpointing and self.training and cache is None:
            layout.selections = {}  # DSA ids kept for the layers' recompute (docs/design.md, DSA)
        hidden_states = hc_expand(inputs_embeds, self.config.hc_mult)
        all_hidden = (hidden_states,) if output_hidden_states else None
        topk_indices = None
        router_logits, hooks = [], []
        if output_router_logits:
            # hooks removed before returning: an activation-checkpoint recompute records nothing
            for layer in self.layers[: self.config.num_hidden_layers]:
                gate = getattr(getattr(layer, "mlp", None), "gate", None)
                if isinstance(gate, Glm53FlashTopkRouter):
                    hooks.append(gate.register_forward_hook(lambda _m, _i, out: router_logits.append(out[0])))
        attentions = () if output_attentions else None
        try:
            for layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states, topk_indices, weights = layer(
                    hidden_states, layout, prev_topk_indices=topk_indices, cache=cache,
                    output_attentions=bool(output_attentions),
                )
                if weights is not None:  # DSA layers only, as the built-in (KDA layers form no weights)
                    attentions += (weights,)
                if output_hidden_states:
                    all_hidden += (hidden_states,)
        finally:
            for hook in hooks:
                hook.remove()
        router_logits = tuple(router_logits) if output_router_logits else None
        h_pre = hc_head(hidden_states)
        hidden_states = self.norm(h_pre)
        if output_hidden_states:  # as the built-in: the last layer's entry is the final norm's output
            all_hidden = all_hidden[:-1] + (hidden_states,)
            if isinstance(output_hidden_states, (list, tuple)):  # transformers' indices to keep (others None)
                kept = {int(i) % len(all_hidden) for i in output_hidden_states}
                all_hidden = tuple(h if i in kept else None for i, h in enumerate(all_hidden))
        mtp_inputs = {"pre_norm_hidden_state": h_pre, "mtp_inputs_embeds": inputs_embeds} if output_mtp_inputs else {}
        mtp_hidden = None
        if mtp_depth:
            embeds = inputs_embeds if input_ids is None else None
            mtp_hidden = self.mtp_forward(h_pre, layout, mtp_depth, inputs_embeds=embeds, input_ids=input_ids)
            mtp_inputs["pre_norm_hidden_state"] = h_pre
        keep_layout = mtp_depth or output_router_logits or layout.shard is not None
        return Glm53FlashTextModelOutput(
            last_hidden_state=hidden_states, hidden_states=all_hidden, router_logits=router_logits,
            **{CACHE_FIELD: cache},
            document_layout=layout if keep_layout else None, attentions=attentions, mtp_hidden_states=mtp_hidden,
            **mtp_inputs,
        )

    def mtp_forward(
        self,
        h_pre: torch.Tensor,
        layout: DocumentLayout,
        depth: int,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The MTP block at ``depth`` depths sharing the first MTP layer (DeepSeek-V3 §2.2).

        Depth ``k`` reads the embeddings of the ids rolled by ``-k`` per document (:func:`.mtp.doc_roll`; given
        ``inputs_embeds`` are rolled themselves) and, as ``h``, ``h_pre`` ``[B,S,D]`` (before the final norm) for
        ``k = 1``, else depth ``k-1``'s output before ``shared_head.norm``. Exactly one of ``input_ids`` ``[B,S]`` /
        ``inputs_embeds`` ``[B,S,D]``. Returns ``depth`` tensors ``[B,S,D]`` normalised by ``shared_head.norm``;
        raises ``ValueError`` without an MTP layer, for ``depth < 1`` or not exactly one input.
        """
        if self.config.num_nextn_predict_layers == 0 or depth < 1:
            raise ValueError(
                f"mtp_forward needs an MTP layer and depth >= 1; got num_nextn_predict_layers="
                f"{self.config.num_nextn_predict_layers}, depth={depth}"
            )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("mtp_forward needs exactly one of input_ids or inputs_embeds")
        layer = self.layers[self.config.num_hidden_layers]
        h, outs = h_pre, []
        for k in range(1, depth + 1):
            if inputs_embeds is not None:
                e = doc_roll(inputs_embeds, layout, k, fill=0.0)
            else:
                e = self.embed_tokens(doc_roll(input_ids, layout, k, fill=0))
            out, h = layer(e, h, layout)
            outs.append(out)
        return tuple(outs)


@dataclass
class Glm53FlashCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    """``MoeCausalLMOutputWithPast`` plus, when MTP ran, ``mtp_loss`` (mean over depths; ``loss`` is
    ``main + mtp_loss_weight * mtp_loss``) and ``mtp_logits`` (one ``[B,S,V]`` per depth); the VL model's
    ``image_outputs`` / ``video_outputs``; with ``output_mtp_inputs=True`` the text model's MTP inputs."""

    mtp_loss: torch.FloatTensor | None = None
    mtp_logits: tuple[torch.FloatTensor, ...] | None = None
    image_outputs: object | None = None
    video_outputs: object | None = None
    pre_norm_hidden_state: torch.FloatTensor | None = None
    mtp_inputs_embeds: torch.FloatTensor | None = None


def _head_forward(head_model, labels, logits_to_keep, use_cache, kwargs, **inputs):
    """Both heads' forward: the checks of :mod:`.input_checks`, ``head_model.model(**inputs, **kwargs)`` with
    ``config.mtp_depth`` MTP depths when there are labels, an MTP layer, no cache and the ``mtp`` kwarg ``True``
    (``None``: ``mtp_loss_weight > 0``), else 0; then :func:`_lm_head_and_loss`."""
    check_not_meta({"labels": labels, "shift_labels": kwargs.get("shift_labels")}, head_model)
    check_loss_arguments(kwargs.get("num_items_in_batch"), logits_to_keep)
    source = inputs["input_ids"] if inputs["input_ids"] is not None else inputs["inputs_embeds"]
    if source is not None and source.dim() >= 2:  # else the model raises, naming the inputs
        ignore = kwargs.get("ignore_index", -100)
        for name, value in (("labels", labels), ("shift_labels", kwargs.get("shift_labels"))):
            check_labels(value, tuple(source.shape[:2]), head_model.vocab_size, ignore, name=name)
    requested = kwargs.pop("mtp", None)
    config = head_model.config.get_text_config(decoder=True)
    cached = kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None or use_cache
    on = requested if requested is not None else config.mtp_loss_weight > 0
    off = not on or labels is None or config.num_nextn_predict_layers == 0 or cached
    kwargs["use_cache"] = use_cache
    kwargs["mtp_depth"] = 0 if off else config.mtp_depth
    outputs = head_model.model(**inputs, **kwargs)
    return _lm_head_and_loss(head_model, outputs, labels, logits_to_keep, kwargs)


def _lm_head_and_loss(head_model, outputs, labels, logits_to_keep, kwargs) -> Glm53FlashCausalLMOutputWithPast:
    """Logits of the kept positions, transformers' ``ForCausalLMLoss`` (divided by ``num_items_in_batch``, else by the
    supervised-token count, at least 1: all-ignored labels give 0.0), plus the MTP and router losses when they ran."""
    kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = head_model.lm_head(outputs.last_hidden_state[:, kept, :])
    text_config = head_model.config.get_text_config(decoder=True)
    loss = None
    if labels is not None:
        loss_kwargs = {k: kwargs[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}
        counted = loss_kwargs.get("num_items_in_batch") is not None
        # MTP targets: the caller's shift_labels or the labels, never a shard's row-wise shift (it crosses documents)
        given_shift = loss_kwargs.get("shift_labels")
        shard = getattr(getattr(outputs, "document_layout", None), "shard", None)
        if shard is not None:  # a part of longer rows: the shift and the counts of the whole rows
            loss_kwargs = shard.loss_kwargs(labels, loss_kwargs)
        main_kwargs = dict(loss_kwargs)
        if main_kwargs.get("num_items_in_batch") is None:
            # sum / count with count >= 1: labels all ignored give loss 0.0 and zero gradients, not NaN
            ignore = loss_kwargs.get("ignore_index", -100)
            shifted = loss_kwargs.get("shift_labels")
            targets = shifted if shifted is not None else labels[..., 1:]
            count = (targets != ignore).sum()
            if not in_graph() and int(count) == 0:
                logger.warning_once(
                    f"labels: every target is ignore_index={ignore} (no supervised token); loss is 0.0 with zero "
                    "gradients"
                )
            main_kwargs["num_items_in_batch"] = count.clamp_min(1)
        loss = head_model.loss_function(logits=logits, labels=labels, vocab_size=head_model.vocab_size, **main_kwargs)
    mtp_value = mtp_logits = None
    mtp_hidden = getattr(outputs, "mtp_hidden_states", None)
    if labels is not None and mtp_hidden:
        # without a given count, each depth's mean (of a shard: over the whole rows' targets of that depth)
        per_depth_mean = shard is not None and not counted
        mtp_value, mtp_logits = mtp_loss(
            head_model.lm_head,
            mtp_hidden,
            given_shift if given_shift is not None else labels,
            outputs.document_layout,
            num_items_in_batch=None if per_depth_mean else loss_kwargs.get("num_items_in_batch"),
            ignore_index=loss_kwargs.get("ignore_index", -100),
            shifted=given_shift is not None,
            count_total=shard.global_count if per_depth_mean else None,
        )
        loss = loss + text_config.mtp_loss_weight * mtp_value
    router_logits = getattr(outputs, "router_logits", None)
    aux_loss = None
    if router_logits:
        aux_loss = router_load_balancing_loss(text_config, router_logits, outputs.document_layout)
        if loss is not None:
            loss = loss + text_config.router_aux_loss_coef * aux_loss
    return Glm53FlashCausalLMOutputWithPast(
        loss=loss, logits=logits, hidden_states=outputs.hidden_states,
        **{CACHE_FIELD: getattr(outputs, CACHE_FIELD, None)},
        attentions=getattr(outputs, "attentions", None),
        mtp_loss=mtp_value, mtp_logits=mtp_logits, aux_loss=aux_loss, router_logits=router_logits,
        image_outputs=getattr(outputs, "image_outputs", None), video_outputs=getattr(outputs, "video_outputs", None),
        pre_norm_hidden_state=outputs.pre_norm_hidden_state if kwargs.get("output_mtp_inputs") else None,
        mtp_inputs_embeds=outputs.mtp_inputs_embeds if kwargs.get("output_mtp_inputs") else None,
    )


def router_load_balancing_loss(config, router_logits: tuple[torch.Tensor, ...], layout: DocumentLayout):
    """Router load-balancing loss (Switch Transformer eqs. 4-6) by transformers' ``load_balancing_loss_func``, padding
    (``layout.valid`` False) excluded: a 0-dim fp32 tensor from ``router_logits`` (one ``[B*S, E]`` per main MoE
    layer; the MTP router is not included). On with ``output_router_logits=True``; ``loss`` then gains
    ``router_aux_loss_coef * aux_loss``."""
    from transformers.models.glm5_next.modeling_glm5_next import load_balancing_loss_func

    mask = None if layout is None or layout.trivial else layout.valid.to(torch.long)
    return load_balancing_loss_func(tuple(router_logits), config.n_routed_experts, config.num_experts_per_tok, mask)


class _Glm53FlashHeadModel(Glm53FlashPreTrainedModel, GenerationMixin):
    """What both heads share: ``model`` (:meth:`_backbone`) and an untied ``lm_head``, the MTP loss under a trainer's
    fused LM head (:func:`.mtp.register_fused_head_mtp`), and the ``GenerationMixin`` hooks: croppable caches for
    assisted decoding (``_is_stateful = False``, :func:`.generation_cache.make_croppable`), ``use_mtp=True`` drafting
    with our MTP layer, the 2-D padding mask ``[B, past + S]`` as the layers' mask."""

    _tp_plan = {"lm_head": "colwise_gather_output"}
    accepts_loss_kwargs = True
    _is_stateful = False
    mtp_stats: dict | None = None  # the last generate(use_mtp=True): drafted, accepted, acceptance_rate, mtp_calls

    def __init__(self, config):
        super().__init__(config)
        text_config = config.get_text_config(decoder=True)
        self.model = self._backbone(config)
        self.vocab_size = text_config.vocab_size
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        register_fused_head_mtp(self)
        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        """transformers' cache preparation; assisted (or assistant) generation gets croppable KDA / indexer layers."""
        from transformers.generation.configuration_utils import GenerationMode

        from .generation_cache import check_croppable, make_croppable

        out = super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)
        # generation_config.is_assistant: this model drafts for another, and transformers crops its cache
        assisted = generation_mode == GenerationMode.ASSISTED_GENERATION or generation_config.is_assistant
        if assisted and model_kwargs.get(CACHE_FIELD) is not None:
            check_croppable(make_croppable(model_kwargs[CACHE_FIELD]))
        return out

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 *args, **kwargs):
        """``use_mtp=True``: :class:`.mtp_generation.Glm53FlashMTPCandidateGenerator` (``ValueError`` without an MTP
        layer); otherwise transformers' choice."""
        others = (generation_config.assistant_early_exit, generation_config.prompt_lookup_num_tokens)
        if generation_config.use_mtp and all(other is None for other in others):
            from .mtp_generation import Glm53FlashMTPCandidateGenerator

            return Glm53FlashMTPCandidateGenerator(self, generation_config, model_kwargs, logits_processor)
        return super()._get_candidate_generator(
            generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, *args, **kwargs
        )

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """``GenerationMixin.generate`` after checking what it cannot serve.

        Raises:
            ValueError: an input on the meta device while the weights hold data; an ``attention_mask`` row that is
                not left padding with a real token; a cache built for other layers, or filled and not shorter than
                the inputs (a filled cache is continued: the inputs are the whole sequence); a fixed-size cache
                smaller than the prompt plus ``max_new_tokens`` (or ``max_length``).
            NotImplementedError: a cache that is not a transformers ``Cache``.
        """
        names = ("input_ids", "inputs_embeds", "attention_mask", "pixel_values", "pixel_values_videos")
        check_not_meta({"inputs": inputs, **{name: kwargs.get(name) for name in names}}, self)
        cache = kwargs.get("cache") if kwargs.get("cache") is not None else kwargs.get("past_key_values")
        given = (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds"))
        prompt = next((p for p in given if p is not None), None)
        prompt_len = prompt.shape[1] if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2 else 0
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not torch.compiler.is_compiling():
            check_left_padding(mask.bool())
        if cache is not None:
            check_cache(cache, "generate")
            check_cache_layers(cache, self.config.get_text_config(decoder=True), "generate")
            if prompt_len:
                check_cache_continuation(cache, prompt_len, mask.shape[1] if isinstance(mask, torch.Tensor) else None)
        capacity = cache.get_max_length() if hasattr(cache, "get_max_length") else -1
        if capacity > 0:
            config = generation_config if generation_config is not None else self.generation_config
            max_new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
            if max_new is not None:
                needed, how = prompt_len + max_new, f"prompt {prompt_len} + max_new_tokens {max_new}"
            else:
                needed = kwargs.get("max_length", getattr(config, "max_length", None)) or 0
                how = f"max_length {needed}"
            if needed > capacity:
                raise ValueError(
                    f"the cache is a {type(cache).__name__} of max_cache_len={capacity} but generate needs "
                    f"{needed} positions ({how}); make the cache with max_cache_len >= {needed} or generate fewer "
                    "tokens"
                )
        return super().generate(inputs, generation_config, **kwargs)

    @staticmethod
    def create_masks_for_generate(config, inputs_embeds, attention_mask, cache=None, **kwargs):
        """Return ``attention_mask`` as is (2-D ``[B, past + S]`` or ``None``)."""
        return attention_mask


class Glm53FlashForCausalLM(_Glm53FlashHeadModel):
    """Text-only GLM-5.3-Flash causal LM (``lm_head`` untied) from :class:`Glm53FlashConfig` or its text config;
    loads the published layout (vision tensors skipped, one info line).

    ``forward(..., labels=None, num_items_in_batch=None, logits_to_keep=0)`` ->
    :class:`Glm53FlashCausalLMOutputWithPast`; ``loss`` is transformers' ``ForCausalLMLoss`` (shifted, fp32;
    divided by ``num_items_in_batch`` when given, else by the supervised-token count); labels all ``ignore_index``
    give ``loss == mtp_loss == 0.0`` with zero gradients. Raises ``ValueError`` for ``labels`` / ``shift_labels``
    on the meta device, not integer, not ``[B, S]`` or with ids outside ``[0, vocab_size)``, for
    ``num_items_in_batch <= 0`` or ``logits_to_keep < 0``, and the text model's input errors. Under a trainer's
    fused LM head (TRL's ``fused_lm_head=True``) the MTP loss joins an SFT trainer's loss
    (:func:`.mtp.register_fused_head_mtp`).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _keys_to_ignore_on_load_unexpected = list(VISION_KEY_PATTERNS)
    _skips_vision_tower = True

    @staticmethod
    def _backbone(config):
        return Glm53FlashTextModel._from_config(config.get_text_config(decoder=True))

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Glm53FlashCausalLMOutputWithPast:
        return _head_forward(
            self, labels, logits_to_keep, use_cache, kwargs, input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids, inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
        )  # fmt: skip


@dataclass
class Glm53FlashModelOutputWithPast(Glm53FlashTextModelOutput):
    """Base VL model output: the text model's fields plus the vision tower outputs that were computed."""

    image_outputs: object | None = None
    video_outputs: object | None = None


def placeholder_masks(
    input_ids: torch.Tensor | None,
    mm_token_type_ids: torch.Tensor | None,
    config,
    inputs_embeds: torch.Tensor | None = None,
    embed_tokens: nn.Module | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image and video placeholder masks ``[B, S]`` (bool), as ``Glm5NextModel.get_placeholder_mask``: ``<|image|>``
    tokens, a video's inside ``<|begin_of_video|> … <|end_of_video|>``; ``mm_token_type_ids`` (1 image, 2 video),
    when given, decides (``ValueError`` if it disagrees with ``input_ids``); without ``input_ids`` the tokens are
    recognised by their embeddings."""
    if mm_token_type_ids is not None:
        if input_ids is not None:
            marked, placeholder = mm_token_type_ids != 0, input_ids == config.image_token_id
            if not in_graph() and not torch.equal(marked, placeholder):  # a traced graph cannot raise on data
                raise ValueError(
                    f"mm_token_type_ids marks {int(marked.sum())} tokens as image/video but input_ids holds "
                    f"{int(placeholder.sum())} <|image|> placeholders (image_token_id={config.image_token_id}) at "
                    f"{int((marked != placeholder).sum())} differing positions; they must agree token for token"
                )
        return mm_token_type_ids == 1, mm_token_type_ids == 2
    if input_ids is None:
        if inputs_embeds is None or embed_tokens is None:
            raise ValueError("placeholder_masks needs input_ids, mm_token_type_ids or inputs_embeds + embed_tokens")

        def is_token(token_id):
            ref = embed_tokens(torch.tensor(token_id, device=inputs_embeds.device))
            return (inputs_embeds == ref).all(-1)

        placeholder = is_token(config.image_token_id)
        starts, ends = is_token(config.video_start_token_id), is_token(config.video_end_token_id)
    else:
        placeholder = input_ids == config.image_token_id
        starts, ends = input_ids == config.video_start_token_id, input_ids == config.video_end_token_id
    in_video = starts.long().cumsum(-1) > ends.long().cumsum(-1)
    return placeholder & ~in_video, placeholder & in_video


def _vision_fake(visual, pixel_values, grid_thw):
    merge = visual.config.spatial_merge_size
    return pixel_values.new_empty(pixel_values.shape[0] // (merge * merge), visual.config.out_hidden_size)


_VISION_OP = module_op(
    "vision_tower", lambda visual, x, grid: visual(x, grid_thw=grid).pooler_output, fake=_vision_fake
)


class Glm53FlashModel(Glm53FlashPreTrainedModel):
    """GLM-5.3-Flash vision-language base model: transformers' glm5_next vision tower and our text model
    (``model.visual.*`` / ``model.language_model.*``).

    ``forward(input_ids | inputs_embeds, attention_mask?, position_ids?, pixel_values?, image_grid_thw?,
    pixel_values_videos?, video_grid_thw?, mm_token_type_ids?, **packing_kwargs)``: the vision features replace the
    placeholders in order (images, then videos), then the text model runs. Raises ``ValueError`` for placeholder
    and feature counts that differ, vision inputs without their grid or not matching it
    (:func:`.input_checks.check_vision_inputs`), inputs on the meta device, and the text model's input errors.
    """

    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: Glm53FlashConfig):
        super().__init__(config)
        self.visual = Glm5NextVisionModel._from_config(config.vision_config)
        self._vision_key = register_module(self.visual)  # eagerly: a traced graph cannot register it
        self.language_model = Glm53FlashTextModel._from_config(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.embed_tokens

    def set_input_embeddings(self, value):
        self.language_model.embed_tokens = value

    @staticmethod
    def _frames_grid(video_grid_thw: torch.LongTensor) -> torch.LongTensor:
        """``[t, h, w]`` rows as ``t`` rows ``[1, h, w]``: each temporal slice is its own sequence, as the reference."""
        hw = torch.repeat_interleave(video_grid_thw[:, 1:], video_grid_thw[:, 0], dim=0)
        return torch.cat([hw.new_ones(hw.shape[0], 1), hw], dim=1)

    def _tower_outputs(self, pixel_values, grid_thw, split_grid_thw, **kwargs):
        outputs = self.visual(pixel_values.to(self.visual.dtype), grid_thw=grid_thw, **kwargs)
        split_sizes = (split_grid_thw.prod(-1) // self.visual.spatial_merge_size**2).tolist()
        outputs.pooler_output = torch.split(outputs.pooler_output, split_sizes)
        return outputs

    @accepts_precomputed_kwargs(modality="image")
    @can_return_tuple
    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.LongTensor | None = None, **kwargs
    ) -> tuple | BaseModelOutputWithPooling:
        """Vision tower output for ``pixel_values`` ``[patches, C*T*P*P]`` and ``image_grid_thw`` ``[images, 3]``, as
        ``Glm5NextModel.get_image_features``: ``BaseModelOutputWithPooling`` whose ``pooler_output`` holds one
        ``[t*h*w / merge^2, text hidden]`` tensor per image; keyword arguments go to the tower."""
        return self._tower_outputs(pixel_values, image_grid_thw, image_grid_thw, **kwargs)

    @accepts_precomputed_kwargs(modality="video")
    @can_return_tuple
    def get_video_features(
        self, pixel_values_videos: torch.Tensor, video_grid_thw: torch.LongTensor | None = None, **kwargs
    ) -> tuple | BaseModelOutputWithPooling:
        """As :meth:`get_image_features` for videos (``video_grid_thw`` ``[videos, 3]``), as
        ``Glm5NextModel.get_video_features``: one ``pooler_output`` tensor per video."""
        return self._tower_outputs(pixel_values_videos, self._frames_grid(video_grid_thw), video_grid_thw, **kwargs)

    def _placeholder_tower_call(self, device: torch.device) -> torch.Tensor:
        """The tower's merged features ``[1, D]`` of one ``[1, m, m]`` grid of zero patches (``m`` the merge size)."""
        vision_config = self.config.vision_config
        merge = vision_config.spatial_merge_size
        pixels = torch.zeros(merge * merge, patch_width(vision_config), dtype=self.visual.dtype, device=device)
        grid = torch.tensor([[1, merge, merge]], device=device)
        return self.visual(pixels, grid_thw=grid).pooler_output

    @staticmethod
    def _splice(inputs_embeds, mask, features, what: str):
        n_tokens = None if in_graph() else int(mask.sum())  # checked eagerly; a traced graph cannot raise on data
        if n_tokens is not None and n_tokens != features.shape[0]:
            raise ValueError(
                f"{what} placeholders and features do not match: {n_tokens} {what} placeholder tokens in the input, "
                f"{features.shape[0]} {what} feature rows from the vision tower"
            )
        return inputs_embeds.masked_scatter(mask[..., None], features.to(inputs_embeds.dtype))

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Glm53FlashModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        check_not_meta({"input_ids": input_ids, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                        "position_ids": position_ids, "pixel_values": pixel_values,
                        "pixel_values_videos": pixel_values_videos, "image_grid_thw": image_grid_thw,
                        "video_grid_thw": video_grid_thw, "mm_token_type_ids": mm_token_type_ids}, self)
        text_config = self.config.get_text_config(decoder=True)
        if input_ids is not None:
            check_input_ids(input_ids, text_config.vocab_size)
        else:
            check_inputs_embeds(inputs_embeds, text_config.hidden_size)
        modalities = (("image", pixel_values, image_grid_thw, "pixel_values", "image_grid_thw"),
                      ("video", pixel_values_videos, video_grid_thw, "pixel_values_videos", "video_grid_thw"))
        for _, pixels, grid, pixels_name, grid_name in modalities:
            if pixels is not None:
                check_vision_inputs(pixels, grid, self.config.vision_config, pixels_name, grid_name)
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        tower_outputs = {"image": None, "video": None}
        collective_tower = not in_graph() and _holds_distributed_parameters(self.visual)  # before the tower's calls
        if pixel_values is not None or pixel_values_videos is not None:
            masks = dict(zip(("image", "video"), placeholder_masks(
                input_ids, mm_token_type_ids, self.config, inputs_embeds, self.get_input_embeddings()
            )))  # fmt: skip
            tower_kwargs = {k: kwargs[k] for k in ("output_hidden_states", "output_attentions") if k in kwargs}
            if output_hidden_states is not None:
                tower_kwargs["output_hidden_states"] = output_hidden_states
            for what, pixels, grid, _, _ in modalities:
                if pixels is None:
                    continue
                if in_graph():  # the custom op glm53flash::vision_tower: one tensor (no split by host sizes)
                    tower_grid = self._frames_grid(grid) if what == "video" else grid
                    params = module_parameters(self.visual)
                    features = _VISION_OP(pixels.to(self.visual.dtype), tower_grid, params, self._vision_key)
                    tower_outputs[what] = BaseModelOutputWithPooling(pooler_output=features)
                else:
                    features_fn = self.get_video_features if what == "video" else self.get_image_features
                    tower_outputs[what] = features_fn(pixels, grid, return_dict=True, **tower_kwargs)
                    features = torch.cat(tower_outputs[what].pooler_output, dim=0)
                inputs_embeds = self._splice(inputs_embeds, masks[what], features, what)
        if collective_tower:
            # a tower whose parameters are distributed gathers them in every call (a collective), so every rank calls
            # it once per modality: a modality absent here runs on one merged token of zeros whose features add 0
            for _, pixels, _, _, _ in modalities:
                if pixels is None:
                    inputs_embeds = inputs_embeds + 0.0 * self._placeholder_tower_call(inputs_embeds.device).sum()
        uncached = kwargs.get("past_key_values") is None and kwargs.get("cache") is None
        if input_ids is not None and uncached and not in_graph():
            # A full (uncached) forward must get features for every placeholder it holds (checked eagerly).
            full_masks = placeholder_masks(input_ids, mm_token_type_ids, self.config)
            for mask, (what, given, _, pixels_name, _) in zip(full_masks, modalities):
                if given is None and bool(mask.any()):
                    raise ValueError(
                        f"input_ids hold {int(mask.sum())} {what} placeholder tokens but no {pixels_name} were given"
                    )
        outputs = self.language_model(
            inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
            output_hidden_states=output_hidden_states, **kwargs,
        )  # fmt: skip
        return Glm53FlashModelOutputWithPast(
            **outputs, image_outputs=tower_outputs["image"], video_outputs=tower_outputs["video"]
        )


def _holds_distributed_parameters(module: nn.Module) -> bool:
    """Whether a parameter of ``module`` is at this moment a ``DTensor`` (sharded or replicated over a device mesh, by
    whatever applied the parallelism), so that a call of ``module`` joins collectives that every rank must join."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


class Glm53FlashForConditionalGeneration(_Glm53FlashHeadModel):
    """GLM-5.3-Flash image/video-text-to-text model (``AutoModelForImageTextToText``, keys as
    ``Glm5NextForConditionalGeneration``): :class:`Glm53FlashModel`'s inputs plus ``labels``, ``num_items_in_batch``,
    ``logits_to_keep``; loss, label checks and TRL's fused LM head as :class:`Glm53FlashForCausalLM`."""

    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    _no_split_modules = ["Glm53FlashDecoderLayer", "Glm53FlashMTPLayer", "Glm5NextVisionBlock"]
    _backbone = Glm53FlashModel

    def get_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
        """:meth:`Glm53FlashModel.get_image_features` (transformers' ``BaseModelOutputWithPooling``)."""
        return self.model.get_image_features(pixel_values, image_grid_thw, **kwargs)

    def get_video_features(self, pixel_values_videos, video_grid_thw=None, **kwargs):
        """:meth:`Glm53FlashModel.get_video_features` (transformers' ``BaseModelOutputWithPooling``)."""
        return self.model.get_video_features(pixel_values_videos, video_grid_thw, **kwargs)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Glm53FlashCausalLMOutputWithPast:
        return _head_forward(
            self, labels, logits_to_keep, use_cache, kwargs, input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids, inputs_embeds=inputs_embeds, pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            mm_token_type_ids=mm_token_type_ids, output_hidden_states=output_hidden_states,
        )  # fmt: skip


# Make save_pretrained copy this module and its relative imports next to the weights (remote code).
Glm53FlashConfig.register_for_auto_class()
Glm53FlashForCausalLM.register_for_auto_class("AutoModelForCausalLM")
Glm53FlashModel.register_for_auto_class("AutoModel")
Glm53FlashForConditionalGeneration.register_for_auto_class("AutoModelForImageTextToText")

__all__ = ["Glm53FlashPreTrainedModel", "Glm53FlashTextModel", "Glm53FlashForCausalLM", "Glm53FlashModel",
           "Glm53FlashForConditionalGeneration", "Glm53FlashDecoderLayer", "Glm53FlashMTPLayer", "Glm53FlashExperts",
           "Glm53FlashMoE", "init_moe_weights"]
