"""Kimi Delta Attention (KDA), the linear-attention layer of GLM-5.3-Flash (Kimi Linear, arXiv:2510.26692 §3).

Parameters as transformers' ``Glm5NextTextLinearAttention`` (names, shapes, dtypes); ops from :mod:`.kda_ops` or
their fused alternatives in :mod:`.kda_fused`, chosen per call by :func:`.dispatch.op_for`."""

from __future__ import annotations

import functools
import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .dispatch import op_for, register_fused, requested_backend
from .generation_cache import check_cache
from .kda_ops import causal_conv1d_torch, chunk_kda_torch, kda_gate, recurrent_kda_torch, rms_norm_gated_torch
from .offload import call_onloaded
from .packing import DocumentLayout

__all__ = ["Glm53FlashForgetGate", "Glm53FlashRMSNormGated", "Glm53FlashLinearAttention", "init_kda_weights"]


def _fused_loader(name: str):
    """A loader of ``kda_fused.<name>``, the fused alternative of one KDA torch op, imported on the first fused call."""
    return lambda: getattr(importlib.import_module(".kda_fused", __package__), name)


for _op in (chunk_kda_torch, recurrent_kda_torch, causal_conv1d_torch, rms_norm_gated_torch):
    register_fused("kda", _op, _fused_loader(_op.__name__.replace("_torch", "_fused")))


class Glm53FlashForgetGate(nn.Module):
    """KDA forget gate (transformers' ``Glm5NextTextForgetGate``): fp32 per-channel log decay ``g`` [B, S, H, K],
    :func:`.kda_ops.kda_gate` of ``f_b_proj(f_a_proj(x))`` with ``A_log``, ``dt_bias`` and
    ``config.linear_lower_bound``."""

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
        return kda_gate(self.gate_input(hidden_states), self.A_log, self.dt_bias, self.lower_bound)

    def gate_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``f_b_proj(f_a_proj(hidden_states))`` as ``[B, S, H, K]``, the gate's input (``g`` of the KDA ops)."""
        return self.f_b_proj(self.f_a_proj(hidden_states)).unflatten(-1, (self.num_heads, self.head_dim))

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_dim={self.head_dim}, lower_bound={self.lower_bound}"


