"""Mixture-of-experts feed-forward of GLM-5.3-Flash: dense MLP, sigmoid top-k router, routed experts and the MoE
block (routed + shared expert), with the per-call entry point of the routed experts.

The maths (clamped SwiGLU, routing, the grouped-GEMM experts) lives in :mod:`glm53flash_hf.moe_ops`;
the routed experts run the torch op :func:`glm53flash_hf.moe_ops.experts_forward_torch` or its fused alternative
:func:`glm53flash_hf.moe_fused.experts_forward_fused`, chosen per call by :func:`glm53flash_hf.dispatch.op_for`
(family ``"moe"``).

Reference: transformers' ``transformers/models/glm5_next/modeling_glm5_next.py`` (``Glm5NextTextMLP``,
``Glm5NextTextExperts``, ``Glm5NextTextTopkRouter``, ``Glm5NextTextMoE``). Parameter names, shapes and dtypes equal
the reference, so state dicts are interchangeable: ``gate.weight`` fp32 ``[E, H]``, buffer
``gate.e_score_correction_bias`` fp32 ``[E]``, ``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first),
``experts.down_proj`` ``[E, H, I]``, ``shared_experts.{gate,up,down}_proj.weight``.

How the routed experts run
--------------------------
``Glm53FlashExperts`` is decorated with transformers' ``@use_experts_implementation`` *and* brings its own forward:

* The decorator makes the class a regular member of transformers' experts machinery: inside a ``PreTrainedModel``
  ``config._experts_implementation`` picks ``"grouped_mm"`` (transformers' default), ``"batched_mm"``,
  ``"deepgemm"``/``"sonicmoe"`` (hub kernels on GPU) or ``"eager"``; transformers' expert-parallel plan
  (``base_model_ep_plan``) and ``set_experts_implementation`` work unchanged. Every one of these implementations
  reads ``self.gate_up_proj`` / ``self.down_proj`` at call time and calls :meth:`Glm53FlashExperts._apply_gate`,
  so the clamped SwiGLU is honoured on every path, and PEFT's ``target_parameters`` parametrisation (which swaps
  ``self.gate_up_proj`` for ``W + scale * B @ A`` during the forward) is seen by all. transformers' ``grouped_mm``
  does not check that ``H`` and ``I`` are multiples of 16 bytes, which the torch kernel needs (it raises "strides
  should be multiple of 16 bytes"); :func:`glm53flash_hf.moe_ops.grouped_mm` falls back instead. ``batched_mm``
  gathers one ``[2I, H]`` weight per (token, expert) pair, so its memory grows with ``T * k * 2I * H``.
* ``set_experts_implementation`` / ``from_pretrained(experts_implementation=...)`` switch implementations
  (``Glm53FlashPreTrainedModel._can_set_experts_implementation`` answers yes). With nothing requested, our models use
  ``"eager"`` (``Glm53FlashPreTrainedModel.get_correct_experts_implementation``), i.e. the forward below, where
  transformers would default to its ``"grouped_mm"``.
* The undecorated forward (what transformers calls ``"eager"``, also used when ``_experts_implementation`` is
  ``None``, i.e. the module used standalone) is :func:`grouped_experts_forward` with the backend of
  ``config.kernels['moe']``.

``clamped_swiglu`` is re-exported from :mod:`glm53flash_hf.moe_ops`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init
from transformers.integrations import use_experts_implementation

from .dispatch import op_for, register_fused, requested_backend
from .moe_ops import clamped_swiglu, experts_forward_torch, topk_routing


class Glm53FlashMLP(nn.Module):
    """Dense SwiGLU MLP with clamping: ``down_proj(clamped_swiglu(gate_proj(x), up_proj(x)))``.

    Used for the dense layers (``intermediate_size``) and as the shared expert of the MoE block
    (``moe_intermediate_size * n_shared_experts``). No biases. Source: ``Glm5NextTextMLP``.

    Args:
        config: text config (``hidden_size``, ``intermediate_size``, ``swiglu_limit``, ``hidden_act``).
        intermediate_size: overrides ``config.intermediate_size``.

    Shapes: ``x [..., hidden_size]`` -> ``[..., hidden_size]`` in the weights' dtype.

    Raises:
        ValueError: ``hidden_act`` other than ``"silu"``, or a non-positive ``intermediate_size``.
    """

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu' (clamped SwiGLU); got hidden_act={config.hidden_act!r}")
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        if self.intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be positive; got intermediate_size={self.intermediate_size}")
        self.swiglu_limit = config.swiglu_limit
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class Glm53FlashTopkRouter(nn.Module):
    """Sigmoid top-k router with an aux-free correction bias and optional group-limited selection.

    The maths is :func:`glm53flash_hf.moe_ops.topk_routing` with the config's ``num_experts_per_tok``, ``n_group``,
    ``topk_group``, ``norm_topk_prob`` and ``routed_scaling_factor``. Source: ``Glm5NextTextTopkRouter``.

    Parameters: ``weight`` fp32 ``[E, hidden]``; persistent buffer ``e_score_correction_bias`` fp32 ``[E]``.

    Raises:
        ValueError: ``n_routed_experts`` not divisible by ``n_group``; fewer than 2 experts per group when
            ``n_group > 1``; ``topk_group`` outside ``[1, n_group]``; ``num_experts_per_tok`` larger than the
            eligible experts ``topk_group * E // n_group``; a hidden size that does not match.
    """

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.hidden_dim = config.hidden_size
        self.routed_scaling_factor = config.routed_scaling_factor
        self.num_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        if self.num_group < 1 or self.num_experts % self.num_group != 0:
            raise ValueError(
                f"n_routed_experts ({self.num_experts}) must be divisible by n_group; got n_group={self.num_group}"
            )
        if self.num_group > 1 and self.num_experts // self.num_group < 2:
            raise ValueError(f"n_group={self.num_group} leaves fewer than 2 experts per group (E={self.num_experts})")
        if not 1 <= self.topk_group <= self.num_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.num_group}]; got topk_group={self.topk_group}")
        eligible = self.topk_group * (self.num_experts // self.num_group)
        if not 1 <= self.top_k <= eligible:
            raise ValueError(
                f"num_experts_per_tok must be in [1, topk_group * n_routed_experts / n_group = {eligible}]; "
                f"got num_experts_per_tok={self.top_k}"
            )
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim, dtype=torch.float32))
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32), persistent=True
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            hidden_states: ``[T, hidden]`` or ``[B, S, hidden]``, any float dtype (routed in fp32).

        Returns:
            ``(router_logits fp32 [T, E], topk_weights fp32 [T, k], topk_indices int64 [T, k])`` with
            ``T = B * S`` for 3-D input.
        """
        if hidden_states.shape[-1] != self.hidden_dim:
            raise ValueError(
                f"router input last dim must be hidden_size={self.hidden_dim}; got shape {tuple(hidden_states.shape)}"
            )
        return topk_routing(
            hidden_states,
            self.weight,
            self.e_score_correction_bias,
            top_k=self.top_k,
            n_group=self.num_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )


