"""``torch.compile(model, fullgraph=True)`` of the causal LM and the VL model: compiled equals eager.

Model: ``configuration/tiny.json`` cut to three main layers (KDA, full and shared DSA, dense and MoE MLP, mHC, the
MTP layer, a vision tower), randomised, fp32. Each case runs the eager model, then the compiled one (inductor,
``fullgraph=True``, so any graph break fails the test), and compares the loss (relative, 1e-5) and every parameter
gradient (``torch.testing.assert_close(rtol=1e-5, atol=1e-5)``: the compiled graph sums in other fp32 orders, and a
few small gradients that are sums of cancelling terms, e.g. ``A_log``'s, move by the rounding of their larger terms,
hence the absolute part). Inputs: plain text, packed documents (``position_ids`` restarting, and ``cu_seq_lens_q``),
a left-padded batch, an image prompt, the MTP loss (on in every case with labels) and gradient checkpointing. Dynamic
shapes: one compile serves three sequence lengths (the compile counter must stay at one frame).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from ckpt_fixtures import tiny_config
from tiny import WIDE_TEXT, randomize_, rel_err

from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM, Glm53FlashForConditionalGeneration

TOL = 1e-5
IMG, BOI, EOI = 2016, 2010, 2011  # tiny.json special tokens
PATCH_DIM = 3 * 2 * 14 * 14


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# tiny.json cut to three main layers that keep every layer kind (KDA, DSA with its own and with a shared indexer,
# dense and MoE MLP) plus the MTP layer: compiling is the slow part of these tests
THREE_LAYERS = dict(
    num_hidden_layers=3,
    layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    indexer_types=["full", "full", "shared"],
)


def _model(cls=Glm53FlashForCausalLM, seed=0):
    torch.manual_seed(seed)
    model = cls(tiny_config(**THREE_LAYERS)).float()
    randomize_(model, seed)
    return model.train()


def _loss_and_grads(model, batch, params_of=None):
    """The loss output and ``{name: grad}`` of ``params_of`` (default ``model``; a compiled wrapper shares the
    parameters of the model it wraps)."""
    owner = params_of if params_of is not None else model
    owner.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in owner.named_parameters() if p.grad is not None}
    return out, grads


def _assert_compiled_equals_eager(model, batch, **compile_kwargs):
    ref_out, ref = _loss_and_grads(model, batch)
    compiled = torch.compile(model, fullgraph=True, **compile_kwargs)
    out, got = _loss_and_grads(compiled, batch, params_of=model)
    assert ref_out.mtp_loss is not None and out.mtp_loss is not None
    assert rel_err(out.loss, ref_out.loss) < TOL, (out.loss, ref_out.loss)
    assert rel_err(out.mtp_loss, ref_out.mtp_loss) < TOL
    assert got.keys() == ref.keys() and len(ref) > 80  # all but the frozen indexers
    _assert_grads_close(got, ref)
    return out


def _assert_grads_close(got, ref):
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")


def _text_batch(batch=2, seq=40, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 2000, (batch, seq), generator=gen)
    return dict(input_ids=ids, labels=ids.clone())


def test_compiled_text_equals_eager():
    assert Glm53FlashForCausalLM._can_compile_fullgraph and Glm53FlashForConditionalGeneration._can_compile_fullgraph
    _assert_compiled_equals_eager(_model(), _text_batch(), dynamic=False)


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens_q"])
def test_compiled_packed_documents_equal_eager(how):
    lens = [9, 1, 14, 6, 10]
    batch = _text_batch(1, sum(lens), seed=2)
    starts = torch.tensor([0, 9, 10, 24, 30])
    batch["labels"][0, starts] = -100
    if how == "position_ids":
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lens])[None]
    else:
        batch["cu_seq_lens_q"] = torch.tensor([0, 9, 10, 24, 30, 40], dtype=torch.int32)
    _assert_compiled_equals_eager(_model(), batch, dynamic=False)


def test_compiled_left_padded_batch_equals_eager():
    batch = _text_batch(2, 36, seed=3)
    mask = torch.ones(2, 36, dtype=torch.long)
    mask[1, :11] = 0
    batch["attention_mask"] = mask
    batch["labels"][1, :11] = -100
    _assert_compiled_equals_eager(_model(), batch, dynamic=False)


def test_compiled_image_prompt_equals_eager():
    gen = torch.Generator().manual_seed(4)
    grid = torch.tensor([[1, 4, 4]])
    ids = torch.cat([torch.randint(1, 2000, (7,), generator=gen), torch.tensor([BOI] + [IMG] * 4 + [EOI]),
                     torch.randint(1, 2000, (12,), generator=gen)])[None]
    batch = dict(input_ids=ids, labels=ids.clone(), image_grid_thw=grid,
                 pixel_values=torch.randn(int(grid.prod()), PATCH_DIM, generator=gen))
    _assert_compiled_equals_eager(_model(Glm53FlashForConditionalGeneration), batch, dynamic=False)


def test_compiled_gradient_checkpointing_equals_eager():
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lens = [12, 20]
    batch = _text_batch(1, sum(lens), seed=5)
    batch["position_ids"] = torch.cat([torch.arange(n) for n in lens])[None]
    _assert_compiled_equals_eager(model, batch, dynamic=False)


def test_dynamic_lengths_compile_once():
    """``dynamic=True``: three sequence lengths, one compiled frame (dynamo's guards, the same for any backend;
    ``aot_eager`` keeps the test short, the inductor numerics are checked above)."""
    model = _model()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    frames = None
    for seq in (24, 40, 56):
        batch = _text_batch(2, seq, seed=seq)
        ref_out, ref = _loss_and_grads(model, batch)
        out, got = _loss_and_grads(compiled, batch, params_of=model)
        assert rel_err(out.loss, ref_out.loss) < TOL
        _assert_grads_close(got, ref)
        frames = counter.frame_count if frames is None else frames
        assert counter.frame_count == frames, f"recompiled for S={seq}: {counter.frame_count} frames, was {frames}"


@pytest.mark.parametrize("left_padded", [True, False])
def test_compiled_static_cache_generate_equals_eager(left_padded):
    """``generate(cache_implementation="static")`` with the forward compiled (``fullgraph=True``; on CPU
    transformers does not compile by itself) gives the eager model's greedy tokens, on a left-padded batch (generate
    passes the mask: the past length is its width) and on an unpadded prompt (generate drops the all-ones mask: the
    past length is the static cache's length tensor)."""
    model = _model().eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 2000
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(1, 2000, (2 if left_padded else 1, 13), generator=gen)
    mask = torch.ones_like(ids)
    if left_padded:
        mask[1, :5] = 0
        ids[1, :5] = 2000
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        eager = model.generate(ids, **kwargs)
        model.forward = torch.compile(model.forward, fullgraph=True)
        compiled = model.generate(ids, **kwargs)
    assert compiled.shape == eager.shape == (ids.shape[0], 19)
    assert torch.equal(compiled, eager)



# the benchmark's wide config (scripts/bench_cpu.py WIDE_TEXT) cut to one KDA layer with the MoE MLP
WIDE_MOE_LAYER = dict(
    WIDE_TEXT, num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["sparse"],
    indexer_types=["full"], num_nextn_predict_layers=0,
)


def test_compiled_moe_layer_equals_eager():
    """One KDA layer with the MoE MLP (hidden 256, 8 experts, top 2), fp32, 64 tokens: the shape where inductor's CPU
    fusion scheduled the readers of the experts' ``zeros`` + ``index_add_`` combine before the scatter into it
    (the compiled forward came out ~1.0 relative wrong, only when the loss was traced with it); the torch experts
    path now moves rows by gathers only (``moe_ops.PermuteRows``)."""
    from glm53flash_hf.configuration_glm53flash import Glm53FlashTextConfig

    torch.manual_seed(0)
    model = Glm53FlashForCausalLM(Glm53FlashTextConfig(**WIDE_MOE_LAYER)).float()
    randomize_(model, 0, std=0.04)
    model.train()
    ids = torch.randint(1, 1024, (1, 64), generator=torch.Generator().manual_seed(1))
    batch = dict(input_ids=ids, labels=ids.clone())
    ref_out, ref = _loss_and_grads(model, batch)
    out, got = _loss_and_grads(torch.compile(model, fullgraph=True, dynamic=False), batch, params_of=model)
    assert rel_err(out.logits, ref_out.logits) < TOL
    assert rel_err(out.loss, ref_out.loss) < TOL, (out.loss, ref_out.loss)
    assert got.keys() == ref.keys()
    _assert_grads_close(got, ref)
