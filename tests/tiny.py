"""Shared tiny configurations, the transformers oracle, warning checks and the frame counter for the tests.

Every config here contains each layer kind the tests exercise: KDA, DSA with a ``full`` and a
``shared`` indexer layer, dense and MoE MLP, ``hc_mult=4``, ``index_kpool>1`` with a tail,
``index_topk`` well below the test sequence lengths, and ``n_group>1``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings

import torch
from _common import WIDE_TEXT, randomize_  # noqa: F401  (shared with the benchmark scripts)

PARITY_TEXT = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=5,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "dense"],
    indexer_types=["full", "full", "shared", "full", "full"],
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=0,
    v_head_dim=12,
    index_n_heads=8,  # 2 heads give exact score ties (relu zeros), making top-k selection ambiguous
    index_head_dim=16,
    index_topk=8,
    index_kpool=4,
    linear_num_heads=2,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    swiglu_limit=10.0,
    hc_mult=4,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    tie_word_embeddings=False,
)

TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=48,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    projection_intermediate_size=48,
)


def hf_reference(text_overrides: dict | None = None, seed: int = 0, top_overrides: dict | None = None):
    """transformers' built-in ``Glm5NextForConditionalGeneration`` (fp32, eager attention), randomised.

    ``top_overrides`` sets top-level config fields (e.g. the image/video special-token ids)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextForConditionalGeneration

    text = dict(PARITY_TEXT, **(text_overrides or {}))
    config = Glm5NextConfig(text_config=text, vision_config=TINY_VISION, **(top_overrides or {}))
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(config).float().eval()
    randomize_(model, seed)
    return model


