"""Block-scaled FP8 weights kept as FP8 in memory: transformers' ``FP8Linear`` / ``FP8Experts`` with a CPU-capable
forward (:func:`fp8_linear_block_rows` wherever transformers' ``finegrained-fp8`` kernel does not serve a weight)
and the quantizer that builds them. A weight ``W [out, in]`` is ``float8_e4m3fn`` with ``weight_scale_inv`` fp32
``[ceil(out/br), ceil(in/bc)]`` (``weight_block_size = [br, bc]``), ``W ≈ W_fp8 * scale_inv`` per block; a merged
``gate_up_proj [E, 2I, H]`` blocks gate and up separately (``[E, 2*ceil(I/br), ceil(H/bc)]``).
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
from torch import nn
from transformers.integrations.finegrained_fp8 import (
    ALL_FP8_EXPERTS_FUNCTIONS,
    FP8Experts,
    FP8Linear,
    _dequantize_fp8_weight,
    load_finegrained_fp8_kernel,
)
from transformers.integrations.moe import use_experts_implementation
from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
from transformers.utils import logging

from .graph_ops import no_autocast, to_autocast_dtype
from .moe_ops import clamped_swiglu

logger = logging.get_logger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
# Most elements of one dequantized tile (fp32: 16 MiB); a tile is at least one block row.
TILE_ELEMENTS = 1 << 22


def _row_groups(rows: int, scale_rows: int, block_rows: int) -> list[tuple[int, int, int]]:
    """``(row_start, row_end, scale_row_start)`` of a weight's blocked row groups: one, or two separately blocked
    halves (merged gate/up); ``ValueError`` when the scale grid fits neither."""
    if scale_rows == math.ceil(rows / block_rows):
        return [(0, rows, 0)]
    half = rows // 2
    if rows % 2 == 0 and scale_rows == 2 * math.ceil(half / block_rows):
        return [(0, half, 0), (half, rows, scale_rows // 2)]
    raise ValueError(
        f"weight_scale_inv with {scale_rows} rows does not tile an FP8 weight of {rows} rows in blocks of "
        f"{block_rows} rows (expected {math.ceil(rows / block_rows)}, or {2 * math.ceil(half / block_rows)} for "
        "separately blocked halves)"
    )


def _tiles(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    """``(row_start, row_end, weight_rows, scale_rows)`` tiles of whole block rows under :data:`TILE_ELEMENTS`."""
    rows, cols = weight.shape
    br = block[0]
    per_tile = max(1, TILE_ELEMENTS // max(1, cols * br))
    for start, end, s0 in _row_groups(rows, scale_inv.shape[0], br):
        for r0 in range(start, end, per_tile * br):
            r1 = min(end, r0 + per_tile * br)
            b0 = s0 + (r0 - start) // br
            b1 = s0 + math.ceil((r1 - start) / br)
            yield r0, r1, weight[r0:r1], scale_inv[b0:b1]


class _BlockRowsLinear(torch.autograd.Function):
    """``x @ dequantize(W).T`` tile by tile, with the input gradient computed tile by tile (frozen ``W``)."""

    @staticmethod
    @no_autocast
    def forward(ctx, x, weight, scale_inv, block):
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        for r0, r1, w, s in _tiles(weight, scale_inv, block):
            out[..., r0:r1] = x @ _dequantize_fp8_weight(w, s, list(block), x.dtype).T
        ctx.save_for_backward(weight, scale_inv)
        ctx.block = block
        return out

    @staticmethod
    @no_autocast
    def backward(ctx, grad_out):
        weight, scale_inv = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.new_zeros(*grad_out.shape[:-1], weight.shape[1])
            for r0, r1, w, s in _tiles(weight, scale_inv, ctx.block):
                grad_x += grad_out[..., r0:r1] @ _dequantize_fp8_weight(w, s, list(ctx.block), grad_out.dtype)
        return grad_x, None, None, None


def fp8_linear_block_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] | list[int],
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ (weight * scale_inv).T (+ bias)`` ``[..., out]`` in ``x.dtype`` (differentiable in ``x`` only) for
    ``x [..., in]``, ``weight [out, in]`` ``float8_e4m3fn`` dequantized one tile of block rows at a time,
    ``scale_inv`` fp32 ``[ceil(out/br), ceil(in/bc)]`` for ``block = (br, bc)`` (else read as two separately blocked
    halves: merged gate/up). Under autocast ``x`` is cast to the autocast dtype first (as autocast treats
    ``F.linear``), the tiles computed in it, forward and backward. ``ValueError`` when ``weight`` is not 2-D FP8 or
    ``scale_inv`` does not tile it."""
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight: expected a 2-D {FP8_DTYPE} tensor; got {weight.dtype} {tuple(weight.shape)}")
    if scale_inv.dim() != 2 or scale_inv.shape[1] != math.ceil(weight.shape[1] / block[1]):
        raise ValueError(
            f"scale_inv {tuple(scale_inv.shape)} does not tile weight {tuple(weight.shape)} in blocks {tuple(block)}"
        )
    (x,) = to_autocast_dtype(x)
    out = _BlockRowsLinear.apply(x, weight, scale_inv, tuple(block))
    return out if bias is None else out + bias.to(out.dtype)


