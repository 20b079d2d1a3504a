"""Mixture-of-experts feed-forward of GLM-5.3-Flash: clamped SwiGLU, dense MLP, sigmoid top-k router, routed
experts as grouped GEMMs, and the MoE block (routed + shared expert).

Source: ``shared/reference/model-spec.md`` §8 and §13 items 14-15; reference implementation transformers
``models/glm5_next/modeling_glm5_next.py`` (``Glm5NextTextMLP``, ``Glm5NextTextExperts``,
``Glm5NextTextTopkRouter``, ``Glm5NextTextMoE``). Parameter names, shapes and dtypes equal the reference so state
dicts are interchangeable: ``gate.weight`` fp32 ``[E, H]``, buffer ``gate.e_score_correction_bias`` fp32 ``[E]``,
``experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first), ``experts.down_proj`` ``[E, H, I]``,
``shared_experts.{gate,up,down}_proj.weight``.

How the routed experts run (the choice, and why)
-------------------------------------------------
``Glm53FlashExperts`` is decorated with transformers' ``@use_experts_implementation`` *and* brings its own
grouped-GEMM forward:

* The decorator makes the class a regular member of transformers' experts machinery: inside a ``PreTrainedModel``
  ``config._experts_implementation`` picks ``"grouped_mm"`` (transformers' default), ``"batched_mm"``,
  ``"deepgemm"``/``"sonicmoe"`` (hub kernels on GPU) or ``"eager"``; transformers' expert-parallel plan
  (``base_model_ep_plan``) and ``set_experts_implementation`` work unchanged. Every one of these implementations
  reads ``self.gate_up_proj`` / ``self.down_proj`` at call time and calls our :meth:`Glm53FlashExperts._apply_gate`,
  so the clamped SwiGLU (model-spec §13 item 14) is honoured on every path, and PEFT's ``target_parameters``
  parametrisation (which swaps ``self.gate_up_proj`` for ``W + scale * B @ A`` during the forward) is seen by all.
  In torch 2.13 transformers' ``grouped_mm`` uses ``torch.nn.functional.grouped_mm`` on CPU and CUDA SM80+; it is
  differentiable w.r.t. the tokens and the 3-D weights, measured as fast as ours on CPU (GEMMs are 86% of the
  time; CPU ``grouped_mm`` is a native per-group ``mm`` loop) and bit-equal to ours in bf16. It does not check
  that ``H`` and ``I`` are multiples of 16 bytes, which the torch kernel needs (``moe_intermediate_size=6`` fp32
  raises "strides should be multiple of 16 bytes"); ours falls back instead. ``batched_mm`` gathers one
  ``[2I, H]`` weight per (token, expert) pair: fine for decoding, far too much memory for training (64 GiB at
  T=4096, k=4, H=1024, I=512 in our measurement).
  Caveat for the lead: ``PreTrainedModel`` enables ``grouped_mm`` only if the *model's* module source
  (``modeling_glm53flash.py``) contains the literal ``@use_experts_implementation``; otherwise it falls back to
  ``"eager"``, which is the forward below.
* The undecorated forward (what transformers calls ``"eager"``, also used when ``_experts_implementation`` is
  ``None``, i.e. the module used standalone) is :func:`grouped_experts_forward`: sort the (token, expert) pairs by
  expert once, build the int32 group offsets once (``searchsorted``, static shapes, no host sync), one gather of
  the token rows, two ``grouped_mm`` calls (no Python loop over experts), the routing weight applied after the
  down projection as in the reference, and an fp32 ``index_add_`` back to tokens, rounded once to the activation
  dtype. Because the pairs are sorted by expert id, each token accumulates its experts in increasing expert order
  from zero, the same order as the reference eager loop, so fp32 results agree with it to GEMM rounding. On CUDA
  tensors ``backend="auto"``/``"fused"`` runs :func:`glm53flash_hf.triton_moe.fused_experts_forward` (same routing
  metadata and grouped GEMMs, Triton kernels for the clamped SwiGLU and the weighted combine).

Either path is exact w.r.t. the reference maths; the tests compare both with transformers' eager loop and with a
float64 loop-over-experts reference (outputs and gradients of tokens, routing weights and both 3-D weights; fp32
relative errors <= 3e-7). In bf16 both add a token's k contributions in fp32 and round once, where the reference
eager loop rounds every contribution to bf16 first (1-2 bf16 ulps apart).

Note for a fused path: the torch ``grouped_mm`` backward rejects a stride-0 (expanded) output gradient; here every
``grouped_mm`` output feeds an elementwise op, so its gradient is always materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.integrations import use_experts_implementation

from .dispatch import choose_backend, requested_backend

def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Clamped SwiGLU of GLM-5.3-Flash: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``.

    Not GPT-OSS's clipped form (no alpha, no ``+1``). Source: model-spec §8; ``Glm5NextTextMLP.forward``.

    Args:
        gate, up: tensors of the same shape ``[..., I]`` and dtype (any float dtype; computed in that dtype).
        limit: ``config.swiglu_limit`` (10.0 in the release); ``None`` disables both clamps (plain SwiGLU).

    Returns:
        ``[..., I]`` in the input dtype.
    """
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


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

    Maths (model-spec §8, §13 item 15; ``Glm5NextTextTopkRouter``), per token:
    ``logits = h_fp32 @ weight_fp32.T``; ``scores = sigmoid(logits)``; ``choice = scores + e_score_correction_bias``;
    if ``n_group > 1``: a group's score is the sum of its two largest ``choice`` values, only the ``topk_group`` best
    groups stay eligible (the others get ``-inf``); ``indices = topk(choice, k)``; ``weights = scores[indices]``
    (the un-biased scores), divided by ``their sum + 1e-20`` when ``norm_topk_prob``, times
    ``routed_scaling_factor``. The same torch ops as the reference are used (``topk(sorted=False)``), so indices
    come out in the same order and the weights are bitwise equal.

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
        h = hidden_states.reshape(-1, self.hidden_dim).to(torch.float32)
        router_logits = F.linear(h, self.weight.to(torch.float32))
        scores = router_logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.num_group > 1:
            grouped = choice.view(-1, self.num_group, self.num_experts // self.num_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)
        topk_indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        if self.norm_topk_prob:
            topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
        topk_weights = topk_weights * self.routed_scaling_factor
        return router_logits, topk_weights, topk_indices


def _grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's native grouped GEMM can run ``x @ w`` here (mirrors the limits documented in kernels.md §5)."""
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    # The kernels need 16-byte multiples for every non-unit stride (forward and backward operands), i.e. for the
    # inner sizes K and N (measured on CPU, torch 2.13); the release sizes (4096, 2048) always qualify.
    size = w.element_size()
    if (w.shape[-2] * size) % 16 or (w.shape[-1] * size) % 16:
        return False
    if torch.compiler.is_compiling() and w.dtype != torch.bfloat16:
        return False  # inductor lowers grouped_mm for bf16 only
    if w.device.type == "cuda":
        return torch.cuda.get_device_capability(w.device) >= (8, 0)
    if w.device.type == "cpu" and not hasattr(F, "grouped_mm"):
        # torch 2.9 CPU kernel: 16-byte aligned operands only.
        return x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
    return True


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[r] @ w[g(r)]`` for rows ``r`` of group ``g`` delimited by cumulative int32 ``offs`` [E].

    ``x [S, K]``, ``w [E, K, N]`` (any strides), same dtype; returns ``[S, N]``. Rows past ``offs[-1]`` are left
    unwritten. Uses ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on torch 2.9); where no native kernel
    applies (CUDA below SM80, compiled non-bf16, K or N not a multiple of 16 bytes, unaligned torch-2.9 CPU
    operands) it calls transformers' registered
    ``transformers::grouped_mm_fallback`` custom op (a per-expert loop with a hand-written backward).
    """
    if _grouped_mm_available(x, w):
        if hasattr(F, "grouped_mm"):
            return F.grouped_mm(x, w, offs=offs)
        return torch._grouped_mm(x, w, offs=offs)
    return torch.ops.transformers.grouped_mm_fallback(x, w.contiguous(), offs=offs)


# Decode-sized batches on CPU: a few (token, expert) pairs. The sort / searchsorted / grouped-GEMM machinery costs
# more than the GEMMs; instead each used expert's rows go through plain ``F.linear`` on that expert's weight slice
# (no weight copy), in the same expert-sorted row order, with the same SwiGLU, weighting and fp32 index_add.
_SMALL_PAIRS = 8


def _small_experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, swiglu_limit,
                           drop_out_of_range):
    num_tokens, hidden = hidden_states.shape
    num_experts = gate_up_proj.shape[0]
    k = top_k_index.shape[1]
    ids = top_k_index.reshape(-1).tolist()  # CPU tensor: no device sync
    if any(e < 0 or e >= num_experts for e in ids):
        if not drop_out_of_range or any(e < 0 for e in ids):
            return None  # let the general path handle (or reject) it
    pairs = sorted((e, i) for i, e in enumerate(ids) if e < num_experts)  # (expert, flat pair index), as torch.sort
    if not pairs:
        return torch.zeros(num_tokens, hidden, device=hidden_states.device, dtype=hidden_states.dtype)
    groups: list[tuple[int, list[int]]] = []
    for e, i in pairs:
        if groups and groups[-1][0] == e:
            groups[-1][1].append(i)
        else:
            groups.append((e, [i]))
    x = hidden_states.to(gate_up_proj.dtype)
    order = [i for _, rows in groups for i in rows]
    tokens = [i // k for i in order]
    gate_up = []
    for e, rows in groups:
        xe = x[rows[0] // k].unsqueeze(0) if len(rows) == 1 else x[[i // k for i in rows]]
        gate_up.append(F.linear(xe, gate_up_proj[e]))
    gate_up = gate_up[0] if len(gate_up) == 1 else torch.cat(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    act = clamped_swiglu(gate, up, swiglu_limit)
    out_rows, start = [], 0
    for e, rows in groups:
        out_rows.append(F.linear(act[start:start + len(rows)], down_proj[e]))
        start += len(rows)
    out_rows = out_rows[0] if len(out_rows) == 1 else torch.cat(out_rows)
    order_t = torch.tensor(order, device=hidden_states.device)
    out_rows = out_rows * top_k_weights.reshape(-1).index_select(0, order_t).unsqueeze(-1)
    out = torch.zeros(num_tokens, hidden, device=hidden_states.device, dtype=out_rows.dtype)
    out.index_add_(0, torch.tensor(tokens, device=hidden_states.device), out_rows)
    return out.to(hidden_states.dtype)


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
    """Routed experts as grouped GEMMs: ``y_t = sum_k w_tk * down_e(clamped_swiglu(gate_up_e(x_t)))``, ``e = idx_tk``.

    Source: model-spec §8 (experts); ``Glm5NextTextExperts`` (eager loop) for the maths, rounding order included
    (the routing weight multiplies the down-projection output). Sort-once grouped implementation, see the module
    docstring.

    Args:
        hidden_states: ``[T, H]`` tokens (cast to the weights' dtype for the GEMMs).
        top_k_index: ``[T, k]`` integer expert ids in ``[0, E)``; each token's ids must be distinct (as top-k
            gives). Ids ``>= E`` are expert-parallel sentinels, allowed only with ``drop_out_of_range=True``.
        top_k_weights: ``[T, k]`` routing weights (fp32 from the router).
        gate_up_proj: ``[E, 2I, H]``, gate rows first. down_proj: ``[E, H, I]``.
        swiglu_limit: clamp of :func:`clamped_swiglu`.
        drop_out_of_range: treat ids ``>= E`` as "not on this rank" (contribute zero, no GEMM work).
        backend: ``"torch"``, ``"auto"`` or ``"fused"`` (:func:`glm53flash_hf.dispatch.choose_backend`; the fused
            path is :func:`glm53flash_hf.triton_moe.fused_experts_forward`: Triton clamped SwiGLU and weighted
            combine around the same grouped GEMMs, CUDA only).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``; the per-token sum over its k experts is accumulated in fp32 (or the
        promoted dtype of activations and weights) and rounded once.

    Raises:
        ValueError: unknown backend; shapes that do not fit together.
    """
    path = choose_backend("moe", backend, hidden_states, gate_up_proj, down_proj, top_k_weights)  # validates
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H]; got shape {tuple(hidden_states.shape)}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.dim() != 2:
        raise ValueError(
            f"top_k_index and top_k_weights must both be [T, k]; got {tuple(top_k_index.shape)} and "
            f"{tuple(top_k_weights.shape)}"
        )
    num_tokens, hidden = hidden_states.shape
    num_experts = gate_up_proj.shape[0]
    if top_k_index.shape[0] != num_tokens:
        raise ValueError(f"top_k_index has {top_k_index.shape[0]} rows but hidden_states has {num_tokens} tokens")
    if gate_up_proj.shape[-1] != hidden or down_proj.shape[:2] != (num_experts, hidden):
        raise ValueError(
            f"expert weights do not fit hidden size {hidden}: gate_up_proj {tuple(gate_up_proj.shape)}, "
            f"down_proj {tuple(down_proj.shape)}"
        )
    if gate_up_proj.shape[1] != 2 * down_proj.shape[2]:
        raise ValueError(
            f"gate_up_proj rows ({gate_up_proj.shape[1]}) must be twice down_proj's intermediate size "
            f"({down_proj.shape[2]})"
        )
    if path == "fused":
        from .triton_moe import fused_experts_forward

        return fused_experts_forward(
            hidden_states=hidden_states,
            top_k_index=top_k_index,
            top_k_weights=top_k_weights,
            gate_up_proj=gate_up_proj,
            down_proj=down_proj,
            swiglu_limit=swiglu_limit,
            drop_out_of_range=drop_out_of_range,
        )
    k = top_k_index.shape[1]
    device = hidden_states.device
    if device.type == "cpu" and num_tokens * k <= _SMALL_PAIRS and not torch.compiler.is_compiling():
        small = _small_experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj,
                                       swiglu_limit, drop_out_of_range)
        if small is not None:
            return small

    # Routing metadata, built once: pairs sorted by expert, their token, group offsets.
    sorted_ids, order = torch.sort(top_k_index.reshape(-1))
    token_of_row = torch.div(order, k, rounding_mode="floor")
    expert_range = torch.arange(num_experts, device=device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, expert_range, right=True).to(torch.int32)
    row_weights = top_k_weights.reshape(-1).index_select(0, order)

    x = hidden_states.index_select(0, token_of_row).to(gate_up_proj.dtype)
    valid = None
    if drop_out_of_range:
        # Sentinel rows sit past offsets[-1]: grouped_mm leaves them unwritten (forward) and leaves their input
        # gradient unwritten (backward); zero both.
        valid = (sorted_ids < num_experts).unsqueeze(-1)
        x = x.masked_fill(~valid, 0.0)
    gate_up = _grouped_mm(x, gate_up_proj.transpose(-2, -1), offsets)  # [S, 2I]
    if valid is not None:
        gate_up = gate_up.masked_fill(~valid, 0.0)
    gate, up = gate_up.chunk(2, dim=-1)
    act = clamped_swiglu(gate, up, swiglu_limit)
    out_rows = _grouped_mm(act, down_proj.transpose(-2, -1), offsets)  # [S, H]
    if valid is not None:
        out_rows = out_rows.masked_fill(~valid, 0.0)
    out_rows = out_rows * row_weights.unsqueeze(-1)
    out = torch.zeros(num_tokens, hidden, device=device, dtype=out_rows.dtype)
    out.index_add_(0, token_of_row, out_rows)
    return out.to(hidden_states.dtype)


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
        return grouped_experts_forward(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.gate_up_proj,
            self.down_proj,
            self.swiglu_limit,
            drop_out_of_range=getattr(self, "_is_expert_parallel", False),
            backend=requested_backend(self.config, "moe"),
        )

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[S, 2I]`` gate/up projection -> ``[S, I]`` clamped SwiGLU (called by transformers' implementations)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return clamped_swiglu(gate, up, self.swiglu_limit)


class Glm53FlashMoE(nn.Module):
    """MoE block: routed experts (weighted by the router) plus the shared expert, added unscaled.

    Submodules: ``gate`` (:class:`Glm53FlashTopkRouter`), ``experts`` (:class:`Glm53FlashExperts`),
    ``shared_experts`` (:class:`Glm53FlashMLP` of width ``moe_intermediate_size * n_shared_experts``).
    Source: ``Glm5NextTextMoE``; model-spec §8.

    Forward: ``h [B, S, H]`` (any leading shape) -> same shape and dtype; with ``return_router_logits=True``
    returns ``(out, router_logits fp32 [B*S, E])`` for a load-balancing loss. Nothing is stored on the module.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.experts = Glm53FlashExperts(config)
        self.gate = Glm53FlashTopkRouter(config)
        self.shared_experts = Glm53FlashMLP(
            config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts
        )

    def forward(self, hidden_states: torch.Tensor, return_router_logits: bool = False):
        shape = hidden_states.shape
        router_logits, topk_weights, topk_indices = self.gate(hidden_states)
        routed = self.experts(hidden_states.reshape(-1, shape[-1]), topk_indices, topk_weights).view(shape)
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
