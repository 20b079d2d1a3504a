"""GLM-5.3-Flash text model for glm53flash-hf.

Data path (as transformers' ``models/glm5_next/modeling_glm5_next.py``)::

    input_ids ─ embed_tokens ─ expand to hc_mult streams X [B,S,N,D]
      for each main layer:
        hc_pre → input_layernorm → KDA | DSA (+ KPool indexer) → hc_post
        hc_pre → post_attention_layernorm → dense MLP | MoE     → hc_post
      mean over streams → norm → lm_head                        → logits, loss

Document boundaries are turned once per forward into a :class:`~.packing.DocumentLayout` (from the 2-D
``attention_mask``, ``position_ids`` restarting at 0, and/or ``cu_seq_lens_q`` / ``cu_seqlens`` / ``seq_idx``)
and handed to every layer that mixes tokens, so each packed document and each left-padded row computes exactly
what it computes alone.

Module and parameter names equal transformers' ``glm5_next`` in-memory names (``Glm5NextTextModel``), so the
text model's state dict is interchangeable with ``Glm5NextForConditionalGeneration.model.language_model``; the
published on-disk layout (per-expert weights, split conv, ``hc_*``, ``model.language_model.`` prefix) is read
through the conversions registered in :mod:`.checkpoint`. The MTP layers (``num_nextn_predict_layers``) sit
after the main stack at ``layers.{num_hidden_layers + i}``, as in the published checkpoint.
"""

import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
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
from .dispatch import requested_backend
from .dsa import Glm53FlashAttention, init_dsa_weights
from .generation_cache import (
    check_cache,
    check_cache_continuation,
    check_cache_layers,
    check_left_padding,
)
from .graph_ops import in_graph, module_op, module_parameters, register_module
from .input_checks import (
    check_input_ids,
    check_inputs_embeds,
    check_labels,
    check_loss_arguments,
    check_not_meta,
    check_vision_inputs,
)
from .kda import Glm53FlashLinearAttention, init_kda_weights
from .mhc import Glm53FlashHyperConnection, hc_expand, hc_head, hc_post, init_mhc_weights
from .moe import Glm53FlashMLP, Glm53FlashMoE, Glm53FlashTopkRouter, init_moe_weights
from .mtp import doc_roll, mtp_loss
from .norm import Glm53FlashRMSNorm
from .packing import DocumentLayout, build_layout
from .sequence_parallel import sp_loss_kwargs

logger = logging.get_logger(__name__)

register_conversions()

# Auto classes served by the remote code; written into config.json by save_pretrained.
AUTO_MAP = {
    "AutoConfig": "configuration_glm53flash.Glm53FlashConfig",
    "AutoModel": "modeling_glm53flash.Glm53FlashModel",
    "AutoModelForCausalLM": "modeling_glm53flash.Glm53FlashForCausalLM",
    "AutoModelForImageTextToText": "modeling_glm53flash.Glm53FlashForConditionalGeneration",
}


class Glm53FlashDecoderLayer(GradientCheckpointingLayer):
    """One main-stack layer: two mHC sites around attention (KDA or DSA) and the MLP (dense or MoE).

    Args:
        config: :class:`Glm53FlashTextConfig`.
        layer_idx: index in ``config.layer_types`` / ``mlp_layer_types``.

    ``forward(hidden_states [B,S,N,D], layout, prev_topk_indices=None, cache=None, output_attentions=False)``
    returns ``(hidden_states [B,S,N,D], topk_indices, attn_weights)``, the token mixer's last two entries: the
    indices when the next layer is a ``shared`` indexer layer, a DSA layer's attention weights ``[B, H, S, S_kv]``
    with ``output_attentions=True`` (:meth:`.dsa.Glm53FlashAttention.forward`), else ``None``. ``cache``
    (generation; ``layout.cache_context`` set) goes to the token mixer.
    Source: transformers ``Glm5NextTextDecoderLayer``; mHC: DeepSeek, "mHC: Manifold-Constrained Hyper-Connections".
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
        residual = hidden_states
        post, comb, x = self.attn_hc(hidden_states)
        x = self.input_layernorm(x)
        x, topk_indices, weights = self.self_attn(
            x, layout=layout, prev_topk_indices=prev_topk_indices, cache=cache, output_attentions=output_attentions
        )
        hidden_states = hc_post(x, residual, post, comb, backend=requested_backend(self.config, "mhc"))

        residual = hidden_states
        post, comb, x = self.ffn_hc(hidden_states)
        x = self.post_attention_layernorm(x)
        x = self.mlp(x)
        hidden_states = hc_post(x, residual, post, comb, backend=requested_backend(self.config, "mhc"))
        return hidden_states, topk_indices, weights


class Glm53FlashSharedHead(nn.Module):
    """Holds the MTP layer's ``shared_head.norm`` (the published key); logits go through the main ``lm_head``."""

    def __init__(self, config: Glm53FlashTextConfig):
        super().__init__()
        self.norm = Glm53FlashRMSNorm(config.hidden_size, config.rms_norm_eps)


