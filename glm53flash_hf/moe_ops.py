"""Torch maths of the MoE feed-forward (oracle of :mod:`.moe_fused`, path of CPU tensors): clamped SwiGLU, routing
and the routed experts as grouped GEMMs. Source: transformers ``models/glm5_next/modeling_glm5_next.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers.integrations.moe  # noqa: F401  registers torch.ops.transformers.grouped_mm_fallback

from .graph_ops import autocast_off, to_autocast_dtype

__all__ = ["check_experts_args", "clamped_swiglu", "experts_forward_torch", "grouped_mm", "PermuteRows", "combine_rows",
           "routing_metadata", "rows_by_token", "sort_rows", "topk_routing"]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (``Glm5NextTextMLP``; not GPT-OSS's form), in the
    inputs' dtype and shape ``[..., I]``; ``limit`` ``None`` disables both clamps."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def topk_routing(hidden_states: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor, *, top_k: int,
                 n_group: int, topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing with an aux-free correction bias and group-limited selection (``Glm5NextTextTopkRouter``,
    same ops: equal indices and weights).

    ``scores = sigmoid(h @ weight.T)`` in fp32 (``hidden_states [..., H]``, ``weight [E, H]``); the ids are
    ``topk(scores + correction_bias, top_k)`` among the ``topk_group`` best of ``n_group`` groups (a group scores
    the sum of its two largest biased scores); ``weights = scores[ids]``, over ``their sum + 1e-20`` when
    ``norm_topk_prob``, times ``routed_scaling_factor``. Returns ``(router_logits fp32 [T, E], topk_weights fp32
    [T, k], topk_indices int64 [T, k])``. Under autocast the same: the logits stay fp32 (autocast off), as the
    reference's fp32 casts and fp32 router weight declare (autocast would compute its ``F.linear`` in bf16).
    """
    num_experts, hidden = weight.shape
    h = hidden_states.reshape(-1, hidden).to(torch.float32)
    with autocast_off(h):
        router_logits = F.linear(h, weight.to(torch.float32))
    scores = router_logits.sigmoid()
    choice = scores + correction_bias
    if n_group > 1:
        grouped = choice.view(-1, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, num_experts)
    topk_indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * routed_scaling_factor, topk_indices


def routing_metadata(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids [S], token_of_row int64 [S], offsets int32 [E], row_weights [S])`` of the ``S = T * k`` rows of
    ``top_k_index`` / ``top_k_weights`` ``[T, k]`` sorted by expert (stable; sentinel ids ``>= num_experts`` last;
    ``offsets[e]``: rows with id ``<= e``). Raises ``ValueError`` for other shapes or ``num_experts < 1``."""
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape:
        raise ValueError(f"top_k_index and top_k_weights must both be [T, k]; got {tuple(top_k_index.shape)} and "
                         f"{tuple(top_k_weights.shape)}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1; got num_experts={num_experts}")
    sorted_ids, order, offsets = sort_rows(top_k_index, num_experts)
    token_of_row = torch.div(order, top_k_index.shape[1], rounding_mode="floor")
    row_weights = top_k_weights.reshape(-1).index_select(0, order)
    return sorted_ids, token_of_row, offsets, row_weights


def sort_rows(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids [S], order int64 [S], offsets int32 [E])`` of the rows of ``top_k_index [T, k]`` sorted by id:
    ``order[i]`` the flat row ``t * k + j`` at position ``i``, ``offsets[e]`` the rows with id ``<= e``."""
    sorted_ids, order = torch.sort(top_k_index.reshape(-1))
    expert_range = torch.arange(num_experts, device=top_k_index.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, expert_range, right=True).to(torch.int32)
    return sorted_ids, order, offsets


class PermuteRows(torch.autograd.Function):
    """``x.index_select(0, perm)`` whose backward gathers by ``inverse`` (``inverse[perm[i]] == i``, not checked)
    instead of scattering into a zero buffer: ``apply(x [N, ...], perm int64 [N], inverse int64 [N])``."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def rows_by_token(token_of_row: torch.Tensor, top_k: int) -> torch.Tensor:
    """int32 ``[T, k]``: each token's rows of ``token_of_row`` (integer ``[S]``, each token ``top_k`` times) in
    increasing order (= increasing expert id). Raises ``ValueError`` for ``top_k < 1`` or ``S % top_k != 0``."""
    if top_k < 1 or token_of_row.numel() % top_k:
        raise ValueError(f"token_of_row ({token_of_row.numel()} rows) must hold top_k={top_k} rows per token")
    return torch.sort(token_of_row, stable=True).indices.view(-1, top_k).to(torch.int32)


def _grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    # The native kernels refuse float64 and need 16-byte multiples for every non-unit stride (forward and backward
    # operands), i.e. for the inner sizes K and N; the release sizes (4096, 2048) always qualify.
    aligned = all(n * w.element_size() % 16 == 0 for n in w.shape[-2:])
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not aligned:
        return False
    if torch.compiler.is_compiling() and w.dtype != torch.bfloat16:
        return False  # inductor lowers grouped_mm for bf16 only
    if w.device.type == "cuda":
        return torch.cuda.get_device_capability(w.device) >= (8, 0)
    if w.device.type == "cpu" and not hasattr(F, "grouped_mm"):
        # torch 2.9 CPU kernel: 16-byte aligned operands only.
        return x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
    return True


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[r] @ w[g(r)]`` (``x [S, K]``, ``w [E, K, N]``, one dtype) over the groups of cumulative int32
    ``offs [E]``; rows past ``offs[-1]`` unwritten. Torch's ``grouped_mm`` where a native kernel applies, else
    transformers' ``grouped_mm_fallback`` op."""
    if _grouped_mm_available(x, w):
        if hasattr(F, "grouped_mm"):
            return F.grouped_mm(x, w, offs=offs)
        return torch._grouped_mm(x, w, offs=offs)
    return torch.ops.transformers.grouped_mm_fallback(x, w.contiguous(), offs=offs)