def ours_from_hf_folder(folder, cls=None, **kwargs):
    """Load our text-only causal LM from a folder written by transformers' built-in class (file to file)."""
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    cls = cls or Glm53FlashForCausalLM
    return cls.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a-b| / max |b| (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    denom = b.abs().max().item()
    return (a - b).abs().max().item() / denom if denom > 0 else (a - b).abs().max().item()


FP32_U = 2.0**-24  # fp32 unit roundoff: one rounding moves a value by at most this fraction of it


def fp32_sum_tol(n: int, margin: float = 4.0) -> float:
    """Bound on :func:`rel_err` between two fp32 evaluations of the same sums of ``n`` terms in different orders.

    Each evaluation is within ``gamma_n * sum|terms|`` of the exact sum, ``gamma_n = n u / (1 - n u)``, ``u = 2**-24``,
    whatever the order or blocking (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1), so two
    differ by at most ``2 gamma_n sum|terms|``. Returns ``margin * 2 * gamma_n``; ``margin`` covers the ratio
    ``sum|terms| / max|result|`` (about 1 to 3 for the O(1) random data of these tests) and the few roundings around
    the sums (activations, casts).
    """
    gamma = n * FP32_U / (1 - n * FP32_U)
    return margin * 2 * gamma


def fp64_error_tol(fp32: torch.Tensor, fp64: torch.Tensor, margin: float = 4.0) -> float:
    """Bound on :func:`rel_err` against ``fp64`` of another fp32 evaluation (other order, other kernels) of the maths
    that gave ``fp32``: ``margin`` times the measured error ``rel_err(fp32, fp64)`` of this fp32 evaluation (at
    least ``margin * FP32_U``). Measured on the test's own data, it includes the amplification the maths applies to
    rounding (e.g. softmax logits of magnitude ``L`` turn their fp32 rounding into relative errors ``~L * u``)."""
    return margin * max(rel_err(fp32, fp64), FP32_U)


def drafty_(model, eps: float):
    """Scale the text layers' output projections by ``eps``; MTP ``eh_proj = [I | eps * W_h]``, ``enorm = 1``,
    ``shared_head.norm = norm`` (so the MTP layer's prediction at ``t`` ~ the main model's at ``t + 1``, and a
    model cropped to fewer layers predicts mostly as the whole one: drafts are both accepted and rejected)."""
    text = getattr(model.model, "language_model", model.model)
    n, d = text.config.num_hidden_layers, text.config.hidden_size
    with torch.no_grad():
        for name, p in text.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                p.mul_(eps)
        mtp = text.layers[n]
        mtp.eh_proj.weight[:, :d] = torch.eye(d)
        mtp.eh_proj.weight[:, d:] *= eps
        mtp.enorm.weight.fill_(1.0)
        mtp.shared_head.norm.weight.copy_(text.norm.weight)
    return model


def read_checkpoint_tensors(folder) -> dict:
    """Every tensor of a safetensors checkpoint folder (through its index, or ``model.safetensors``); a key stored
    twice fails the test."""
    import json
    import os

    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as f:
            for key in f.keys():
                assert key not in out, f"{key} stored twice"
                out[key] = f.get_tensor(key)
    return out


#: Warnings a load through PEFT's Auto classes may give that say nothing about the adapter: transformers'
#: deprecation of ``is_gradient_checkpointing`` (read by PEFT) and fla-core's CPU notice at its first import.
HARMLESS_WARNINGS = (r"`is_gradient_checkpointing` is deprecated", r"Triton is not supported on current platform")


@contextlib.contextmanager
def no_warnings():
    """Fail the test on any warning (``warnings.warn``, or a log record at WARNING or above of transformers, the
    remote code, PEFT or this package) raised in the block, except :data:`HARMLESS_WARNINGS`; PEFT reports missing /
    unexpected adapter keys only as a warning."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(f"{record.name}: {record.getMessage()}")

    handler = Collect(level=logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("transformers", "transformers_modules", "peft", "glm53flash_hf")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    records += [f"{w.category.__name__}: {w.message}" for w in caught]
    unexpected = [r for r in records if not any(re.search(pattern, r) for pattern in HARMLESS_WARNINGS)]
    assert not unexpected, "\n".join(r[:2000] for r in unexpected)


def package_frames_at(call, is_target) -> list[str]:
    """The package's own frames (qualified names, outermost first) on the stack when ``call()`` first enters a function
    whose code object ``is_target`` accepts (that function included if it is the package's), seen by
    ``sys.setprofile``. Frames of torch (module call, custom-op dispatch, autograd), transformers and tests are not
    counted."""
    import glm53flash_hf

    root = os.path.dirname(os.path.abspath(glm53flash_hf.__file__)) + os.sep
    stacks = []

    def profile(frame, event, arg):
        if event == "call" and not stacks and is_target(frame.f_code):
            codes = []
            while frame is not None:
                codes.append(frame.f_code)
                frame = frame.f_back
            stacks.append([c.co_qualname for c in reversed(codes) if c.co_filename.startswith(root)])

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    assert stacks, "the target function was not called"
    return stacks[0]


def frames_below_decoder_layer(is_target, fused_family: str | None = None) -> list[str]:
    """The package's frames below ``Glm53FlashDecoderLayer.forward`` when a prefill of the tiny model
    (:data:`PARITY_TEXT`, 12 tokens, no gradients) first enters a function ``is_target`` accepts; ``fused_family``
    takes that family's fused path (``dispatch.choose_backend`` answers "fused" for it, for the interpreter), the other
    families run on the torch path."""
    from glm53flash_hf import dispatch
    from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    config = Glm53FlashTextConfig(**PARITY_TEXT, kernels="torch")
    model = Glm53FlashForCausalLM(config).eval()
    randomize_(model, 0)
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    choose = dispatch.choose_backend
    if fused_family is not None:
        dispatch.choose_backend = lambda family, requested, *t: "fused" if family == fused_family else "torch"
    try:
        with torch.no_grad():
            frames = package_frames_at(lambda: model(input_ids=ids), is_target)
    finally:
        dispatch.choose_backend = choose
    return frames[frames.index("Glm53FlashDecoderLayer.forward") + 1:]
