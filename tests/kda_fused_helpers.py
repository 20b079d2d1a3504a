"""The KDA layer helpers of the kda_fused tests (tests/test_kda_fused_numerics.py, tests/test_kda_fused_dispatch.py):
a fused/torch pair of layers with the same weights, a layer's output and gradients, and a packed batch."""

from __future__ import annotations

import torch
from test_kda import random_init_, tiny_config

from glm53flash_hf.kda import Glm53FlashLinearAttention
from glm53flash_hf.packing import build_document_layout


def layer_pair(seed=0, **overrides):
    """Two layers with the same weights: ``kernels={"kda": "fused"}`` and ``{"kda": "torch"}``."""
    fused = Glm53FlashLinearAttention(tiny_config(kernels={"kda": "fused"}, **overrides), layer_idx=0)
    random_init_(fused, torch.Generator().manual_seed(seed))
    torch_layer = Glm53FlashLinearAttention(tiny_config(kernels={"kda": "torch"}, **overrides), layer_idx=0)
    torch_layer.load_state_dict(fused.state_dict(), strict=True)
    return fused, torch_layer


def layer_run(layer, x, layout, weight):
    """Output and gradients of (input, every parameter) for the loss ``sum(out * weight)``."""
    x = x.clone().requires_grad_()
    out = layer(x, layout)[0]
    names = ["hidden_states"] + [n for n, _ in layer.named_parameters()]
    grads = torch.autograd.grad((out * weight).sum(), [x] + [p for _, p in layer.named_parameters()])
    return out.detach(), dict(zip(names, grads))


def packed_batch(hidden, seed=0):
    """B=2, S=32: row 0 holds documents of 10 and 22 tokens (position_ids restart), row 1 three padding tokens then
    documents of 13 and 16 tokens: 5 segments, 64 tokens flattened."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 32, hidden, generator=gen)
    pos = torch.cat([torch.arange(10), torch.arange(22)]).unsqueeze(0)
    pos = torch.cat([pos, torch.cat([torch.zeros(3, dtype=torch.long), torch.arange(13), torch.arange(16)])[None]])
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :3] = 0
    layout = build_document_layout(2, 32, "cpu", attention_mask=mask, position_ids=pos)
    assert not layout.trivial and layout.num_segments == 5
    return x, layout
