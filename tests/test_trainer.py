"""HF Trainer integration: exact gradient accumulation through ``num_items_in_batch`` and the
aux-loss-free balancing callback (:class:`glm53flash_hf.train.trainer.AuxLossFreeBalancingCallback`), and the stop on
a non-finite training loss or gradient norm (the Trainer's NaN/inf logging filter would hide them)."""

from __future__ import annotations

import pytest
import torch
from shared_fixtures import INF, NAN
from tiny import fp32_sum_tol
from transformers import Trainer, TrainerCallback, TrainingArguments

from glm53flash_hf.configuration_glm53flash import Glm53FlashConfig
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM
from glm53flash_hf.tools.make_tiny import DEFAULT_CONFIG
from glm53flash_hf.train.trainer import AuxLossFreeBalancingCallback, Glm53FlashTrainer, find_routers

SEQ = 12


def _model() -> Glm53FlashForCausalLM:
    torch.manual_seed(0)
    return Glm53FlashForCausalLM(Glm53FlashConfig.from_json_file(DEFAULT_CONFIG))


def _rows():
    """Two rows of equal length with 11 and 4 supervised (shifted) targets."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 1900, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[1, : SEQ - 4] = -100
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(2)]


class _GradCapture(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _train(tmp_path, batch_size, accum, callbacks=(), rows=None, lr=0.0):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accum,
        learning_rate=lr,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=_model(), args=args, train_dataset=rows or _rows(), callbacks=list(callbacks))
    trainer.train()
    loss = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
    return trainer, loss


SPEED = 0.01


@pytest.fixture(scope="module")
def ga_run(tmp_path_factory):
    """One Trainer step with GA 2 (batch 1), capturing grads and running the balancing callback."""
    ga, cb = _GradCapture(), AuxLossFreeBalancingCallback(speed=SPEED)
    trainer, loss = _train(tmp_path_factory.mktemp("ga"), 1, 2, [ga, cb])
    return trainer, loss, ga, cb


def test_gradient_accumulation_equals_big_batch(tmp_path, ga_run):
    assert Glm53FlashForCausalLM.accepts_loss_kwargs
    _, loss_ga, ga, _ = ga_run
    big = _GradCapture()
    _, loss_big = _train(tmp_path / "big", 2, 1, [big])
    assert ga.grads.keys() == big.grads.keys() and len(big.grads) > 50
    # Claim: the same per-token gradients summed in another grouping (two micro-batches of one row vs one batch of
    # two, every GEMM with another row count): fp32 order only. An entry sums 2 * SEQ tokens' terms formed by GEMMs of
    # hidden_size products, fp32_sum_tol(hidden_size + 2 * SEQ) of the terms' scale; that scale is the largest
    # gradient, not each tensor's: cancelling entries (mHC scale, 2e-5 from far larger terms) sit far below it.
    hidden = Glm53FlashConfig.from_json_file(DEFAULT_CONFIG).get_text_config().hidden_size
    tol = fp32_sum_tol(hidden + 2 * SEQ) * max(g.abs().max().item() for g in big.grads.values())
    for n in big.grads:
        err = (ga.grads[n] - big.grads[n]).abs().max().item()
        assert err <= tol, (n, err, tol)
    # the logged loss: the same per-token losses summed in two groups
    assert abs(loss_ga - loss_big) <= fp32_sum_tol(2 * SEQ) * abs(loss_big)

    # negative control: averaging per-micro-batch mean losses (no num_items_in_batch) gives different gradients,
    # so the comparison above can detect a broken normalisation
    model = _model()
    rows = _rows()
    naive = 0.0
    for r in rows:
        naive = naive + model(input_ids=r["input_ids"][None], labels=r["labels"][None]).loss / 2
    naive.backward()
    diff = max((p.grad - big.grads[n]).abs().max().item() for n, p in model.named_parameters() if n in big.grads)
    assert diff > 1e-4


def test_balancing_callback_updates_bias(ga_run):
    speed = SPEED
    rows = _rows()
    # expected loads: same model, same data, bias 0, lr 0 -> identical routing in training mode
    model = _model().train()
    routers = find_routers(model)
    loads = {n: torch.zeros(r.e_score_correction_bias.numel()) for n, r in routers.items()}

    def counter(name):
        def hook(module, args, out):
            loads[name] += torch.bincount(out[2].reshape(-1), minlength=loads[name].numel())

        return hook

    handles = [r.register_forward_hook(counter(n)) for n, r in routers.items()]
    with torch.no_grad():
        for r in rows:  # GA 2: one micro-batch per row
            model(input_ids=r["input_ids"][None], labels=r["labels"][None])
    for h in handles:
        h.remove()

    trainer, _, _, cb = ga_run  # lr 0: the weights did not move, only the bias
    trained = find_routers(trainer.model)
    assert len(trained) == len(routers) == 6  # 5 sparse layers + the MTP layer
    signs_seen = set()
    for n, router in trained.items():
        torch.testing.assert_close(cb.last_loads[n], loads[n], rtol=0, atol=0)
        expected = speed * torch.sign(loads[n].mean() - loads[n])
        torch.testing.assert_close(router.e_score_correction_bias, expected, rtol=0, atol=0)
        signs_seen.update(torch.sign(expected).tolist())
    assert {-1.0, 1.0} <= signs_seen  # overloaded experts went down, underloaded went up
    assert not cb._handles  # hooks removed at train end


def test_balancing_callback_off_by_default():
    model = _model().train()
    cb = AuxLossFreeBalancingCallback()
    cb.on_train_begin(None, None, None, model=model)
    assert not cb._handles  # speed 0: no hooks
    r = _rows()[0]
    model(input_ids=r["input_ids"][None], labels=r["labels"][None])
    cb.on_step_end(None, None, None)
    for router in find_routers(model).values():
        assert torch.count_nonzero(router.e_score_correction_bias) == 0
    with pytest.raises(ValueError):
        AuxLossFreeBalancingCallback(speed=-1.0)
    with pytest.raises(ValueError):
        AuxLossFreeBalancingCallback(speed=0.1).attach(torch.nn.Linear(2, 2))


def test_sp_mesh_without_distributed_trainer_is_refused(tmp_path):
    """An SP mesh over several processes while the Trainer is not in distributed mode (``accelerate launch`` on CPU
    without ``ACCELERATE_USE_CPU=true``: each process would train alone, silently) raises, naming the mode and the fix.
    The mesh is a stand-in with ``size() == 2`` (this test has one process; only the check is exercised)."""
    from glm53flash_hf.train.trainer import Glm53FlashTrainer

    class TwoProcessMesh:
        def size(self):
            return 2

        def __getitem__(self, name):
            raise AssertionError("the check must refuse before the mesh is used")

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(ValueError, match=r"needs the Trainer in distributed mode.*ACCELERATE_USE_CPU=true"):
        Glm53FlashTrainer(model=_model(), args=args, train_dataset=_rows(), pad_token_id=0, sp_mesh=TwoProcessMesh())


# ------------------------------------------------------------------------------------------------ non-finite training


def _trainer(tmp_path, lr, steps):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=steps,
                             per_device_train_batch_size=2, learning_rate=lr, lr_scheduler_type="constant",
                             logging_steps=10, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                             seed=0)
    assert args.logging_nan_inf_filter  # the Trainer's filter would log a NaN loss as the mean of earlier ones
    return Glm53FlashTrainer(model=_model(), args=args, train_dataset=_rows(), pad_token_id=0)


def test_trainer_stops_on_non_finite_loss(tmp_path):
    """lr = inf: step 1 is finite and turns the weights into NaN, so the raw loss of step 2 is NaN."""
    trainer = _trainer(tmp_path, INF, 3)
    with pytest.raises(FloatingPointError, match=r"non-finite training loss nan at step 2 "):
        trainer.train()
    assert trainer.state.global_step == 1


def test_trainer_stops_on_non_finite_grad_norm(tmp_path):
    """A finite loss with a NaN gradient (a hook on one weight): the gradient norm of step 1 is NaN."""
    trainer = _trainer(tmp_path, 1e-3, 3)
    weight = trainer.model.get_input_embeddings().weight
    weight.register_hook(lambda grad: torch.full_like(grad, NAN))
    with pytest.raises(FloatingPointError, match=r"non-finite gradient norm nan at step 1 \(before clipping\)"):
        trainer.train()