def check_experts_args(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj) -> None:
    """``ValueError`` unless ``hidden_states`` is ``[T, H]``, ``top_k_index`` / ``top_k_weights`` both ``[T, k]``
    and the expert weights ``[E, 2I, H]`` / ``[E, H, I]``."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H]; got shape {tuple(hidden_states.shape)}")
    num_tokens, hidden = hidden_states.shape
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != num_tokens:
        raise ValueError(f"top_k_index and top_k_weights must both be [T, k] with T={num_tokens}; got "
                         f"{tuple(top_k_index.shape)} and {tuple(top_k_weights.shape)}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"gate_up_proj and down_proj must be 3-D; got {tuple(gate_up_proj.shape)} and "
                         f"{tuple(down_proj.shape)}")
    if gate_up_proj.shape[-1] != hidden or down_proj.shape[:2] != (gate_up_proj.shape[0], hidden):
        raise ValueError(f"expert weights do not fit hidden size {hidden}: gate_up_proj {tuple(gate_up_proj.shape)}, "
                         f"down_proj {tuple(down_proj.shape)}")
    if gate_up_proj.shape[1] != 2 * down_proj.shape[2]:
        raise ValueError(f"gate_up_proj rows ({gate_up_proj.shape[1]}) must be twice down_proj's intermediate size "
                         f"({down_proj.shape[2]})")


def experts_forward_torch(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up_proj: torch.Tensor, down_proj: torch.Tensor, swiglu_limit: float | None, *,
                          drop_out_of_range: bool = False) -> torch.Tensor:
    """Routed experts as grouped GEMMs: ``y_t = sum_j w_tj * down_e(clamped_swiglu(gate_up_e(x_t)))``, ``e = idx_tj``.

    Maths and summation order of ``Glm5NextTextExperts`` (a token's rows in increasing expert order), each token's
    sum in fp32 rounded once. Differentiable w.r.t. tokens, routing weights and expert weights.

    Args:
        hidden_states: ``[T, H]`` (cast to the weights' dtype); top_k_weights: ``[T, k]``.
        top_k_index: integer ``[T, k]`` ids in ``[0, E)``, distinct per token; ids ``>= E`` (expert-parallel
            sentinels) only with ``drop_out_of_range``, then they contribute zero.
        gate_up_proj: ``[E, 2I, H]``, gate rows first; down_proj: ``[E, H, I]``; swiglu_limit: see
            :func:`clamped_swiglu`.

    Under autocast the expert weights are cast to the autocast dtype first (on both paths: the grouped GEMMs then run
    in it, as autocast runs the reference's per-expert ``F.linear``; torch's ``grouped_mm`` is not autocast on CPU).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``.

    Raises:
        ValueError: shapes that do not fit together.
    """
    check_experts_args(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    gate_up_proj, down_proj = to_autocast_dtype(gate_up_proj, down_proj)
    num_experts = gate_up_proj.shape[0]
    num_tokens, top_k = top_k_index.shape
    sorted_ids, order, offsets = sort_rows(top_k_index, num_experts)
    position = torch.argsort(order)  # inverse permutation: the sorted position of (token, slot) row t * k + j
    token_of_row = torch.div(order, top_k, rounding_mode="floor")
    row_weights = PermuteRows.apply(top_k_weights.reshape(-1), order, position)
    # each token's row repeated k times (expand: its backward sums the k gradients), then sorted by expert
    hidden = hidden_states.shape[-1]
    repeated = hidden_states.unsqueeze(1).expand(num_tokens, top_k, hidden).reshape(-1, hidden)
    x = PermuteRows.apply(repeated, order, position).to(gate_up_proj.dtype)
    valid = None
    if drop_out_of_range:
        # Sentinel rows sit past offsets[-1]: grouped_mm leaves them unwritten (forward) and leaves their input
        # gradient unwritten (backward); zero both.
        valid = (sorted_ids < num_experts).unsqueeze(-1)
        x = x.masked_fill(~valid, 0.0)
    gate_up = grouped_mm(x, gate_up_proj.transpose(-2, -1), offsets)  # [S, 2I]
    if valid is not None:
        gate_up = gate_up.masked_fill(~valid, 0.0)
    act = clamped_swiglu(*gate_up.chunk(2, dim=-1), swiglu_limit)
    out_rows = grouped_mm(act, down_proj.transpose(-2, -1), offsets)  # [S, H]
    if valid is not None:
        out_rows = out_rows.masked_fill(~valid, 0.0)
    out_rows = out_rows * row_weights.unsqueeze(-1)
    return combine_rows(out_rows, token_of_row, top_k).to(hidden_states.dtype)


def combine_rows(out_rows: torch.Tensor, token_of_row: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's sum ``[T, H]`` of its ``k`` weighted rows ``out_rows [S, H]`` (``token_of_row`` integer ``[S]``),
    added in increasing expert order from the first, by gathers only; ``ValueError`` as :func:`rows_by_token`."""
    gather = rows_by_token(token_of_row, top_k).reshape(-1).long()
    num_tokens = token_of_row.numel() // top_k
    rows = PermuteRows.apply(out_rows, gather, torch.argsort(gather)).view(num_tokens, top_k, out_rows.shape[-1])
    out = rows[:, 0]
    for j in range(1, top_k):
        out = out + rows[:, j]
    return out