def _experts_forward_fused():
    from .moe_fused import experts_forward_fused

    return experts_forward_fused


register_fused("moe", experts_forward_torch, _experts_forward_fused)


def grouped_experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float | None,
    *,
    drop_out_of_range: bool = False,
    backend: str = "torch",
) -> torch.Tensor:
    """Routed experts: ``y_t = sum_j w_tj * down_e(clamped_swiglu(gate_up_e(x_t)))``, ``e = idx_tj``.

    The maths is :func:`glm53flash_hf.moe_ops.experts_forward_torch`'s; ``backend`` (``"torch"``, ``"auto"`` or
    ``"fused"``) picks the torch path or :func:`glm53flash_hf.moe_fused.experts_forward_fused` for this call.

    Args:
        hidden_states: ``[T, H]`` tokens (cast to the weights' dtype for the GEMMs).
        top_k_index: ``[T, k]`` integer expert ids in ``[0, E)``, distinct per token (ids ``>= E`` only with
            ``drop_out_of_range=True``: expert-parallel sentinels, they contribute zero).
        top_k_weights: ``[T, k]`` routing weights (fp32 from the router).
        gate_up_proj: ``[E, 2I, H]``, gate rows first. down_proj: ``[E, H, I]``.
        swiglu_limit: clamp of :func:`glm53flash_hf.moe_ops.clamped_swiglu` (``None``: plain SwiGLU).
        drop_out_of_range: treat ids ``>= E`` as "not on this rank".
        backend: see :func:`glm53flash_hf.dispatch.choose_backend`.

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``; each token's k contributions summed in fp32 and rounded once.

    Raises:
        ValueError: unknown backend; shapes that do not fit together.
    """
    op = op_for(experts_forward_torch, backend, hidden_states, gate_up_proj, down_proj, top_k_weights)
    return op(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, swiglu_limit,
              drop_out_of_range=drop_out_of_range)