class Glm53FlashMTPLayer(GradientCheckpointingLayer):
    """Multi-token-prediction layer (DeepSeek-V3 technical report §2.2), at ``layers.{num_hidden_layers + i}``.

    ``x = eh_proj([enorm(embed(t + k)), hnorm(h)])`` (embedding first), then a plain pre-norm residual block
    with its own DSA attention (full indexer) and MoE (no mHC), then ``shared_head.norm``.

    ``forward(inputs_embeds [B,S,D], hidden_states [B,S,D], layout, cache=None)`` →
    ``(out [B,S,D], h [B,S,D])``: ``out`` is normalised by ``shared_head.norm`` (feed to ``lm_head``), ``h`` is the
    block output before it (the next depth's ``hidden_states``). The caller rolls ``inputs_embeds`` per document
    (:meth:`Glm53FlashTextModel.mtp_forward`). ``cache`` (MTP drafting, :mod:`.mtp_generation`; ``layout`` from
    :func:`.packing.build_layout` with it) goes to the attention, whose cache layer is ``layer_idx``
    (:class:`~.generation_cache.MtpDraftCache`).
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
        self.shared_head = Glm53FlashSharedHead(config)

    def forward(
        self, inputs_embeds: torch.Tensor, hidden_states: torch.Tensor, layout: DocumentLayout, cache=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat([self.enorm(inputs_embeds), self.hnorm(hidden_states)], dim=-1))
        residual = x
        attn, _, _ = self.self_attn(self.input_layernorm(x), layout=layout, cache=cache)
        x = residual + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x), x


@dataclass
class Glm53FlashTextModelOutput(MoeModelOutputWithPast):
    """``MoeModelOutputWithPast`` plus, when MTP ran (``mtp_depth > 0``): ``pre_norm_hidden_state`` (``h_pre``
    ``[B,S,D]``, the mean over streams before the final norm), ``mtp_hidden_states`` (one ``[B,S,D]`` per depth)
    and ``document_layout`` (the forward's :class:`DocumentLayout`, for the per-document label roll). With
    ``output_mtp_inputs=True`` (MTP drafting, :mod:`.mtp_generation`): ``pre_norm_hidden_state`` and
    ``mtp_inputs_embeds`` (``[B,S,D]``, the embeddings the layers read, vision features spliced in)."""

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
    # Attention implementations, declared as transformers' Glm5NextPreTrainedModel does. The DSA and KDA kernels are
    # this package's own: "eager" and "sdpa" both select them (config._attn_implementation is not read by the token
    # mixers); flash-attention and flex-attention need index-based / per-layer kernels, as for the built-in.
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # What output_attentions / output_hidden_states / output_router_logits return, as the built-in declares it (the
    # text model collects them itself, without transformers' capture_outputs hooks; transformers' ModelTesterMixin
    # reads this to pick its output tests; docs/design.md): DSA layers' attention weights (index 2 of the mixer's
    # output), the decoder layers' outputs, the main-layer routers' logits (index 0 of the router's output).
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

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """``True``: the routed experts (:class:`.moe.Glm53FlashExperts`) carry transformers' experts-implementation
        decorator, so ``set_experts_implementation`` / ``from_pretrained(experts_implementation=...)`` may switch
        them (transformers' own answer reads the model module's source text; ``docs/design.md``, section "MoE")."""
        return True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """The experts implementation to use: ``requested_experts`` when given (``"eager"``, ``"grouped_mm"``,
        ``"batched_mm"``, hub kernels; checked by ``PreTrainedModel``), else ``"eager"``, this package's own experts
        forward (:func:`.moe.grouped_experts_forward`: torch grouped GEMMs, fused Triton kernels on CUDA), where
        transformers would default to its ``"grouped_mm"``.

        Raises:
            ValueError: an unknown implementation (``PreTrainedModel.get_correct_experts_implementation``).
        """
        if requested_experts is None:
            return "eager"
        return super().get_correct_experts_implementation(requested_experts)

    def _init_weights(self, module):
        super()._init_weights(module)
        config = self.config.get_text_config(decoder=True)
        init_kda_weights(module, config)
        init_dsa_weights(module, config)
        init_mhc_weights(module, config)
        init_moe_weights(module, config)

    def set_sequence_parallel(self, group=None) -> None:
        """Turn sequence parallelism on (``group``: a ``torch.distributed`` process group, e.g.
        ``mesh["sp"].get_group()``) or off (``None``, the default state) for every text model inside ``self``.

        With a group, each rank's uncached forward takes this rank's contiguous shard ``[B, L]`` of the global rows
        (ranks in order; :func:`.sequence_parallel.shard_sequence`), ``position_ids`` / ``attention_mask`` /
        ``seq_idx`` sliced the same way (``cu_seq_lens_q`` / ``cu_seqlens``: the global boundaries), and ``labels``
        sliced the same way (the causal shift is taken over the global rows). The loss is the shard's sum divided by
        ``num_items_in_batch`` (pass the global count; when absent it is the group's total, all-reduced, and each
        MTP depth is divided by its own group total, as one device averages it), so the group's losses and gradients
        summed equal one device's, with or without the count. See :mod:`.sequence_parallel`.
        """
        for module in self.modules():
            if isinstance(module, Glm53FlashTextModel):
                module.sequence_parallel_group = group

    def save_pretrained(self, save_directory, *args, processor=None, allow_nonfinite_weights: bool = False, **kwargs):
        """``PreTrainedModel.save_pretrained`` writing the published layout (``model.language_model.*``, per-expert
        weights, split KDA convolutions, ``hc_*``, MTP at ``layers.{num_hidden_layers + i}``), a ``config.json``
        with ``model_type: glm5_next`` and ``auto_map`` entries for every Auto class this package serves, and a
        copy of the package's modules needed by the remote code — atomically (:func:`.checkpoint.atomic_save`).

        Everything (config, generation config, remote-code modules, shards, index and, with ``processor``, the
        processor's files) is written into a temporary sibling folder that replaces ``save_directory`` only once
        complete. A failure midway leaves the previous folder as it was. The folder becomes exactly the new save
        plus the entries of the old folder that the save does not write and that are not checkpoint files (a README,
        ``adapter/``, logs, tokenizer/processor files, trainer states, subfolders are kept; weights of another layout,
        stale shards and indexes, ``config.json`` and ``generation_config.json`` are not). Nothing is written through
        a symbolic or hard link into another folder. A process killed during the save leaves the old or the new
        folder, never a mix, and the next save or ``from_pretrained`` of the folder cleans up (details and the
        fallbacks for mount points and file systems without an atomic exchange: :func:`.checkpoint.atomic_save`).

        Args:
            save_directory: target folder (created with its parent when missing).
            processor: optional processor (anything with ``save_pretrained(folder)``) saved into the same folder in
                the same swap.
            allow_nonfinite_weights: save weights holding NaN or Inf too; by default they are refused
                (:func:`.checkpoint.check_finite_for_save`, on the ``state_dict`` passed or the model's own).
            *args, **kwargs: ``PreTrainedModel.save_pretrained``'s (``max_shard_size``, ``state_dict``,
                ``is_main_process``, ...). A process that does not save (``is_main_process=False``) takes part in
                the collectives and writes nothing. ``distributed_checkpoint=True`` (every rank writes) saves in
                place, not atomically.

        Raises:
            ValueError: ``save_directory`` is an existing file; a floating-point weight holds NaN or Inf (names the
                first tensors) and ``allow_nonfinite_weights`` is False.
        """
        import tempfile

        from .checkpoint import atomic_save, check_finite_for_save, own_conversions

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
        """``nn.Module.load_state_dict`` that first rejects integer or bool tensors for floating-point weights.

        Raises:
            ValueError: naming the keys and dtypes (:func:`.checkpoint.check_state_dict_dtypes`).
        """
        from .checkpoint import check_state_dict_dtypes

        check_state_dict_dtypes(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """``PreTrainedModel.from_pretrained`` with checkpoint checks and strict key accounting
        (:func:`.checkpoint.load_pretrained`).

        Accepts the key-prefix variants of :mod:`.checkpoint` and FP8 checkpoints (dequantized on load). Missing,
        unexpected or shape-mismatched keys raise ``ValueError`` listing them, unless ``allow_missing_keys=True`` /
        ``allow_unexpected_keys=True`` / ``ignore_mismatched_sizes=True`` is passed (then it warns), or
        ``output_loading_info=True`` (then they are in the returned ``loading_info``, and warned); a corrupt or
        truncated shard, or an integer or bool tensor of a local checkpoint that loads into a weight (one the model
        does not take is an unexpected key), raises ``ValueError`` naming the file or key; so does a config whose
        layer or expert counts or tensor sizes disagree with a local checkpoint's headers (checked before the model
        is built, naming the field and value), an index that lists a key twice, and a folder holding both
        ``model.safetensors`` and an index. A NaN or Inf in a loaded weight raises ``ValueError`` naming the
        parameter (``allow_nonfinite_weights=True`` warns instead). A text-only class skips
        the vision tower's tensors of a multimodal checkpoint and says so in one info line. ``save_pretrained``
        then writes the canonical layout whatever variant was read. Loading and saving use the key conversions of
        this class's own module (:func:`.checkpoint.own_conversions`), whatever other copy of it (a remote-code
        folder's) was imported or used before. A local folder that a killed ``save_pretrained``
        left unfinished is first completed or restored (:func:`.checkpoint.recover_interrupted_save`).
        """
        from .checkpoint import load_pretrained, own_conversions

        with own_conversions():  # this module's conversions, whichever copy registered last
            return load_pretrained(cls, super().from_pretrained, pretrained_model_name_or_path, *args, **kwargs)


class Glm53FlashTextModel(Glm53FlashPreTrainedModel):
    """The GLM-5.3-Flash decoder stack (``Glm5NextTextModel``-compatible state dict).

    ``forward(input_ids [B,S] | inputs_embeds [B,S,D], attention_mask [B,S]?, position_ids [B,S]?,
    **packing_kwargs)`` → ``MoeModelOutputWithPast`` with ``last_hidden_state`` = ``norm(mean_streams(X))``
    ``[B,S,D]``; ``hidden_states`` (when ``output_hidden_states``), as transformers' glm5_next: the stream tensors
    ``[B,S,N,D]`` after the embedding expansion and after each layer but the last, then ``last_hidden_state``
    ``[B,S,D]`` (the final norm's output); a list of indices for ``output_hidden_states`` keeps those entries (the
    others ``None``), as transformers' output capture. ``output_attentions=True`` gives ``attentions``, as the
    built-in: one ``[B, H, S, S_kv]`` tensor per DSA main layer (KDA layers have none), the softmax over the selected
    ids scattered into a dense tensor (zero at the ids not selected); those layers then run a dense torch path
    (``O(S * S_kv)`` memory) that computes the output from the weights, so gradients reach them.

    Packing kwargs: ``cu_seq_lens_q`` / ``cu_seqlens`` (int ``[N+1]``), ``seq_idx`` (``[B,S]``), see
    :func:`.packing.build_layout`.

    Generation cache: ``cache`` (or ``past_key_values``) a transformers ``DynamicCache(config=...)`` /
    ``StaticCache``, or ``use_cache=True`` (a ``DynamicCache`` is created). The new tokens continue the cached
    rows: ``attention_mask`` is then ``[B, past + S]`` (transformers' convention) or ``None``; rows may be left
    padded; the output's ``cache`` holds the updated cache. Layer caches: see :mod:`.generation_cache`.
    ``use_cache`` ``None`` / ``False`` without a cache runs the uncached (training) path.

    MTP: ``mtp_depth=D > 0`` (uncached forwards of a model with ``num_nextn_predict_layers > 0``; the heads pass
    it when the MTP loss is on) also runs :meth:`mtp_forward` and fills the output's ``pre_norm_hidden_state``
    (``h_pre`` ``[B,S,D]``), ``mtp_hidden_states`` (D tensors ``[B,S,D]``) and ``document_layout``.
    ``output_mtp_inputs=True`` (any forward; ``generate(use_mtp=True)`` asks for it) fills
    ``pre_norm_hidden_state`` and ``mtp_inputs_embeds`` (``[B,S,D]``), what the MTP layer reads when drafting.

    Raises:
        ValueError: both or neither of ``input_ids`` / ``inputs_embeds``; an input on the meta device while the
            weights hold data (:func:`.input_checks.check_not_meta`); ``input_ids`` not an integer ``[B, S]``
            tensor, empty, or (eagerly) holding ids outside ``[0, vocab_size)``; ``inputs_embeds`` not a float
            ``[B, S, hidden_size]`` tensor or empty (:mod:`.input_checks`); a non-2-D or non-0/1 attention mask;
            float ``position_ids`` / ``cu_seq_lens_q`` / ``seq_idx``; bad packing; a cache together with packed
            documents, padding after a real token, or more tokens than a static cache holds; ``mtp_depth > 0``
            with a cache or without an MTP layer. At construction: ``pad_token_id``, ``bos_token_id`` or
            ``eos_token_id`` (or one of its ids) not ``None`` nor an id in ``[0, vocab_size)``
            (:meth:`.Glm53FlashTextConfig.check_special_token_ids`).
        NotImplementedError: ``cache`` is not a transformers ``Cache`` (``UnsupportedCacheError``).
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
        self.sequence_parallel_group = None  # set by set_sequence_parallel
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

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
        output_router_logits = kwargs.pop("output_router_logits", None)
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        embeds_given = inputs_embeds is not None
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_len = inputs_embeds.shape[:2]
        if cache is not None:
            check_cache(cache, type(self).__name__)
            check_cache_layers(cache, self.config, type(self).__name__)
        layout = build_layout(
            batch_size, seq_len, inputs_embeds.device, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, sequence_parallel_group=self.sequence_parallel_group, **kwargs,
        )
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_attentions = kwargs.pop("output_attentions", None)
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        hidden_states = hc_expand(inputs_embeds, self.config.hc_mult)
        all_hidden = (hidden_states,) if output_hidden_states else None
        topk_indices = None
        router_logits, hooks = [], []
        if output_router_logits:
            # Record each main-layer router's logits as it runs (transformers' glm5_next records the same tensors
            # with its OutputRecorder); hooks are removed before returning, so an activation-checkpoint recompute
            # in the backward pass records nothing.
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
        if not mtp_depth:
            return Glm53FlashTextModelOutput(
                last_hidden_state=hidden_states, hidden_states=all_hidden, cache=cache, router_logits=router_logits,
                document_layout=layout if output_router_logits or layout.sequence_parallel is not None else None,
                attentions=attentions, **mtp_inputs,
            )
        mtp_hidden = self.mtp_forward(
            h_pre, layout, mtp_depth, inputs_embeds=inputs_embeds if embeds_given else None, input_ids=input_ids
        )
        return Glm53FlashTextModelOutput(
            last_hidden_state=hidden_states, hidden_states=all_hidden, cache=cache, pre_norm_hidden_state=h_pre,
            mtp_hidden_states=mtp_hidden, document_layout=layout, router_logits=router_logits, attentions=attentions,
            mtp_inputs_embeds=mtp_inputs.get("mtp_inputs_embeds"),
        )

    def mtp_forward(
        self,
        h_pre: torch.Tensor,
        layout: DocumentLayout,
        depth: int,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The MTP block at ``depth`` logical depths sharing the first MTP layer (DeepSeek-V3 §2.2).

        Depth ``k``: ``E_k`` = ``embed_tokens(ids rolled by -k)`` (tails: token 0) or, when ``inputs_embeds`` are
        given (VL: never re-embedded), the embeddings rolled by ``-k`` (tails: zeros), rolls per document
        (:func:`.mtp.doc_roll`); ``h_in`` = ``h_pre`` (mean-collapsed, before the final norm) for ``k = 1``, else
        depth ``k-1``'s block output before ``shared_head.norm`` (the sources do not say which; DeepSeek-V3 feeds
        the un-normalised state, as for ``k = 1``).

        Args:
            h_pre: ``[B,S,D]``; layout: the forward's :class:`DocumentLayout`; depth: D >= 1; exactly one of
                ``input_ids`` ``[B,S]`` / ``inputs_embeds`` ``[B,S,D]``.

        Returns:
            D tensors ``[B,S,D]``, normalised by ``shared_head.norm`` (feed to ``lm_head``).

        Raises:
            ValueError: no MTP layer, ``depth < 1``, or not exactly one of ``input_ids`` / ``inputs_embeds``.
        """
        n = self.config.num_hidden_layers
        if self.config.num_nextn_predict_layers == 0 or depth < 1:
            raise ValueError(
                f"mtp_forward needs an MTP layer and depth >= 1; got num_nextn_predict_layers="
                f"{self.config.num_nextn_predict_layers}, depth={depth}"
            )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("mtp_forward needs exactly one of input_ids or inputs_embeds")
        layer = self.layers[n]
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
    """``MoeCausalLMOutputWithPast`` plus ``mtp_loss`` (unweighted mean over depths; ``loss`` holds
    ``main + mtp_loss_weight * mtp_loss``) and ``mtp_logits`` (one ``[B,S,V]`` per depth) when MTP ran, and (VL
    model) the vision tower's ``image_outputs`` / ``video_outputs`` (``BaseModelOutputWithPooling``, as
    transformers' ``Glm5NextForConditionalGeneration``) when it ran; with ``output_mtp_inputs=True`` the text
    model's ``pre_norm_hidden_state`` and ``mtp_inputs_embeds`` (``[B,S,D]``, for MTP drafting)."""

    mtp_loss: torch.FloatTensor | None = None
    mtp_logits: tuple[torch.FloatTensor, ...] | None = None
    image_outputs: object | None = None
    video_outputs: object | None = None
    pre_norm_hidden_state: torch.FloatTensor | None = None
    mtp_inputs_embeds: torch.FloatTensor | None = None


def _mtp_depth_for(head_model, labels, kwargs) -> int:
    """Number of MTP depths the head asks the model for (0: none). Pops the ``mtp`` forward kwarg.

    MTP runs when labels are given, the model has an MTP layer (``num_nextn_predict_layers > 0``), no cache is
    used, and ``mtp`` (forward kwarg: ``True`` / ``False`` / ``None``) is ``True`` or, when ``None``, the config's
    ``mtp_loss_weight > 0``. Depths: ``config.mtp_depth``.
    """
    requested = kwargs.pop("mtp", None)
    config = head_model.config.get_text_config(decoder=True)
    cached = kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None or kwargs.get("use_cache")
    on = requested if requested is not None else config.mtp_loss_weight > 0
    if not on or labels is None or config.num_nextn_predict_layers == 0 or cached:
        return 0
    return config.mtp_depth


def _check_head_inputs(head_model, input_ids, inputs_embeds, labels, logits_to_keep, kwargs) -> None:
    """The heads' checks, before the forward: ``labels`` / ``shift_labels`` (not on the meta device, integer, the
    inputs' ``[B, S]`` shape, entries ``ignore_index`` or ids in ``[0, vocab_size)``;
    :func:`.input_checks.check_labels`), ``num_items_in_batch`` and ``logits_to_keep``
    (:func:`.input_checks.check_loss_arguments`)."""
    check_not_meta({"labels": labels, "shift_labels": kwargs.get("shift_labels")}, head_model)
    check_loss_arguments(kwargs.get("num_items_in_batch"), logits_to_keep)
    source = input_ids if input_ids is not None else inputs_embeds
    if source is None or source.dim() < 2:
        return  # the model raises, naming the inputs
    ignore = kwargs.get("ignore_index", -100)
    for name in ("labels", "shift_labels"):
        value = labels if name == "labels" else kwargs.get(name)
        check_labels(value, tuple(source.shape[:2]), head_model.vocab_size, ignore, name=name)


def _lm_head_and_loss(head_model, outputs, labels, logits_to_keep, kwargs) -> Glm53FlashCausalLMOutputWithPast:
    """Logits of the kept positions and transformers' ``ForCausalLMLoss`` (shifted; summed and divided by
    ``num_items_in_batch`` when the Trainer passes it, else by the number of supervised tokens, at least 1) —
    shared by the text-only and the VL heads.

    Labels that are all ``ignore_index`` give ``loss`` 0.0 (zero gradients, a warning in eager calls) and
    ``mtp_loss`` 0.0 — one convention for both, where torch's mean over zero elements would give NaN.

    When the model output carries ``mtp_hidden_states`` (see :func:`_mtp_depth_for`), adds
    ``mtp_loss_weight * mtp_loss`` (:func:`.mtp.mtp_loss`, same ``num_items_in_batch`` / ``ignore_index``;
    ``shift_labels`` when given replace ``labels`` as the source of the MTP targets)."""
    hidden_states = outputs.last_hidden_state
    if isinstance(logits_to_keep, int):
        hidden_states = hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
    else:
        hidden_states = hidden_states[:, logits_to_keep, :]
    logits = head_model.lm_head(hidden_states)
    loss = None
    if labels is not None:
        loss_kwargs = {k: kwargs[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in kwargs}
        counted = loss_kwargs.get("num_items_in_batch") is not None
        # the MTP targets' source: the caller's shift_labels, else the labels (rolled per document by depth + 1);
        # never the sequence-parallel shift below, a row-wise shift that would let a document's first label become
        # an MTP target of the previous document
        given_shift = loss_kwargs.get("shift_labels")
        sp = getattr(getattr(outputs, "document_layout", None), "sequence_parallel", None)
        if sp is not None:
            loss_kwargs = sp_loss_kwargs(sp, labels, loss_kwargs)
        main_kwargs = dict(loss_kwargs)
        if main_kwargs.get("num_items_in_batch") is None:
            # mean over the supervised tokens as sum / count (bit-identical to the mean), with count >= 1: a batch
            # whose labels are all ignored gets loss 0.0 and zero gradients, not NaN (the MTP loss's convention)
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
        # without a given count, each depth's mean (under SP: over the group's targets of that depth)
        per_depth_mean = sp is not None and not counted
        mtp_value, mtp_logits = mtp_loss(
            head_model.lm_head,
            mtp_hidden,
            given_shift if given_shift is not None else labels,
            outputs.document_layout,
            num_items_in_batch=None if per_depth_mean else loss_kwargs.get("num_items_in_batch"),
            ignore_index=loss_kwargs.get("ignore_index", -100),
            shifted=given_shift is not None,
            count_total=sp.global_count if per_depth_mean else None,
        )
        loss = loss + head_model.config.get_text_config(decoder=True).mtp_loss_weight * mtp_value
    router_logits = getattr(outputs, "router_logits", None)
    aux_loss = None
    if router_logits:
        aux_loss = router_load_balancing_loss(head_model.config.get_text_config(decoder=True), router_logits,
                                              outputs.document_layout)
        if loss is not None:
            loss = loss + head_model.config.get_text_config(decoder=True).router_aux_loss_coef * aux_loss
    return Glm53FlashCausalLMOutputWithPast(
        loss=loss, logits=logits, hidden_states=outputs.hidden_states, cache=getattr(outputs, "cache", None),
        attentions=getattr(outputs, "attentions", None),
        mtp_loss=mtp_value, mtp_logits=mtp_logits, aux_loss=aux_loss, router_logits=router_logits,
        image_outputs=getattr(outputs, "image_outputs", None), video_outputs=getattr(outputs, "video_outputs", None),
        pre_norm_hidden_state=outputs.pre_norm_hidden_state if kwargs.get("output_mtp_inputs") else None,
        mtp_inputs_embeds=outputs.mtp_inputs_embeds if kwargs.get("output_mtp_inputs") else None,
    )


def router_load_balancing_loss(config, router_logits: tuple[torch.Tensor, ...], layout: DocumentLayout):
    """Optional router load-balancing loss (Switch Transformer eqs. 4-6), as transformers' ``glm5_next`` computes it.

    Turned on by ``output_router_logits=True`` (forward kwarg or config); ``loss`` then gains
    ``config.router_aux_loss_coef * aux_loss`` when labels are given, and the output carries ``aux_loss`` and
    ``router_logits`` (one fp32 ``[B*S, E]`` tensor per MoE layer of the main stack; the MTP layer's router is not
    included, as in transformers, which has no MTP layer). Computed by transformers' own
    ``load_balancing_loss_func`` (softmax over the router logits, top-``num_experts_per_tok`` counts), with padding
    tokens (``layout.valid`` False) excluded — transformers excludes them through the 2-D ``attention_mask``; for
    packed rows ours also excludes padding marked by ``cu_seq_lens_q`` / ``position_ids``.

    Args:
        config: the text config (``n_routed_experts``, ``num_experts_per_tok``).
        router_logits: per-layer ``[B*S, E]`` tensors. layout: the forward's :class:`DocumentLayout`.

    Returns:
        0-dim fp32 tensor (differentiable with respect to the router weights).
    """
    from transformers.models.glm5_next.modeling_glm5_next import load_balancing_loss_func

    mask = None if layout is None or layout.trivial else layout.valid.to(torch.long)
    return load_balancing_loss_func(
        tuple(router_logits), config.n_routed_experts, config.num_experts_per_tok, mask
    )


class _Glm53FlashGenerationHooks:
    """``GenerationMixin`` hooks shared by the text-only and the VL heads.

    * ``_is_stateful = False``: assisted decoding (``generate(use_mtp=True)``, or an assistant model) can roll the
      cache back: :meth:`_prepare_cache_for_generation` gives it croppable KDA and indexer layers
      (:func:`.generation_cache.make_croppable`). A cache that cannot crop (a ``StaticCache``, a filled user cache)
      still fails transformers' own ``is_croppable`` check after the prefill.
    * ``_get_candidate_generator``: ``use_mtp=True`` drafts with our MTP layer
      (:class:`.mtp_generation.Glm53FlashMTPCandidateGenerator`) instead of transformers' generic ``MtpModel``.
    * ``create_masks_for_generate``: the layers read the plain 2-D padding mask ``[B, past + S]`` (the indexer and
      KDA need padding, not a 4-D causal mask), so a static cache gets the 2-D mask unchanged.
    """

    _is_stateful = False
    mtp_stats: dict | None = None  # the last generate(use_mtp=True): drafted, accepted, acceptance_rate, mtp_calls

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        """transformers' cache preparation; for assisted generation, and when this model is another's assistant
        (``generation_config.is_assistant``), the fresh ``DynamicCache`` then gets croppable KDA / indexer layers
        (:func:`.generation_cache.make_croppable`)."""
        from transformers.generation.configuration_utils import GenerationMode

        from .generation_cache import make_croppable

        out = super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)
        # generation_config.is_assistant: this model drafts for another, and transformers crops its cache
        assisted = generation_mode == GenerationMode.ASSISTED_GENERATION or generation_config.is_assistant
        if assisted and model_kwargs.get("cache") is not None:
            make_croppable(model_kwargs["cache"])
        return out

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 *args, **kwargs):
        """``use_mtp=True`` (without ``assistant_early_exit`` / ``prompt_lookup_num_tokens``, which transformers
        checks first): :class:`.mtp_generation.Glm53FlashMTPCandidateGenerator`; otherwise transformers' choice.

        Raises:
            ValueError: ``use_mtp=True`` on a model without an MTP layer (``num_nextn_predict_layers=0``).
        """
        if (
            generation_config.use_mtp
            and generation_config.assistant_early_exit is None
            and generation_config.prompt_lookup_num_tokens is None
        ):
            from .mtp_generation import Glm53FlashMTPCandidateGenerator

            return Glm53FlashMTPCandidateGenerator(self, generation_config, model_kwargs, logits_processor)
        return super()._get_candidate_generator(
            generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, *args, **kwargs
        )

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """``GenerationMixin.generate``, after checking the inputs it cannot serve: no input on the meta device
        (:func:`.input_checks.check_not_meta`); a 2-D ``attention_mask`` must be left padding with a real token in
        every row; a ``cache`` / ``past_key_values`` that already holds tokens is continued (transformers' convention:
        ``input_ids`` is the whole sequence, or the new tokens with a mask over the whole sequence), so the inputs
        must reach beyond it; a cache of fixed size (``StaticCache``) must hold the prompt plus every new token.

        Raises:
            ValueError: ``inputs`` / ``input_ids`` / ``inputs_embeds`` / ``attention_mask`` / ``pixel_values`` /
                ``pixel_values_videos`` on the meta device while the weights hold data (names the argument); an
                ``attention_mask`` row that is all zeros or has a 0 after a 1 (the row is named;
                :func:`.generation_cache.check_left_padding`); a cache built for another layer count or layer kinds
                (:func:`.generation_cache.check_cache_layers`); a filled cache no shorter than the inputs (both
                lengths named; :func:`.generation_cache.check_cache_continuation`); ``max_cache_len`` below the
                prompt length plus ``max_new_tokens`` (or below ``max_length`` when no ``max_new_tokens`` is set); the
                message names both numbers.
            NotImplementedError: a cache that is not a transformers ``Cache``.
        """
        names = ("input_ids", "inputs_embeds", "attention_mask", "pixel_values", "pixel_values_videos")
        check_not_meta({"inputs": inputs, **{name: kwargs.get(name) for name in names}}, self)
        cache = kwargs.get("cache") if kwargs.get("cache") is not None else kwargs.get("past_key_values")
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if prompt is None:
            prompt = kwargs.get("inputs_embeds")
        prompt_len = prompt.shape[1] if isinstance(prompt, torch.Tensor) and prompt.dim() >= 2 else 0
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not torch.compiler.is_compiling():
            check_left_padding(mask.bool())
        if cache is not None:
            check_cache(cache, "generate")
            check_cache_layers(cache, self.config.get_text_config(decoder=True), "generate")
        if cache is not None and prompt_len:
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


class Glm53FlashForCausalLM(_Glm53FlashGenerationHooks, Glm53FlashPreTrainedModel, GenerationMixin):
    """Text-only GLM-5.3-Flash causal LM (``lm_head`` untied).

    Takes the top-level :class:`Glm53FlashConfig` (its ``text_config`` builds the model) or a
    :class:`Glm53FlashTextConfig`. Loads the published layout (``model.language_model.*``, per-expert weights,
    split conv, ``hc_*``); vision tensors in a multimodal checkpoint are skipped with one info line.

    ``forward(..., labels=None, num_items_in_batch=None, logits_to_keep=0)`` returns
    :class:`Glm53FlashCausalLMOutputWithPast`; ``loss`` is transformers' ``ForCausalLMLoss`` (shifted, fp32,
    summed and divided by ``num_items_in_batch`` when given, so Trainer's gradient accumulation is exact, else the
    mean over the supervised tokens). Labels that are all ``ignore_index`` (-100) give ``loss == 0.0`` and
    ``mtp_loss == 0.0`` with zero gradients, never NaN (a warning says so in eager calls).

    Raises:
        ValueError: ``labels`` / ``shift_labels`` on the meta device, not integer, not of the inputs' ``[B, S]``
            shape, or (eagerly) holding entries other than ``ignore_index`` and ids in ``[0, vocab_size)``;
            ``num_items_in_batch`` 0 or negative, ``logits_to_keep`` negative
            (:func:`.input_checks.check_loss_arguments`); and the text model's input errors
            (:class:`Glm53FlashTextModel`).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    accepts_loss_kwargs = True
    _keys_to_ignore_on_load_unexpected = list(VISION_KEY_PATTERNS)
    _skips_vision_tower = True

    def __init__(self, config):
        super().__init__(config)
        text_config = config.get_text_config(decoder=True)
        self.model = Glm53FlashTextModel._from_config(text_config)
        self.vocab_size = text_config.vocab_size
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        self.post_init()

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
        _check_head_inputs(self, input_ids, inputs_embeds, labels, logits_to_keep, kwargs)
        kwargs["use_cache"] = use_cache
        mtp_depth = _mtp_depth_for(self, labels, kwargs)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            mtp_depth=mtp_depth,
            **kwargs,
        )
        return _lm_head_and_loss(self, outputs, labels, logits_to_keep, kwargs)


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
    """Image and video placeholder masks ``[B, S]`` (bool).

    After the processor's expansion images and videos both use ``<|image|>`` (``config.image_token_id``); a
    placeholder belongs to a video when it sits inside a ``<|begin_of_video|> … <|end_of_video|>`` span
    (as transformers' ``Glm5NextModel.get_placeholder_mask``). ``mm_token_type_ids`` (1 image, 2 video, 0 text),
    when given, is the authoritative signal and is used as is. Without ``input_ids`` the tokens are recognised by
    comparing ``inputs_embeds`` with the embeddings of the special tokens (as transformers does).
    """
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
    """GLM-5.3-Flash vision-language base model: transformers' glm5_next vision tower (reused as is) and our text
    model (``model.visual.*`` / ``model.language_model.*``, the published layout).

    ``forward(input_ids | inputs_embeds, attention_mask?, position_ids?, pixel_values?, image_grid_thw?,
    pixel_values_videos?, video_grid_thw?, mm_token_type_ids?, **packing_kwargs)``: the vision features replace the
    placeholder embeddings in order (images, then videos, each in reading order over the flattened batch), then
    the text model runs with the document layout of the batch.

    Raises:
        ValueError: when the number of image (or video) placeholders differs from the number of feature rows (the
            message names both counts); ``pixel_values`` / ``pixel_values_videos`` without their grid, of another
            width than ``in_channels * temporal_patch_size * patch_size**2``, or (eagerly) whose grid rows are not
            positive multiples of the merge size or do not add up to the pixel rows
            (:func:`.input_checks.check_vision_inputs`); an input (ids, embeddings, pixels, grids, masks) on the
            meta device while the weights hold data; and the text model's input errors.
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

    def _vision_tower(self, pixel_values: torch.Tensor, grid_thw: torch.LongTensor) -> torch.Tensor:
        """``visual(pixel_values, grid_thw).pooler_output``. Under ``torch.compile`` the tower runs as the custom op
        ``glm53flash::vision_tower`` (its attention splits the patches per image on the host)."""
        pixel_values = pixel_values.to(self.visual.dtype)
        if not in_graph():
            return self.visual(pixel_values, grid_thw=grid_thw).pooler_output
        return _VISION_OP(pixel_values, grid_thw, module_parameters(self.visual), self._vision_key)

    @staticmethod
    def _frames_grid(video_grid_thw: torch.LongTensor) -> torch.LongTensor:
        """``video_grid_thw`` rows ``[t, h, w]`` as ``t`` rows ``[1, h, w]``: each temporal slice (tubelet) of a video
        is its own attention sequence in the tower, as the reference."""
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
        """The vision tower's output for ``pixel_values`` ``[patches, C*T*P*P]`` and ``image_grid_thw`` ``[images, 3]``:
        transformers' ``BaseModelOutputWithPooling`` whose ``pooler_output`` is a tuple of one merged feature tensor
        ``[t*h*w / merge^2, text hidden]`` per image (``last_hidden_state``, ``hidden_states``, ``attentions`` of
        the tower as ``Glm5NextVisionModel`` returns them). Keyword arguments (``output_hidden_states``,
        ``output_attentions``, ``return_dict``) go to the tower. Same contract as
        ``Glm5NextModel.get_image_features``."""
        return self._tower_outputs(pixel_values, image_grid_thw, image_grid_thw, **kwargs)

    @accepts_precomputed_kwargs(modality="video")
    @can_return_tuple
    def get_video_features(
        self, pixel_values_videos: torch.Tensor, video_grid_thw: torch.LongTensor | None = None, **kwargs
    ) -> tuple | BaseModelOutputWithPooling:
        """As :meth:`get_image_features` for videos (``video_grid_thw`` ``[videos, 3]``): the tower sees each temporal
        slice as its own sequence; ``pooler_output`` holds one tensor per video. Same contract as
        ``Glm5NextModel.get_video_features``."""
        return self._tower_outputs(pixel_values_videos, self._frames_grid(video_grid_thw), video_grid_thw, **kwargs)

    def _tower(self, features_fn, pixel_values, grid_thw, tower_grid_thw, tower_kwargs):
        """``(outputs, merged features [N, text hidden])`` of the vision tower: eagerly ``features_fn``'s
        ``BaseModelOutputWithPooling`` (its per-item ``pooler_output`` concatenated for splicing); under
        ``torch.compile`` the custom op's merged features, wrapped as ``BaseModelOutputWithPooling(pooler_output=
        features)`` (one tensor: a traced graph cannot split by host sizes)."""
        if in_graph():
            features = self._vision_tower(pixel_values, tower_grid_thw)
            return BaseModelOutputWithPooling(pooler_output=features), features
        outputs = features_fn(pixel_values, grid_thw, return_dict=True, **tower_kwargs)
        return outputs, torch.cat(outputs.pooler_output, dim=0)

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
        if pixel_values is not None:
            check_vision_inputs(pixel_values, image_grid_thw, self.config.vision_config, "pixel_values",
                                "image_grid_thw")
        if pixel_values_videos is not None:
            check_vision_inputs(pixel_values_videos, video_grid_thw, self.config.vision_config, "pixel_values_videos",
                                "video_grid_thw")
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        image_outputs = video_outputs = None
        if pixel_values is not None or pixel_values_videos is not None:
            image_mask, video_mask = placeholder_masks(
                input_ids, mm_token_type_ids, self.config, inputs_embeds, self.get_input_embeddings()
            )
            tower_kwargs = {k: kwargs[k] for k in ("output_hidden_states", "output_attentions") if k in kwargs}
            if output_hidden_states is not None:
                tower_kwargs["output_hidden_states"] = output_hidden_states
            if pixel_values is not None:
                if image_grid_thw is None:
                    raise ValueError("pixel_values needs image_grid_thw")
                image_outputs, image_features = self._tower(
                    self.get_image_features, pixel_values, image_grid_thw, image_grid_thw, tower_kwargs
                )
                inputs_embeds = self._splice(inputs_embeds, image_mask, image_features, "image")
            if pixel_values_videos is not None:
                if video_grid_thw is None:
                    raise ValueError("pixel_values_videos needs video_grid_thw")
                video_outputs, video_features = self._tower(
                    self.get_video_features, pixel_values_videos, video_grid_thw,
                    self._frames_grid(video_grid_thw), tower_kwargs,
                )  # fmt: skip
                inputs_embeds = self._splice(inputs_embeds, video_mask, video_features, "video")
        uncached = kwargs.get("past_key_values") is None and kwargs.get("cache") is None
        if input_ids is not None and uncached and not in_graph():
            # A full (uncached) forward must get features for every placeholder it holds (checked eagerly).
            image_mask, video_mask = placeholder_masks(input_ids, mm_token_type_ids, self.config)
            for mask, given, what in ((image_mask, pixel_values, "pixel_values"), (video_mask, pixel_values_videos,
                                                                                    "pixel_values_videos")):
                if given is None and bool(mask.any()):
                    raise ValueError(
                        f"input_ids hold {int(mask.sum())} {'image' if what == 'pixel_values' else 'video'} "
                        f"placeholder tokens but no {what} were given"
                    )
        outputs = self.language_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            **kwargs,
        )
        return Glm53FlashModelOutputWithPast(
            last_hidden_state=outputs.last_hidden_state,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            pre_norm_hidden_state=outputs.pre_norm_hidden_state,
            mtp_hidden_states=outputs.mtp_hidden_states,
            document_layout=outputs.document_layout,
            mtp_inputs_embeds=outputs.mtp_inputs_embeds,
            router_logits=outputs.router_logits,
            image_outputs=image_outputs,
            video_outputs=video_outputs,
        )


class Glm53FlashForConditionalGeneration(_Glm53FlashGenerationHooks, Glm53FlashPreTrainedModel, GenerationMixin):
    """GLM-5.3-Flash image/video-text-to-text model (``AutoModelForImageTextToText``); keys as transformers'
    ``Glm5NextForConditionalGeneration`` (``model.visual.*``, ``model.language_model.*``, ``lm_head``).

    ``forward`` takes :class:`Glm53FlashModel`'s inputs plus ``labels`` / ``num_items_in_batch`` /
    ``logits_to_keep``, and returns :class:`Glm53FlashCausalLMOutputWithPast` (loss, its all-ignored convention
    and the label checks as :class:`Glm53FlashForCausalLM`).
    """

    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    accepts_loss_kwargs = True
    _no_split_modules = ["Glm53FlashDecoderLayer", "Glm53FlashMTPLayer", "Glm5NextVisionBlock"]

    def __init__(self, config: Glm53FlashConfig):
        super().__init__(config)
        self.model = Glm53FlashModel(config)
        text_config = config.get_text_config(decoder=True)
        self.vocab_size = text_config.vocab_size
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        self.post_init()

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
        _check_head_inputs(self, input_ids, inputs_embeds, labels, logits_to_keep, kwargs)
        kwargs["use_cache"] = use_cache
        kwargs["mtp_depth"] = _mtp_depth_for(self, labels, kwargs)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            mm_token_type_ids=mm_token_type_ids,
            output_hidden_states=output_hidden_states,
            **kwargs,
        )
        return _lm_head_and_loss(self, outputs, labels, logits_to_keep, kwargs)


# Make save_pretrained copy this module and its relative imports next to the weights (remote code).
Glm53FlashConfig.register_for_auto_class()
Glm53FlashForCausalLM.register_for_auto_class("AutoModelForCausalLM")
Glm53FlashModel.register_for_auto_class("AutoModel")
Glm53FlashForConditionalGeneration.register_for_auto_class("AutoModelForImageTextToText")

__all__ = [
    "Glm53FlashPreTrainedModel",
    "Glm53FlashTextModel",
    "Glm53FlashForCausalLM",
    "Glm53FlashModel",
    "Glm53FlashForConditionalGeneration",
    "Glm53FlashDecoderLayer",
    "Glm53FlashMTPLayer",
]
