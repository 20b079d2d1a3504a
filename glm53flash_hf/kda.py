"""Kimi Delta Attention (KDA): the linear-attention layer of GLM-5.3-Flash.

The layer :class:`Glm53FlashLinearAttention` with its :class:`Glm53FlashForgetGate` and
:class:`Glm53FlashRMSNormGated` (parameter names and dtypes equal to transformers' ``Glm5NextTextLinearAttention``,
``models/glm5_next/modeling_glm5_next.py``, so state dicts are interchangeable), :func:`init_kda_weights` (the
from-scratch initialisation of transformers' ``_init_weights``).

The maths is in :mod:`glm53flash_hf.kda_ops` (the torch path: short convolution, chunked and recurrent delta rule;
Kimi Linear, arXiv:2510.26692 §3). The fused CUDA path is :mod:`glm53flash_hf.kda_fused` (fla-core's
``fla.ops.kda.chunk_kda`` with the gate, beta and l2-norm in the kernel, varlen ``causal_conv1d``,
``rms_norm_gated``; ``fla.ops.kda.fused_recurrent_kda`` for decode steps without gradients). Each call picks one of
the two from ``config.kernels["kda"]`` and the tensors (:func:`glm53flash_hf.dispatch.choose_backend`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .dispatch import choose_backend, requested_backend
from .generation_cache import check_cache
from .kda_ops import LayerOps, causal_conv1d_torch, chunk_kda_torch, recurrent_kda_torch
from .offload import call_onloaded
from .packing import DocumentLayout

__all__ = [
    "Glm53FlashForgetGate",
    "Glm53FlashRMSNormGated",
    "Glm53FlashLinearAttention",
    "init_kda_weights",
]


# ----------------------------------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------------------------------


class Glm53FlashForgetGate(nn.Module):
    """KDA forget gate: per-channel log decay ``g`` [B, S, H, K], fp32.

    ``f = f_b_proj(f_a_proj(x))`` (low rank ``hidden -> K -> H*K``, in ``x``'s dtype), then in fp32, per head ``h``:

    * with ``config.linear_lower_bound = lb`` (release: -5): ``g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))``,
      in ``(lb, 0)``;
    * with ``linear_lower_bound = None``: ``g = -exp(A_log[h]) * softplus(f + dt_bias)`` (softplus linear above 20).

    Same maths as transformers' ``Glm5NextTextForgetGate`` and fla's ``naive_kda_lowerbound_gate`` /
    ``naive_kda_gate``. The softplus uses ``torch.nn.functional.softplus`` (``log1p``), which differs from HF's
    ``log(1 + exp(x))`` by < 1e-7 absolute and keeps gradients finite where ``exp`` overflows.

    Parameters: ``f_a_proj.weight`` [K, hidden], ``f_b_proj.weight`` [H*K, K], ``dt_bias`` fp32 [H*K],
    ``A_log`` fp32 [H].
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.head_dim = config.linear_head_dim
        self.num_heads = config.linear_num_heads
        self.qkv_dim = self.head_dim * self.num_heads
        self.f_a_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, self.qkv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.qkv_dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.lower_bound = config.linear_lower_bound

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` [B, S, hidden] -> ``g`` fp32 [B, S, H, K]."""
        B, S = hidden_states.shape[:2]
        f = self.f_b_proj(self.f_a_proj(hidden_states)).float() + self.dt_bias.float()
        f = f.view(B, S, self.num_heads, self.head_dim)
        rate = torch.exp(self.A_log.float()).view(self.num_heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * f)
        return -rate * F.softplus(f, beta=1.0, threshold=20.0)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, lower_bound={self.lower_bound}"


class Glm53FlashRMSNormGated(nn.Module):
    """Gated RMSNorm of the KDA output: ``(RMSNorm_fp32(x) * weight * sigmoid(gate)).to(x.dtype)``.

    Args:
        hidden_size: last dim (the KDA head dim ``K``).
        eps: variance epsilon (``config.rms_norm_eps``).

    ``forward(x [..., hidden], gate [..., hidden])``; everything in fp32, cast back to ``x.dtype``. Same maths as
    transformers' ``Glm5NextTextRMSNormGated`` and fla's ``FusedRMSNormGated(activation="sigmoid")``.
    Parameter: ``weight`` [hidden].
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if gate.shape != hidden_states.shape:
            raise ValueError(f"gate must have the shape of x {tuple(hidden_states.shape)}; got {tuple(gate.shape)}")
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        x = self.weight.float() * x * torch.sigmoid(gate.float())
        return x.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class Glm53FlashLinearAttention(nn.Module):
    """The KDA token mixer of GLM-5.3-Flash (the ``"linear_attention"`` entries of ``config.layer_types``).

    Parameters (names, shapes and dtypes equal to transformers' ``Glm5NextTextLinearAttention``; ``D`` hidden,
    ``H`` ``linear_num_heads``, ``K`` ``linear_head_dim``, ``W`` ``linear_conv_kernel_dim``):
    ``q_proj``, ``k_proj``, ``v_proj`` [H*K, D]; ``conv1d.weight`` fp32 [3*H*K, 1, W] (depthwise, channels q|k|v);
    ``forget_gate`` (:class:`Glm53FlashForgetGate`); ``b_proj`` [H, D]; ``g_a_proj`` [K, D]; ``g_b_proj`` [H*K, K];
    ``o_norm.weight`` [K]; ``o_proj`` [D, H*K]. No biases.

    Forward: ``q, k, v = silu(causal_conv([q_proj x | k_proj x | v_proj x]))``, ``g = forget_gate(x)``,
    ``beta = sigmoid(b_proj x)`` (computed in fp32), ``o = KDA(q, k, v, g, beta)`` (l2-normalised q, k; scale
    ``K^-0.5``), ``out = o_proj(o_norm(o, g_b_proj(g_a_proj x)))``.

    The implementation is chosen per call by ``config.kernels["kda"]`` (``"auto"`` / ``"torch"`` / ``"fused"``) and
    the tensors' device: see :meth:`bind_ops`.
    """

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.qkv_dim = self.num_heads * self.head_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.layer_idx = layer_idx
        self.activation = config.hidden_act
        if self.activation not in ("silu", "swish"):
            raise ValueError(f"hidden_act must be 'silu' for the KDA short convolution; got {self.activation!r}")
        self.backend = requested_backend(config, "kda")

        self.q_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.conv_dim = 3 * self.qkv_dim
        self.conv1d = nn.Conv1d(
            in_channels=self.conv_dim,
            out_channels=self.conv_dim,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=self.conv_kernel_size - 1,
            bias=False,
            dtype=torch.float32,
        )
        self.forget_gate = Glm53FlashForgetGate(config)
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, self.qkv_dim, bias=False)
        self.o_norm = Glm53FlashRMSNormGated(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, self.hidden_size, bias=False)

    def bind_ops(self, hidden_states: torch.Tensor, decode: bool) -> LayerOps:
        """The gate, conv, core and norm of one call, all on one backend.

        ``choose_backend("kda", self.backend, ...)`` is asked once, from the tensors only (device, dtype, and the head
        dim carried by ``o_norm.weight`` viewed ``[1, 1, 1, K]``), never from ``self.training`` or grad mode, so an
        activation-checkpoint recompute takes the path of the forward it replays.

        * ``"fused"``: :func:`glm53flash_hf.kda_fused.bind_layer_fused` (fla's conv, ``chunk_kda`` with the gate,
          the beta sigmoid and the l2-norm in the kernel, or for a decode step without gradients
          ``fused_recurrent_kda``; ``rms_norm_gated``).
        * ``"torch"``: :func:`~glm53flash_hf.kda_ops.causal_conv1d_torch`, then
          :func:`~glm53flash_hf.kda_ops.recurrent_kda_torch` for a decode step (``decode``: one token continuing a
          cached state) or :func:`~glm53flash_hf.kda_ops.chunk_kda_torch`; the gate and the norm are the submodules.

        Args:
            hidden_states: ``[B, S, D]``, this call's input.
            decode: whether the call is a cached decode step.

        Returns:
            A :class:`~glm53flash_hf.kda_ops.LayerOps`.

        Raises:
            ValueError: on the fused path, a sharded DTensor parameter (named).
        """
        if choose_backend("kda", self.backend, hidden_states, self.o_norm.weight.view(1, 1, 1, -1)) == "fused":
            from .kda_fused import bind_layer_fused

            return call_onloaded(
                (self.conv1d, self.forget_gate, self.o_norm), lambda: bind_layer_fused(self, hidden_states, decode)
            )
        conv_weight = call_onloaded((self.conv1d,), lambda: self.conv1d.weight[:, 0, :])
        return LayerOps(
            gate=lambda x: (self.forget_gate(x), torch.sigmoid(self.b_proj(x).float())),
            conv=functools.partial(causal_conv1d_torch, weight=conv_weight, activation=self.activation),
            core=recurrent_kda_torch if decode else chunk_kda_torch,
            norm=self.o_norm,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        layout: DocumentLayout,
        cache=None,
        cache_context=None,
        **kwargs,
    ) -> torch.Tensor:
        """Mix tokens within documents, optionally continuing from (and updating) this layer's cache states.

        Args:
            hidden_states: ``[B, S, D]``.
            layout: the batch's :class:`~glm53flash_hf.packing.DocumentLayout`. Padding tokens are zeroed (as HF
                does with a 2-D mask, but with ``masked_fill`` so non-finite padding cannot leak). Without a cache:
                with ``layout.trivial`` the rows run batched; otherwise the batch is flattened to ``[1, B*S]`` and the
                convolution and recurrence restart at every segment of ``layout.cu_seqlens`` (padding runs are their
                own segments; their outputs are finite and unused). With a cache, ``layout`` only gives the padding
                (``layout.valid``) of this call's tokens and the rows run batched.
            cache: optional transformers ``Cache`` whose layer ``layer_idx`` is transformers' ``LinearAttentionLayer``:
                the conv state ``[B, 3*H*K, W]`` (the row's last ``W`` conv inputs ``[q|k|v]``, oldest first, in the
                projections' dtype, the layout transformers' glm5_next writes) and the recurrent state fp32
                ``[B, H, K, V]``. Both are read as the initial states of this call (zeros when empty) and replaced
                by the final ones. A call of one token with both states present is a decode step
                (:meth:`bind_ops`); a longer call continues the chunked form, so two chunks equal one prefill. Left
                padding is zeroed first: a zero input gives ``q = k = v = 0`` after the conv, so the state and the
                conv history stay zero until the row's first real token, the same numbers as the uncached forward,
                which restarts a segment there. While the cache records its past (``cache.is_recording_past``,
                assisted / MTP decoding with :class:`~.generation_cache.Glm53FlashKDACacheLayer`), every call
                hands the cache its raw conv inputs and what restores the state after any of its tokens: a
                continuation of ``S > 1`` tokens runs the decode recurrence token by token (the maths of ``S``
                decode steps) and hands the ``S`` per-token states, a decode step its one state, and a first call
                (run chunked) a replay over a prefix of its inputs, so that ``crop(-n)`` restores the state ``n``
                tokens back exactly.
            cache_context: unused here (accepted for a uniform layer signature).

        Sequence parallelism: when ``layout.sequence_parallel`` is set (:mod:`.sequence_parallel`), the first
        segment's conv history comes from the previous rank
        (:meth:`~.sequence_parallel.SequenceParallelContext.kda_conv_initial_state`) and the recurrence passes its
        state between ranks (:meth:`~.sequence_parallel.SequenceParallelContext.kda_core`).

        Returns:
            ``[B, S, D]`` in ``hidden_states``' dtype.

        Raises:
            NotImplementedError: ``cache`` that is not a transformers ``Cache``
                (:class:`~.generation_cache.UnsupportedCacheError`, also a ``TypeError``).
            ValueError: ``layout`` does not match ``[B, S]``; the cache layer is not a linear-attention layer
                (transformers' message); on the fused path, a sharded DTensor parameter (named).
        """
        B, S, _ = hidden_states.shape
        H, K = self.num_heads, self.head_dim
        if layout.batch_size != B or layout.seq_len != S:
            raise ValueError(
                f"layout is for [{layout.batch_size}, {layout.seq_len}] but hidden_states is [{B}, {S}, ...]"
            )
        conv_state = recurrent_state = None
        if cache is not None:
            check_cache(cache, "Glm53FlashLinearAttention")
            conv_state = cache.get_conv_state(self.layer_idx)
            recurrent_state = cache.get_recurrent_state(self.layer_idx)
        continuing = conv_state is not None and recurrent_state is not None
        recording = cache is not None and cache.is_recording_past(self.layer_idx)
        if recording and conv_state is not None:
            # a recording layer keeps every input since the last crop; the convolution reads the last W
            conv_state = conv_state[..., -self.conv_kernel_size :]
        # a multi-token continuation while the cache records its past (assisted decoding's verification call) runs
        # the decode recurrence token by token and keeps each state, so crop(-n) can restore any of them
        stepwise = continuing and S > 1 and recording
        ops = self.bind_ops(hidden_states, decode=continuing and (S == 1 or stepwise))
        if not layout.trivial:
            # masked_fill, not a multiply: garbage (even non-finite) padding embeddings cannot reach any gradient.
            hidden_states = hidden_states.masked_fill(~layout.valid[:, :, None], 0.0)

        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
        g, beta = ops.gate(hidden_states)
        varlen = {}
        if cache is None and not layout.trivial:
            mixed = mixed.reshape(1, B * S, self.conv_dim)
            g = g.reshape(1, B * S, H, K)
            beta = beta.reshape(1, B * S, H)
            varlen = {"cu_seqlens": layout.cu_seqlens}
        states = {"output_final_state": cache is not None}
        sp = getattr(layout, "sequence_parallel", None)
        if sp is not None:  # a sequence-parallel shard: conv history and recurrent state from the previous ranks
            if cache is not None:
                raise ValueError("sequence parallelism runs uncached forwards only; got a cache")
            conv_state = sp.kda_conv_initial_state(mixed.view(B, S, self.conv_dim), self.conv_kernel_size,
                                                   layout.num_segments)
        conv_inputs = mixed
        mixed, conv_final = ops.conv(mixed, initial_state=conv_state, **states, **varlen)
        b, t = mixed.shape[:2]
        q, k, v = (x.reshape(b, t, H, K) for x in mixed.split(self.qkv_dim, dim=-1))
        per_token_states = None
        if sp is not None:
            o = sp.kda_core(ops.core, q, k, v, g, beta, cu_seqlens=layout.cu_seqlens, cp_core=ops.cp_core)
            recurrent_final = None
        elif stepwise:
            outs, per_token = [], []
            state = recurrent_state
            for i in range(S):
                step = (x[:, i : i + 1] for x in (q, k, v, g, beta))
                o_i, state = ops.core(*step, initial_state=state, output_final_state=True)
                outs.append(o_i)
                per_token.append(state.float())
            o, recurrent_final, per_token_states = torch.cat(outs, dim=1), state, torch.stack(per_token)
        else:
            o, recurrent_final = ops.core(q, k, v, g, beta, initial_state=recurrent_state, **states, **varlen)
        if cache is not None:
            # the final conv state holds exactly the last W inputs: stored as is, first call or continuation. While
            # the cache records its past, the call hands transformers' layer its raw inputs [B, 3*H*K, S] instead
            # (a first call behind W zero columns, the inputs before the row's first token), which it appends to the
            # recorded window so that crop(-n) can cut it back
            conv_update = conv_final
            if recording:
                conv_update = conv_inputs.transpose(1, 2).to(conv_final.dtype)
                if not continuing:
                    conv_update = torch.nn.functional.pad(conv_update, (self.conv_kernel_size, 0))
            cache.update_conv_state(conv_update, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
            history = {}
            if recording and per_token_states is not None:
                history = {"per_token_states": per_token_states}
            elif recording and S == 1:
                history = {"per_token_states": recurrent_final.float()[None]}
            elif recording and not continuing:
                # a recorded first call (assisted decoding's prefill, which may end with candidate tokens): the
                # state after any prefix is recomputed from these inputs if a crop reaches into the call
                def replay(j, core=ops.core, inputs=(q, k, v, g, beta)):
                    prefix = (x[:, :j].contiguous() for x in inputs)
                    return core(*prefix, initial_state=None, output_final_state=True)[1].float()

                history = {"replay": (S, replay)}
            cache.update_recurrent_state(recurrent_final.float(), self.layer_idx, **history)
        gate = self.g_b_proj(self.g_a_proj(hidden_states)).view(B, S, H, K)
        return self.o_proj(ops.norm(o.reshape(B, S, H, K), gate).reshape(B, S, self.qkv_dim))


def init_kda_weights(module: nn.Module, config) -> None:
    """From-scratch initialisation of the KDA-specific parameters of ``module`` (one module, not recursive).

    Reproduces transformers ``Glm5NextPreTrainedModel._init_weights`` (same draws in the same order, guarded by
    ``_is_hf_initialized`` through ``transformers.initialization``):

    * :class:`Glm53FlashForgetGate`: ``A_log = 0`` when ``linear_lower_bound`` is set, else ``log(U(1, 16))``;
      ``dt_bias = softplus^-1(dt)`` with ``dt = max(exp(U(log 1e-3, log 1e-1)), 1e-4)`` (fla's recipe);
    * :class:`Glm53FlashRMSNormGated`: ``weight = 1``.

    Linear and conv weights are left to the generic ``_init_weights`` (normal, ``initializer_range``). Other
    modules are ignored. ``config`` is accepted for a uniform signature across families.
    """
    if isinstance(module, Glm53FlashForgetGate):
        if module.lower_bound is not None:
            init.zeros_(module.A_log)
        else:
            init.copy_(module.A_log, init.uniform_(module.A_log, a=1.0, b=16.0).log())
        init.uniform_(module.dt_bias, a=math.log(1e-3), b=math.log(1e-1))
        dt = module.dt_bias.exp().clamp_min(1e-4)
        init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
    elif isinstance(module, Glm53FlashRMSNormGated):
        init.ones_(module.weight)
