"""The causal-LM head's label conventions (:mod:`glm53flash_hf.modeling_glm53flash`): no supervised token gives a
zero loss and MTP loss with zero gradients, and transformers' row-wise ``shift_labels`` of packed rows give the loss
and MTP targets of ``labels`` alone.

Oracles: the documented values (0.0, zero gradients), the same call with ``labels`` only, and the MTP targets made
from ``labels``. Tiny model (``configuration/tiny.json``, randomised).
"""

from __future__ import annotations

import pytest
import shared_fixtures
import torch
from shared_fixtures import IDS

random_lm = shared_fixtures.random_lm  # fixture


# ------------------------------------------------------------------------------------------------ loss


def test_all_ignored_labels_give_zero_loss_and_zero_mtp_loss(random_lm):
    """The documented convention: no supervised token -> loss 0.0 and mtp_loss 0.0 with zero (finite) gradients,
    for the mean reduction and with num_items_in_batch; a normal batch is unchanged (negative control)."""
    labels = torch.full_like(IDS, -100)
    random_lm.zero_grad()
    out = random_lm(input_ids=IDS, labels=labels)
    assert out.loss.item() == 0.0 and out.mtp_loss.item() == 0.0
    out.loss.backward()
    grads = [p.grad for p in random_lm.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and not g.any() for g in grads)
    random_lm.zero_grad()
    out = random_lm(input_ids=IDS, labels=labels, num_items_in_batch=torch.tensor(7))
    assert out.loss.item() == 0.0 and out.mtp_loss.item() == 0.0
    out = random_lm(input_ids=IDS, labels=IDS)
    assert out.loss.item() > 1.0 and torch.isfinite(out.loss)



# ------------------------------------------------------------------------------------------------ label conventions


def _packed():
    ids = torch.randint(0, 2000, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in (7, 1, 10, 6)]).expand(2, -1)
    return ids, pos


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_mtp_targets_from_row_shifted_labels_stay_in_the_document(depth):
    """transformers' row-wise ``shift_labels`` of ``labels = input_ids`` hold each document's first token at the
    previous document's last position: the MTP targets made from them equal those made from ``labels`` (targets
    inside each document only), for every depth."""
    from glm53flash_hf.mtp import mtp_targets
    from glm53flash_hf.packing import build_document_layout

    ids, pos = _packed()
    layout = build_document_layout(2, 24, "cpu", position_ids=pos)
    shift = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    expect = mtp_targets(ids, layout, depth)
    assert torch.equal(mtp_targets(shift, layout, depth, shifted=True), expect)
    assert (expect != -100).sum() == sum(max(n - 1 - depth, 0) for n in (7, 1, 10, 6)) * 2


def test_shift_labels_given_equal_labels_only(random_lm):
    """The head with ``labels`` and transformers' row-wise ``shift_labels`` gives the loss and MTP loss of
    ``labels`` alone (packed rows, ``labels = input_ids``)."""
    ids, pos = _packed()
    shift = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    with torch.no_grad():
        alone = random_lm(input_ids=ids, position_ids=pos, labels=ids)
        given = random_lm(input_ids=ids, position_ids=pos, labels=ids, shift_labels=shift)
    assert given.mtp_loss.item() == alone.mtp_loss.item() and given.loss.item() == alone.loss.item()

