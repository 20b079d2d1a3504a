"""Torch maths of GLM-5.3-Flash's mixture-of-experts feed-forward: the oracle of the fused kernels and the path of
CPU tensors and decoding.

Reference: transformers' ``transformers/models/glm5_next/modeling_glm5_next.py`` (``Glm5NextTextMLP``,
``Glm5NextTextTopkRouter``, ``Glm5NextTextExperts``).

* :func:`clamped_swiglu`: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``.
* :func:`topk_routing`: the sigmoid top-k router with an aux-free correction bias and group-limited selection.
* :func:`experts_forward_torch`: the routed experts as grouped GEMMs. The (token, expert) pairs are sorted by expert
  once (``torch.sort`` and ``searchsorted``, static shapes, no host sync), the token rows are gathered once, two
  :func:`grouped_mm` calls run all experts (no Python loop over experts), the routing weight multiplies the
  down-projection output as in the reference, and each token's k rows are gathered back and added in fp32, rounded
  once to the activation dtype. A token's rows are added in increasing expert order, the order of the reference's
  eager loop (``index_add_`` per expert from zero), so fp32 results agree with it to GEMM rounding. In bf16 a
  token's k contributions are added in fp32 and rounded once, where the reference's eager loop rounds every
  contribution to bf16 first.
* The row moves of that path are gathers by a permutation whose backward is the gather by the inverse permutation
  (:class:`PermuteRows`), and a token's k rows come from ``expand`` (backward: a sum), so neither direction writes
  through a scatter into a fresh buffer (``zeros`` + ``index_add_``). Inductor's CPU fusion in torch 2.13 can
  schedule the readers of such a buffer before the scatter into it when the rows come from an extern kernel (the
  grouped-GEMM fallback op), which gave wrong compiled training steps; the gathers have no mutation to order.

Every ``grouped_mm`` output here feeds an elementwise op, so its gradient is always materialised (the torch
``grouped_mm`` backward rejects a stride-0, expanded, output gradient).

This module imports only torch and transformers' grouped-GEMM fallback op; :mod:`glm53flash_hf.moe` (modules,
per-call dispatch) and :mod:`glm53flash_hf.moe_fused` (Triton kernels) import from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers.integrations.moe  # noqa: F401  registers torch.ops.transformers.grouped_mm_fallback

__all__ = [
    "check_experts_args",
    "clamped_swiglu",
    "experts_forward_torch",
    "grouped_mm",
    "PermuteRows",
    "combine_rows",
    "routing_metadata",
    "rows_by_token",
    "sort_rows",
    "topk_routing",
]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Clamped SwiGLU of GLM-5.3-Flash: ``silu(min(gate, limit)) * clamp(up, -limit, limit)``.

    Not GPT-OSS's clipped form (no alpha, no ``+1``). Source: ``Glm5NextTextMLP.forward``.

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


def topk_routing(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing with an aux-free correction bias and optional group-limited selection.

    Per token: ``logits = h_fp32 @ weight_fp32.T``; ``scores = sigmoid(logits)``;
    ``choice = scores + correction_bias``; if ``n_group > 1``: a group's score is the sum of its two largest
    ``choice`` values and only the ``topk_group`` best groups stay eligible (the others get ``-inf``);
    ``indices = topk(choice, top_k)``; ``weights = scores[indices]`` (the un-biased scores), divided by
    ``their sum + 1e-20`` when ``norm_topk_prob``, times ``routed_scaling_factor``. The reference's torch ops
    (``topk(sorted=False)``), so indices come out in the same order and the weights are bitwise equal. Source:
    ``Glm5NextTextTopkRouter.forward``.

    Args:
        hidden_states: ``[..., H]`` tokens (any float dtype; routed in fp32).
        weight: ``[E, H]`` router weight. correction_bias: ``[E]`` fp32 (``e_score_correction_bias``).
        top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor: the config fields of the same meaning
            (``num_experts_per_tok`` is ``top_k``); ``E`` divisible by ``n_group``.

    Returns:
        ``(router_logits fp32 [T, E], topk_weights fp32 [T, k], topk_indices int64 [T, k])``, ``T`` the number of
        tokens.
    """
    num_experts, hidden = weight.shape
    h = hidden_states.reshape(-1, hidden).to(torch.float32)
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