@use_experts_implementation
class Glm53FlashExperts(nn.Module):
    """Routed experts stored as 3-D tensors in transformers' layout ``[E, out, in]``.

    Parameters: ``gate_up_proj [E, 2I, H]`` (gate rows ``[:I]``, up rows ``[I:]``), ``down_proj [E, H, I]``,
    in the model dtype; ``E = n_routed_experts``, ``I = moe_intermediate_size``, ``H = hidden_size``.
    Decorated with transformers' ``@use_experts_implementation`` (see the module docstring): the forward used is
    picked by ``config._experts_implementation``; ``"eager"``/``None`` run :func:`grouped_experts_forward` with
    the backend of ``config.kernels['moe']``.

    Forward: ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` in ``hidden.dtype``.
    PEFT: ``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])`` works (the
    weights are read as attributes at call time; ``is_transposed`` is ``False``).
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
        gate_up, down = self.gate_up_proj, self.down_proj
        op = op_for(experts_forward_torch, requested_backend(self.config, "moe"), hidden_states, gate_up, down,
                    top_k_weights)
        return op(hidden_states, top_k_index, top_k_weights, gate_up, down, self.swiglu_limit,
                  drop_out_of_range=getattr(self, "_is_expert_parallel", False))

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[S, 2I]`` gate/up projection -> ``[S, I]`` clamped SwiGLU (called by transformers' implementations)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return clamped_swiglu(gate, up, self.swiglu_limit)


class Glm53FlashMoE(nn.Module):
    """MoE block: routed experts (weighted by the router) plus the shared expert, added unscaled.

    Submodules: ``gate`` (:class:`Glm53FlashTopkRouter`), ``experts`` (:class:`Glm53FlashExperts`),
    ``shared_experts`` (:class:`Glm53FlashMLP` of width ``moe_intermediate_size * n_shared_experts``).
    Source: ``Glm5NextTextMoE``.

    Forward: ``h [B, S, H]`` (any leading shape) -> same shape and dtype; with ``return_router_logits=True``
    returns ``(out, router_logits fp32 [B*S, E])`` for a load-balancing loss. Nothing is stored on the module.

    Expert parallelism: ``expert_parallel`` is ``None`` (every expert on this rank). Training code sets it
    (:func:`glm53flash_hf.train.expert_parallel.apply_expert_parallel`) to a callable
    ``(experts, hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` that dispatches the tokens to
    the ranks holding their experts, runs ``experts`` (this rank's slice, possibly wrapped by PEFT) on the rows it
    receives and combines the results; the router, the shared expert and the rest of the block are unchanged.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.experts = Glm53FlashExperts(config)
        self.gate = Glm53FlashTopkRouter(config)
        self.shared_experts = Glm53FlashMLP(
            config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
        )
        self.expert_parallel = None

    def forward(self, hidden_states: torch.Tensor, return_router_logits: bool = False):
        shape = hidden_states.shape
        router_logits, topk_weights, topk_indices = self.gate(hidden_states)
        tokens = hidden_states.reshape(-1, shape[-1])
        if self.expert_parallel is None:
            routed = self.experts(tokens, topk_indices, topk_weights).view(shape)
        else:
            routed = self.expert_parallel(self.experts, tokens, topk_indices, topk_weights).view(shape)
        out = routed + self.shared_experts(hidden_states)
        if return_router_logits:
            return out, router_logits
        return out


def init_moe_weights(module: nn.Module, config) -> None:
    """Initialise MoE parameters as transformers' ``Glm5NextPreTrainedModel._init_weights`` does.

    ``Glm53FlashExperts``: ``gate_up_proj`` and ``down_proj`` ~ ``N(0, initializer_range)``.
    ``Glm53FlashTopkRouter``: ``weight`` ~ ``N(0, initializer_range)``, ``e_score_correction_bias`` = 0.
    Other modules are left alone (the dense/shared ``nn.Linear`` layers are handled by ``PreTrainedModel``'s
    generic ``_init_weights``). Uses ``transformers.initialization`` so already-loaded tensors are skipped.
    """
    std = config.initializer_range
    if isinstance(module, Glm53FlashExperts):
        init.normal_(module.gate_up_proj, mean=0.0, std=std)
        init.normal_(module.down_proj, mean=0.0, std=std)
    elif isinstance(module, Glm53FlashTopkRouter):
        init.normal_(module.weight, mean=0.0, std=std)
        init.zeros_(module.e_score_correction_bias)


__all__ = [
    "Glm53FlashExperts",
    "Glm53FlashMLP",
    "Glm53FlashMoE",
    "Glm53FlashTopkRouter",
    "clamped_swiglu",
    "grouped_experts_forward",
    "init_moe_weights",
]