class Glm53FlashRMSNormGated(nn.Module):
    """``forward(x, gate, backend="torch")`` on ``[..., hidden_size]``: :func:`.kda_ops.rms_norm_gated_torch` or its
    fused alternative, as :func:`.dispatch.op_for` decides for ``backend`` (transformers' ``Glm5NextTextRMSNormGated``);
    raises ``ValueError`` when the shapes differ. Called as a module so that hooks that gather its weight (a
    sharding unit's, accelerate offload's) run."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        op = op_for(rms_norm_gated_torch, backend, hidden_states, gate)
        return op(hidden_states, gate, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class Glm53FlashLinearAttention(nn.Module):
    """The KDA token mixer (the ``"linear_attention"`` entries of ``config.layer_types``).

    ``q, k, v = silu(causal_conv([q_proj x | k_proj x | v_proj x]))`` (fp32 ``conv1d.weight`` ``[3*H*K, 1, W]``),
    ``o = KDA(q, k, v, forget_gate(x), sigmoid(b_proj x))`` (l2-normalised q, k, scale ``K^-0.5``),
    ``out = o_proj(o_norm(o, g_b_proj(g_a_proj x)))``. Each op (:mod:`.kda_ops`) or its fused alternative
    (:mod:`.kda_fused`) is chosen per call by :func:`.dispatch.op_for`, the gate and beta activated inside the op.
    Raises ``ValueError`` unless ``config.hidden_act`` is silu.
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
        self.config = config

        self.q_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.qkv_dim, bias=False)
        self.conv_dim = 3 * self.qkv_dim
        W = self.conv_kernel_size
        self.conv1d = nn.Conv1d(in_channels=self.conv_dim, out_channels=self.conv_dim, kernel_size=W,
                                groups=self.conv_dim, padding=W - 1, bias=False, dtype=torch.float32)
        self.forget_gate = Glm53FlashForgetGate(config)
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, self.qkv_dim, bias=False)
        self.o_norm = Glm53FlashRMSNormGated(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(self.qkv_dim, self.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, layout: DocumentLayout, cache=None, **kwargs
                ) -> tuple[torch.Tensor, None, None]:
        """Mix the tokens of ``hidden_states`` ``[B, S, D]`` within the documents of ``layout`` (padding zeroed).

        Uncached or a cache without history: the chunked core over the documents. With a cache: a first call or a
        continuation that does not record its past runs the chunked core from the cached states; one token per row,
        or several while the cache records its past (speculative verification), runs the recurrence token by token,
        every state to the cache.

        ``cache``: optional transformers ``Cache`` whose layer ``layer_idx`` is a ``LinearAttentionLayer`` (conv state
        ``[B, 3*H*K, W]``, oldest first; fp32 recurrent state ``[B, H, K, V]``), read as the initial states and
        replaced by the final ones. Other kwargs (the DSA mixer's) are ignored. Returns ``(out, None, None)``, the
        token mixers' one shape (:meth:`.dsa.Glm53FlashAttention.forward`), ``out`` ``[B, S, D]`` in
        ``hidden_states``' dtype.

        Raises:
            NotImplementedError: ``cache`` is not a transformers ``Cache`` (``UnsupportedCacheError``).
            ValueError: ``layout`` does not match ``[B, S]``; a cache with a sharded layout; a cache layer that
                is not linear attention; on the fused path, a sharded DTensor parameter.
        """
        B, S, _ = hidden_states.shape
        H, K = self.num_heads, self.head_dim
        if layout.batch_size != B or layout.seq_len != S:
            raise ValueError(f"layout is for [{layout.batch_size}, {layout.seq_len}] but hidden_states is "
                             f"[{B}, {S}, ...]")
        shard = layout.shard  # a part of longer rows (DocumentLayout.shard): the initial states come from it
        conv_state = recurrent_state = None
        recording = False
        if cache is not None:
            check_cache(cache, "Glm53FlashLinearAttention")
            if shard is not None:
                raise ValueError("a sharded layout (layout.shard) runs uncached forwards only; got a cache")
            conv_state = cache.get_conv_state(self.layer_idx)
            recurrent_state = cache.get_recurrent_state(self.layer_idx)
            recording = cache.is_recording_past(self.layer_idx)
            if recording and conv_state is not None:  # a recording layer keeps every input since the last crop
                conv_state = conv_state[..., -self.conv_kernel_size :]
                if conv_state.shape[-1] < self.conv_kernel_size:  # fewer inputs than W so far: zeros before them
                    conv_state = F.pad(conv_state, (self.conv_kernel_size - conv_state.shape[-1], 0))
        continuing = conv_state is not None and recurrent_state is not None
        # parameters read without their module's forward (accelerate offload hooks onload them here)
        fg = self.forget_gate
        conv_weight, gate = call_onloaded((self.conv1d, fg), lambda: (
            self.conv1d.weight[:, 0, :], dict(A_log=fg.A_log, dt_bias=fg.dt_bias, lower_bound=fg.lower_bound)))
        # one choice per op, from the tensors only (never from self.training: a checkpoint recompute replays it); the
        # head dim reaches the probe through dt_bias viewed [1, 1, H, K]
        backend, probe = requested_backend(self.config, "kda"), (hidden_states, gate["dt_bias"].view(1, 1, H, K))
        x = hidden_states if layout.trivial else hidden_states.masked_fill(~layout.valid[:, :, None], 0.0)
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = fg.gate_input(x)
        beta = self.b_proj(x)
        varlen = {}
        if cache is None and not layout.trivial:
            mixed, g, beta = (t.flatten(0, 1)[None] for t in (mixed, g, beta))
            varlen = {"cu_seqlens": layout.cu_seqlens}
        if shard is not None:
            conv_state = shard.conv_initial_state(mixed.view(B, S, self.conv_dim), self.conv_kernel_size,
                                                  layout.num_segments)
        y, conv_final = op_for(causal_conv1d_torch, backend, *probe)(
            mixed, conv_weight, activation=self.activation, initial_state=conv_state,
            output_final_state=cache is not None, **varlen)
        q, k, v = (z.reshape(*z.shape[:2], H, K) for z in y.split(self.qkv_dim, dim=-1))
        if continuing and (S == 1 or recording):  # token by token, every state to the cache while recording
            step = functools.partial(op_for(recurrent_kda_torch, backend, *probe), **gate)
            outs, states, state = [], [], recurrent_state
            for i in range(S):
                o_i, state = step(*(t[:, i : i + 1] for t in (q, k, v, g, beta)), initial_state=state,
                                  output_final_state=True)
                outs.append(o_i)
                states.append(state.float())
            o, history = torch.cat(outs, dim=1), ({"per_token_states": torch.stack(states)} if recording else {})
            self._store(cache, conv_final, mixed, state, history)
        elif shard is not None:
            chunk = op_for(chunk_kda_torch, backend, *probe)
            o = shard.chunk_kda(functools.partial(chunk, **gate), q, k, v, g, beta, cu_seqlens=layout.cu_seqlens,
                                gate=gate if chunk is not chunk_kda_torch else None)
        else:
            core = functools.partial(op_for(chunk_kda_torch, backend, *probe), **gate)
            o, final = core(q, k, v, g, beta, initial_state=recurrent_state, output_final_state=cache is not None,
                            **varlen)
            if cache is not None:
                history = {}
                if recording and S == 1:
                    history = {"per_token_states": final.float()[None]}
                elif recording:

                    def replay(j, core=core, inputs=(q, k, v, g, beta)):
                        prefix = (t[:, :j].contiguous() for t in inputs)
                        return core(*prefix, initial_state=None, output_final_state=True)[1].float()

                    history = {"replay": (S, replay)}
                self._store(cache, conv_final, mixed, final, history)
        normed = self.o_norm(o.reshape(B, S, H, K), self.g_b_proj(self.g_a_proj(x)).view(B, S, H, K), backend)
        return self.o_proj(normed.reshape(B, S, self.qkv_dim)), None, None

    def _store(self, cache, conv_final, conv_inputs, recurrent_final, history) -> None:
        # the call's conv inputs [B, D, S]: the cache layer keeps the last W (all of them while recording) and counts
        # S tokens (transformers >= 5.25 counts the width it receives as the tokens seen)
        conv_update = conv_inputs.transpose(1, 2).to(conv_final.dtype)
        cache.update_conv_state(conv_update, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
        cache.update_recurrent_state(recurrent_final.float(), self.layer_idx, **history)


def init_kda_weights(module: nn.Module, config) -> None:
    """Initialise the KDA-specific parameters of ``module`` (not recursive) with the draws of transformers'
    ``Glm5NextPreTrainedModel._init_weights``: the forget gate's ``A_log`` and ``dt_bias``, the gated norm's weight;
    other modules are left alone."""
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