def routing_metadata(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing metadata of one experts call, built once (sort by expert, no host sync, static shapes).

    Args:
        top_k_index: integer ``[T, k]`` expert ids (ids ``>= num_experts`` are expert-parallel sentinels: they sort
            last).
        top_k_weights: ``[T, k]`` routing weights (differentiable).
        num_experts: ``E``.

    Returns:
        ``(sorted_ids [S], token_of_row int64 [S], offsets int32 [E], row_weights [S])`` for the ``S = T * k``
        (token, expert) rows sorted by expert id (stable): each row's expert id and token, the cumulative group
        offsets (``offsets[e]`` = rows with id ``<= e``, so ``offsets[-1]`` counts the rows that have a local expert)
        and each row's routing weight.

    Raises:
        ValueError: index/weight shapes differ or are not ``[T, k]``; ``num_experts < 1``.
    """
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape:
        raise ValueError(
            f"top_k_index and top_k_weights must both be [T, k]; got {tuple(top_k_index.shape)} and "
            f"{tuple(top_k_weights.shape)}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1; got num_experts={num_experts}")
    sorted_ids, order, offsets = sort_rows(top_k_index, num_experts)
    token_of_row = torch.div(order, top_k_index.shape[1], rounding_mode="floor")
    row_weights = top_k_weights.reshape(-1).index_select(0, order)
    return sorted_ids, token_of_row, offsets, row_weights


def sort_rows(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``S = T * k`` (token, slot) rows of integer ``top_k_index [T, k]`` by expert id: returns
    ``(sorted_ids [S], order int64 [S], offsets int32 [E])``, ``order[i]`` the flat row ``t * k + j`` at sorted
    position ``i`` and ``offsets[e]`` the number of rows with id ``<= e`` (cumulative group ends). Ids
    ``>= num_experts`` (expert-parallel sentinels) sort last, past ``offsets[-1]``. Static shapes, no host sync."""
    sorted_ids, order = torch.sort(top_k_index.reshape(-1))
    expert_range = torch.arange(num_experts, device=top_k_index.device, dtype=sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, expert_range, right=True).to(torch.int32)
    return sorted_ids, order, offsets


class PermuteRows(torch.autograd.Function):
    """``x.index_select(0, perm)`` for a permutation ``perm`` of ``x``'s rows, with the backward
    ``grad.index_select(0, inverse)``: a gather, where ``index_select``'s own backward scatters (``index_add_``)
    into a zero buffer. ``apply(x [N, ...], perm int64 [N], inverse int64 [N]) -> [N, ...]``; ``inverse`` must
    be the inverse permutation (``inverse[perm[i]] == i``; not checked, the callers build both from one sort)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def rows_by_token(token_of_row: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each token's rows in increasing row order (= increasing expert id): the ``token_rows`` of
    :func:`glm53flash_hf.moe_fused.weighted_combine_fused` and of the torch path's combine.

    Args:
        token_of_row: integer ``[S]`` token of each expert-sorted row (from
            :func:`routing_metadata`); every token appears ``top_k`` times.
        top_k: ``k``, the experts per token.

    Returns:
        int32 ``[T, k]`` with ``T = S / k``: row ``t`` lists the rows of token ``t`` in increasing order (a stable
        sort of the rows by token).

    Raises:
        ValueError: ``top_k < 1`` or ``S`` not a multiple of ``top_k``.
    """
    if top_k < 1 or token_of_row.numel() % top_k:
        raise ValueError(f"token_of_row ({token_of_row.numel()} rows) must hold top_k={top_k} rows per token")
    return torch.sort(token_of_row, stable=True).indices.view(-1, top_k).to(torch.int32)


def _grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's native grouped GEMM can run ``x @ w`` here."""
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False  # the native kernels refuse float64
    # The kernels need 16-byte multiples for every non-unit stride (forward and backward operands), i.e. for the
    # inner sizes K and N; the release sizes (4096, 2048) always qualify.
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


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[r] @ w[g(r)]`` for rows ``r`` of group ``g`` delimited by cumulative int32 ``offs`` [E].

    ``x [S, K]``, ``w [E, K, N]`` (any strides), same dtype; returns ``[S, N]``. Rows past ``offs[-1]`` are left
    unwritten. Uses ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on torch 2.9); where no native kernel
    applies (float64, CUDA below SM80, compiled non-bf16, K or N not a multiple of 16 bytes, unaligned torch-2.9 CPU
    operands) it calls transformers' registered ``transformers::grouped_mm_fallback`` custom op (a per-expert loop
    with a hand-written backward). Differentiable w.r.t. ``x`` and ``w``.
    """
    if _grouped_mm_available(x, w):
        if hasattr(F, "grouped_mm"):
            return F.grouped_mm(x, w, offs=offs)
        return torch._grouped_mm(x, w, offs=offs)
    return torch.ops.transformers.grouped_mm_fallback(x, w.contiguous(), offs=offs)


def check_experts_args(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj) -> None:
    """Validate the arguments of the routed experts (both paths).

    Raises:
        ValueError: ``hidden_states`` not ``[T, H]``; ``top_k_index``/``top_k_weights`` not both ``[T, k]``;
            expert weights not 3-D ``[E, 2I, H]`` / ``[E, H, I]``.
    """
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H]; got shape {tuple(hidden_states.shape)}")
    num_tokens, hidden = hidden_states.shape
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != num_tokens:
        raise ValueError(
            f"top_k_index and top_k_weights must both be [T, k] with T={num_tokens}; got {tuple(top_k_index.shape)} "
            f"and {tuple(top_k_weights.shape)}"
        )
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"gate_up_proj and down_proj must be 3-D; got {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}"
        )
    if gate_up_proj.shape[-1] != hidden or down_proj.shape[:2] != (gate_up_proj.shape[0], hidden):
        raise ValueError(
            f"expert weights do not fit hidden size {hidden}: gate_up_proj {tuple(gate_up_proj.shape)}, "
            f"down_proj {tuple(down_proj.shape)}"
        )
    if gate_up_proj.shape[1] != 2 * down_proj.shape[2]:
        raise ValueError(
            f"gate_up_proj rows ({gate_up_proj.shape[1]}) must be twice down_proj's intermediate size "
            f"({down_proj.shape[2]})"
        )


def experts_forward_torch(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    swiglu_limit: float | None,
    *,
    drop_out_of_range: bool = False,
) -> torch.Tensor:
    """Routed experts as grouped GEMMs: ``y_t = sum_j w_tj * down_e(clamped_swiglu(gate_up_e(x_t)))``, ``e = idx_tj``.

    The maths and rounding order of ``Glm5NextTextExperts`` (eager loop): the routing weight multiplies the
    down-projection output. Sort-once grouped implementation, see the module docstring.

    Args:
        hidden_states: ``[T, H]`` tokens (cast to the weights' dtype for the GEMMs).
        top_k_index: ``[T, k]`` integer expert ids in ``[0, E)``; each token's ids must be distinct (as top-k
            gives). Ids ``>= E`` are expert-parallel sentinels, allowed only with ``drop_out_of_range=True``.
        top_k_weights: ``[T, k]`` routing weights (fp32 from the router).
        gate_up_proj: ``[E, 2I, H]``, gate rows first. down_proj: ``[E, H, I]``.
        swiglu_limit: clamp of :func:`clamped_swiglu`.
        drop_out_of_range: treat ids ``>= E`` as "not on this rank" (contribute zero, no GEMM work).

    Returns:
        ``[T, H]`` in ``hidden_states.dtype``; the per-token sum over its k experts is accumulated in fp32 (or the
        promoted dtype of activations and weights) and rounded once. Differentiable w.r.t. the tokens, the routing
        weights and both expert weights.

    Raises:
        ValueError: shapes that do not fit together (:func:`check_experts_args`).
    """
    check_experts_args(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
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
    """Each token's sum of its ``k`` expert-sorted rows, by gathers only: ``out_rows [S, H]`` (already weighted),
    ``token_of_row`` integer ``[S]`` (:func:`routing_metadata`) -> ``[T, H]`` (``T = S / k``) in ``out_rows``' dtype.

    A token's rows are taken in increasing sorted position, i.e. increasing expert id (a token's experts are
    distinct; expert-parallel sentinel rows, zero, sort last), and added from the first: the order of transformers'
    eager loop (``index_add_`` per expert from zero). Rows move with :class:`PermuteRows` (no scatter into a fresh
    buffer in either direction; the module docstring says why). Shared by :func:`experts_forward_torch` and the
    expert-parallel combine (``glm53flash_hf.train.expert_parallel.ExpertDispatcher``).

    Raises:
        ValueError: ``top_k < 1`` or ``S`` not a multiple of ``top_k`` (:func:`rows_by_token`).
    """
    gather = rows_by_token(token_of_row, top_k).reshape(-1).long()
    num_tokens = token_of_row.numel() // top_k
    rows = PermuteRows.apply(out_rows, gather, torch.argsort(gather)).view(num_tokens, top_k, out_rows.shape[-1])
    out = rows[:, 0]
    for j in range(1, top_k):
        out = out + rows[:, j]
    return out
