"""Accelerate as a user's own training loop calls it: ``Accelerator().prepare(model, optimizer, dataloader)``,
``accelerator.backward(loss)``, ``optimizer.step()``, on the model loaded from the tiny folder through
``AutoModelForCausalLM`` with ``trust_remote_code=True``. The oracle is the same loop in plain torch: bit-identical
losses and weights without mixed precision; with ``mixed_precision="bf16"`` the loss equals the plain loop under
``torch.autocast("cpu", dtype=torch.bfloat16)`` (accelerate wraps forward in that autocast). The multi-process
paths (FSDP2, EP, SP under ``accelerate launch``) are tested in test_fsdp2.py, test_expert_parallel.py and
test_sequence_parallel.py."""

from __future__ import annotations

import copy

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from transformers import AutoModelForCausalLM  # noqa: E402

from glm53flash_hf.tools.make_tiny import make_tiny  # noqa: E402

STEPS = 2


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = make_tiny(str(tmp_path_factory.mktemp("acc") / "tiny"), seed=0, show_progress=False)
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)


def _batches():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1990, (STEPS * 2, 24), generator=gen)
    return [{"input_ids": ids[i:i + 2], "labels": ids[i:i + 2].clone()} for i in range(0, len(ids), 2)]


def _plain(model, autocast: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in _batches():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _accelerated(model, mixed_precision: str):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(_batches(), batch_size=None, shuffle=False)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        losses = []
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return accelerator.unwrap_model(model), losses
    finally:  # accelerate keeps one process-wide state; the next Accelerator may ask for another precision
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_accelerator_loop_equals_plain_torch(base, mixed_precision):
    ref_model = copy.deepcopy(base).train()
    ref_losses = _plain(ref_model, autocast=mixed_precision == "bf16")
    model, losses = _accelerated(copy.deepcopy(base).train(), mixed_precision)
    assert losses == ref_losses
    assert losses[-1] != losses[0]  # the steps changed the model
    if mixed_precision == "bf16":  # autocast was on: the fp32 loop's first loss differs
        with torch.no_grad():
            assert base(**_batches()[0]).loss.item() != losses[0]
    ref_state = ref_model.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, ref_state[name]), name