_KERNEL_STATE: dict[str, bool] = {}


def _transformers_serves(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> bool:
    """A weight that is not FP8, or a CUDA one with a whole-block scale grid and the ``finegrained-fp8`` kernel
    loadable (else one warning, once)."""
    if weight.element_size() > 1:
        return True
    if not weight.is_cuda or block is None or scale_inv.shape[0] != math.ceil(weight.shape[0] / block[0]):
        return False
    if "cuda" not in _KERNEL_STATE:
        try:
            load_finegrained_fp8_kernel()
            _KERNEL_STATE["cuda"] = True
        except ImportError as err:
            logger.warning(f"transformers' FP8 kernel is unavailable ({err}); FP8 layers dequantize block rows")
            _KERNEL_STATE["cuda"] = False
    return _KERNEL_STATE["cuda"]


class Glm53FlashFP8Linear(FP8Linear):
    """transformers' ``FP8Linear`` (frozen block-scaled FP8 ``weight`` + ``weight_scale_inv``) whose forward falls
    back to :func:`fp8_linear_block_rows` where transformers' kernel does not serve the weight (CPU)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if _transformers_serves(self.weight, self.weight_scale_inv, self.block_size):
            return super().forward(input)
        return fp8_linear_block_rows(input, self.weight, self.weight_scale_inv, self.block_size, self.bias)


class _ExpertsConfigView:
    """Our text config read under the names transformers' ``FP8Experts.__init__`` looks up."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, "n_routed_experts" if name == "num_local_experts" else name)


@use_experts_implementation(experts_interface=ALL_FP8_EXPERTS_FUNCTIONS, has_gate=True)
class Glm53FlashFP8Experts(FP8Experts):
    """transformers' ``FP8Experts`` for our routed experts: ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` in
    FP8 with their ``*_scale_inv``; the gate is our clamped SwiGLU and each expert's projection falls back to
    :func:`fp8_linear_block_rows` where transformers' kernel does not serve it."""

    def __init__(self, config, block_size, activation_scheme="dynamic", scale_fmt="float"):
        super().__init__(
            _ExpertsConfigView(config), block_size=block_size, activation_scheme=activation_scheme,
            scale_fmt=scale_fmt, has_bias=False, has_gate=True,
        )  # fmt: skip
        self.config = config
        self.swiglu_limit = config.swiglu_limit

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return clamped_swiglu(gate, up, self.swiglu_limit)

    def _weight_and_delta(self, name: str):
        """``(fp8 weight [E, out, in], scale_inv, LoRA delta [E, out, in] or None)`` of projection ``name``, read
        apart under PEFT's ``target_parameters`` parametrization (which would round ``W + delta`` to e4m3)."""
        scale = getattr(self, name + "_scale_inv")
        if not nn.utils.parametrize.is_parametrized(self, name):
            return getattr(self, name), scale, None
        parametrization = self.parametrizations[name]
        deltas = []
        for proxy in parametrization:
            delta = getattr(proxy, "delta_weight", None)
            if delta is None:
                raise TypeError(
                    f"{name}: parametrization {type(proxy).__name__} has no delta_weight; an FP8 expert weight "
                    "takes LoRA adapters (PEFT's _LoraParameterProxy) only"
                )
            deltas.append(delta)
        return parametrization.original, scale, sum(deltas)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``: per expert hit, the FP8
        projections plus, under a LoRA adapter, ``x @ delta[e].T``; accumulated in fp32."""
        gate_up, gate_up_scale, gate_up_delta = self._weight_and_delta("gate_up_proj")
        down, down_scale, down_delta = self._weight_and_delta("down_proj")
        # gate and up are blocked separately; unless each is a whole number of block rows, their scale rows are no
        # block grid over the merged rows (and may have as many rows as one), so each half is projected on its own
        split = self.block_size is not None and (gate_up.shape[-2] // 2) % self.block_size[0] != 0

        def project(x, w, s, delta, e, halves=False):
            if halves:
                r, n = w.shape[-2] // 2, s.shape[-2] // 2
                y = torch.cat([self.linear(x, w[e, :r], s[e, :n]), self.linear(x, w[e, r:], s[e, n:])], dim=-1)
            else:
                y = self.linear(x, w[e], s[e])
            return y if delta is None else y + x @ delta[e].to(x.dtype).T

        out = torch.zeros_like(hidden_states, dtype=torch.float32)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:
                continue
            token_idx, pos = torch.where(top_k_index == e)
            x = hidden_states[token_idx]
            h = self._apply_gate(project(x, gate_up, gate_up_scale, gate_up_delta, e, split))
            y = project(h, down, down_scale, down_delta, e)
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, pos, None].to(y.dtype)).float())
        return out.to(hidden_states.dtype)

    def linear(self, input, weight, weight_scale_inv, activation_scale=None):
        if _transformers_serves(weight, weight_scale_inv, self.block_size):
            return super().linear(input, weight, weight_scale_inv, activation_scale=activation_scale)
        return fp8_linear_block_rows(input, weight, weight_scale_inv, self.block_size)


def fp8_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters and buffers by kind: ``fp8`` (FP8 weights), ``scales`` (their
    ``*_scale_inv``), ``other`` (everything else) and ``total``."""
    out = {"fp8": 0, "scales": 0, "other": 0}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        kind = "fp8" if t.dtype == FP8_DTYPE else "scales" if name.endswith("_scale_inv") else "other"
        out[kind] += t.numel() * t.element_size()
    out["total"] = sum(out.values())
    return out


def replace_with_fp8_modules(model: nn.Module, fp8_modules: set[str], modules_to_not_convert, quantization_config):
    """Swap, on the meta device, each ``nn.Linear`` / routed-experts module of ``model`` whose name ends with one of
    ``fp8_modules`` (relative to the text model, e.g. ``layers.2.self_attn.o_proj``) for :class:`Glm53FlashFP8Linear`
    / :class:`Glm53FlashFP8Experts`. Raises ``ValueError`` naming the modules when
    ``modules_to_not_convert`` excludes one whose weight is FP8."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    qc = quantization_config
    named = [(n, m) for n, m in model.named_modules() if any(n == f or n.endswith("." + f) for f in fp8_modules)]
    excluded = sorted(n for n, _ in named if not should_convert_module(n, modules_to_not_convert))
    if excluded:
        raise ValueError(
            f"quantization_config.modules_to_not_convert={modules_to_not_convert!r} excludes {len(excluded)} modules "
            f"whose weights the checkpoint stores in FP8 (e.g. {excluded[0]}); load with dequantize_fp8=True or "
            "correct the list"
        )
    for name, module in named:
        with torch.device("meta"):
            if type(module).__name__ == "Glm53FlashExperts":  # modeling_glm53flash's (which imports this module)
                new = Glm53FlashFP8Experts(
                    module.config, qc.weight_block_size, qc.activation_scheme, scale_fmt=qc.scale_fmt
                )
            elif type(module) is nn.Linear:
                new = Glm53FlashFP8Linear(
                    module.in_features, module.out_features, block_size=qc.weight_block_size,
                    activation_scheme=qc.activation_scheme, scale_fmt=qc.scale_fmt, has_bias=module.bias is not None,
                )  # fmt: skip
            else:
                continue
        new._hf_quantized_needs_local_tp = True
        model.set_submodule(name, new)


_LOAD = threading.local()
_LOAD_LOCK = threading.Lock()


class Glm53FlashFP8Quantizer(FineGrainedFP8HfQuantizer):
    """transformers' ``FineGrainedFP8HfQuantizer`` that keeps FP8 on every device (CPU included) and converts the
    modules :func:`fp8_quantizer_for_load` names (``modules_to_not_convert`` honoured)."""

    def validate_environment(self, *args, **kwargs):
        if self.quantization_config.dequantize or torch.cuda.is_available():
            return super().validate_environment(*args, **kwargs)
        from transformers.utils import is_accelerate_available

        if not is_accelerate_available():
            raise ImportError("Loading an FP8 quantized model requires accelerate (`pip install accelerate`)")

    def _process_model_before_weight_loading(self, model, **kwargs):
        if self.quantization_config.dequantize:
            return super()._process_model_before_weight_loading(model, **kwargs)
        self._normalize_modules_to_not_convert(model)
        self.modules_to_not_convert = self.get_modules_to_not_convert(
            model, self.quantization_config.modules_to_not_convert, model._keep_in_fp32_modules
        )
        replace_with_fp8_modules(
            model, getattr(_LOAD, "fp8_modules", set()), self.modules_to_not_convert, self.quantization_config
        )


@contextlib.contextmanager
def fp8_quantizer_for_load(fp8_modules: set[str]):
    """Make transformers build :class:`Glm53FlashFP8Quantizer` for ``quant_method="fp8"`` while the block runs
    (one load at a time: the block holds a lock), converting the modules named ``fp8_modules`` (see
    :func:`replace_with_fp8_modules`)."""
    from transformers.quantizers import auto

    with _LOAD_LOCK:
        previous = auto.AUTO_QUANTIZER_MAPPING["fp8"]
        auto.AUTO_QUANTIZER_MAPPING["fp8"] = Glm53FlashFP8Quantizer
        _LOAD.fp8_modules = set(fp8_modules)
        try:
            yield
        finally:
            auto.AUTO_QUANTIZER_MAPPING["fp8"] = previous
            _LOAD.fp8_modules = set()
