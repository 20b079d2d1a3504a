"""TRL's trainers on the tiny checkpoint, loaded as a user loads it (``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)``, the tokenizer / processor from the folder), with the trainers' default configs plus what a
CPU run without network needs (``CPU``).

Shown: SFTTrainer (default, ``packing``, ``padding_free``, ``assistant_only_loss``, ``peft_config``), DPOTrainer and
GRPOTrainer (no vLLM, a Python reward) run; one SFT step's gradients, the MTP layer's included, equal those of our own
``out.loss.backward()`` on the same micro-batches; the labels TRL builds for a 2-turn conversation supervise each
answer and its end-of-turn token, as ``build_sft_example``; a packed (or padding-free) document's log-probabilities
under TRL's fused head equal the document's alone; DPO and GRPO warn at their start that the MTP layer is not trained.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer, TrainerCallback  # noqa: E402

from glm53flash_hf.tools.make_tiny import make_tiny  # noqa: E402
from glm53flash_hf.train.sft import build_sft_example  # noqa: E402

# A CPU run without network: TRL's defaults otherwise. bf16=False: TRL's default bf16=True is autocast, which the
# package's mixed-precision support covers (tests of their own); fp32 keeps the gradient comparisons exact.
CPU = dict(use_cpu=True, report_to=[], bf16=False, save_strategy="no", logging_steps=1, dataloader_num_workers=0)


def conversation(i: int) -> list[dict]:
    return [
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}, {'quite ' * (i % 4)}sure."},
        {"role": "user", "content": "And twice that?"},
        {"role": "assistant", "content": f"{4 * i}."},
    ]


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """The trainers' ``output_dir="out"`` inside the test's temporary folder."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(str(tmp_path_factory.mktemp("trl") / "tiny"), show_progress=False)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def chats():
    return datasets.Dataset.from_list([{"messages": conversation(i)} for i in range(8)])


def load(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)


def mtp_names(model) -> list[str]:
    layer = f"layers.{model.config.get_text_config().num_hidden_layers}."
    return [n for n, _ in model.named_parameters() if layer in n]


class _Recorder(TrainerCallback):
    """Each micro-batch the model gets (a forward pre-hook) and the gradients before the optimizer step."""

    def __init__(self, model):
        self.batches, self.grads = [], {}
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if kwargs.get("fused_lm_head") and module.training:
            self.batches.append({k: v.detach().clone() for k, v in kwargs.items() if torch.is_tensor(v)})

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def own_loss_grads(model, batches, grad_accum: int) -> dict[str, torch.Tensor]:
    """Gradients of our own forward's ``out.loss`` summed over ``batches`` with the step's ``num_items_in_batch``
    (as transformers' Trainer counts it). TRL averages the per-micro-batch router aux loss over the accumulation
    steps; our loss (as transformers' MoE models) adds it per micro-batch, so that difference is taken out."""
    count = sum(int((b["labels"][..., 1:] != -100).sum()) for b in batches)
    text = model.config.get_text_config()
    model.train()
    for batch in batches:
        out = model(**batch, num_items_in_batch=torch.tensor(count), output_router_logits=True)
        assert out.mtp_loss is not None and out.aux_loss is not None
        (out.loss - (1 - 1 / grad_accum) * text.router_aux_loss_coef * out.aux_loss).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: dict, want: dict, names) -> float:
    """Per parameter ``max |got - want| / max |want|``; every parameter with a gradient in ``want`` has one in
    ``got``. Returns the worst."""
    worst = 0.0
    for name in names:
        w = want.get(name)
        if w is None or not w.abs().max() > 0:
            assert name not in got or not got[name].abs().max() > 0, name
            continue
        assert name in got, f"{name}: no gradient from the TRL step"
        worst = max(worst, float((got[name] - w).abs().max() / w.abs().max()))
    assert worst < 2e-5, worst
    return worst


def sft_step(model, tokenizer, dataset, peft_config=None, **config):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir="out", max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_grad_norm=0.0, **CPU, **config)  # fmt: skip
    recorder = _Recorder(model)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[recorder], peft_config=peft_config)  # fmt: skip
    return trainer, recorder


@pytest.mark.parametrize("layout", ["padded", "packing"])
def test_sft_step_gradients_equal_own_loss(folder, tokenizer, chats, layout):
    """One SFTTrainer step (gradient accumulation 2, TRL's default gradient checkpointing; no clipping, so the
    gradients are the loss's) gives every parameter, the MTP layer's included, the gradient of our own loss on the
    same micro-batches: TRL's fused LM head loss plus ``mtp_loss_weight * mtp_loss``."""
    model = load(folder, dtype=torch.float32)
    reference = copy.deepcopy(model)
    dataset = chats.select(range(4)) if layout == "packing" else chats  # one packed row of 4 conversations
    trainer, recorder = sft_step(model, tokenizer, dataset, packing=layout == "packing")
    trainer.train()
    assert len(recorder.batches) == (1 if layout == "packing" else 2)
    want = own_loss_grads(reference, recorder.batches, len(recorder.batches))
    names = [n for n, _ in reference.named_parameters()]
    assert_same_grads(recorder.grads, want, names)
    # the MTP layer is trained: all of its parameters but the KPool indexer's, which no loss trains (its top-k
    # selection is not differentiable; the main layers' indexers alike)
    trained = [n for n in mtp_names(reference) if n in recorder.grads and recorder.grads[n].abs().max() > 0]
    assert trained == [n for n in mtp_names(reference) if ".indexer." not in n] and len(trained) == 19


def test_sft_peft_gradients_equal_own_loss(folder, tokenizer, chats):
    """``peft_config=``: TRL wraps the model in PEFT; the LoRA weights of every layer, the MTP layer's included, get
    the gradients of our own loss through the same PEFT model."""
    from peft import LoraConfig

    model = load(folder, dtype=torch.float32)
    base = copy.deepcopy(model)
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer, recorder = sft_step(model, tokenizer, chats, peft_config=config)
    from peft import get_peft_model

    reference = get_peft_model(base, config)
    reference.load_state_dict(trainer.model.state_dict())
    with torch.no_grad():  # B = 0 at init gives A no gradient: make both nonzero, the same in both models
        g = torch.Generator().manual_seed(0)
        for (name, p), (_, q) in zip(trainer.model.named_parameters(), reference.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                q.copy_(p)
    trainer.train()
    want = own_loss_grads(reference, recorder.batches, len(recorder.batches))
    lora = [n for n, p in reference.named_parameters() if p.requires_grad]
    assert lora and not any(recorder.grads.get(n) is not None for n, p in reference.named_parameters()
                            if not p.requires_grad)  # fmt: skip
    assert_same_grads(recorder.grads, want, lora)
    layer = f"layers.{reference.config.get_text_config().num_hidden_layers}."
    assert any(layer in n and recorder.grads[n].abs().max() > 0 for n in lora if n in recorder.grads)


def test_sft_default_config_trains(folder, tokenizer, chats):
    """SFTTrainer with its defaults on the model as loaded (bf16 weights, TRL's MoE aux loss on): two steps, finite
    losses, the aux loss logged (TRL reads ``config.num_experts``), the MTP layer trained (19 of its 26 parameters
    get gradients, as from our own loss: all but the indexer's) and changed."""
    from trl import SFTConfig, SFTTrainer

    model = load(folder)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    recorder = _Recorder(model)
    args = SFTConfig(output_dir="out", max_steps=2, per_device_train_batch_size=2, **CPU)
    trainer = SFTTrainer(model=model, args=args, train_dataset=chats, processing_class=tokenizer,
                         callbacks=[recorder])  # fmt: skip
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in logs)
    assert all(e["aux_loss"] > 0 for e in logs)
    names = mtp_names(model)
    assert len([n for n in names if n in recorder.grads and recorder.grads[n].abs().max() > 0]) == 19
    assert any(not torch.equal(before[n], model.get_parameter(n)) for n in names)


@pytest.mark.parametrize("assistant_only_loss", [False, True])
def test_sft_labels_train_every_end_of_turn(folder, tokenizer, assistant_only_loss):
    """The labels TRL builds for a 2-turn conversation supervise each answer and the token that ends it (the
    ``<|user|>`` that opens the next turn, ``<|endoftext|>`` after the last answer: the release's rules, one of the
    eos ids of generation_config); with ``assistant_only_loss`` exactly ``build_sft_example``'s, otherwise every
    token. Then a training step runs."""
    from trl import SFTConfig, SFTTrainer

    messages = conversation(3)
    dataset = datasets.Dataset.from_list([{"messages": messages}] * 2)
    args = SFTConfig(output_dir="out", max_steps=1, per_device_train_batch_size=2,
                     assistant_only_loss=assistant_only_loss, **CPU)  # fmt: skip
    trainer = SFTTrainer(model=load(folder), args=args, train_dataset=dataset, processing_class=tokenizer)
    row = trainer.train_dataset[0]
    ids, labels = row["input_ids"], row["labels"]
    ours = build_sft_example(AutoProcessor.from_pretrained(folder, trust_remote_code=True), messages)
    assert ids == ours["input_ids"].tolist()
    end_of_text, user = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>"])
    assert ids[-1] == end_of_text and labels[-1] == end_of_text
    assert end_of_text in trainer.model.generation_config.eos_token_id
    assert user in trainer.model.generation_config.eos_token_id
    if assistant_only_loss:
        assert labels == ours["labels"].tolist()
        assert trained_runs(tokenizer, labels) == ["</think>It is 6, quite quite quite sure.<|user|>",
                                                    "</think>12.<|endoftext|>"]  # fmt: skip
    else:
        assert labels == ids
    trainer.train()


def trained_runs(tokenizer, labels) -> list[str]:
    """The decoded maximal runs of supervised labels."""
    runs, current = [], []
    for label in labels + [-100]:
        if label != -100:
            current.append(label)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def _fused_log_probs(model, **inputs):
    with torch.no_grad():
        return model(**inputs, fused_lm_head=True).log_probs[0]


@pytest.mark.parametrize("mode", ["packing", "padding_free"])
def test_packed_documents_stay_isolated(folder, tokenizer, chats, mode):
    """TRL's ``packing=True`` (BFD, one row per batch) and ``padding_free=True`` rows: each document's per-token
    log-probabilities under TRL's fused head equal those of the document run alone."""
    from trl import SFTConfig, SFTTrainer

    model = load(folder, dtype=torch.float32)
    config = dict(packing=True) if mode == "packing" else dict(padding_free=True, max_length=None)
    args = SFTConfig(output_dir="out", per_device_train_batch_size=4, **CPU, **config)
    trainer = SFTTrainer(model=model, args=args, train_dataset=chats, processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "position_ids" in batch and "attention_mask" not in batch
    model.eval()
    packed = _fused_log_probs(model, **batch)
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
    assert len(starts) >= 4
    worst = 0.0
    for start, end in zip(starts[:-1], starts[1:]):
        ids = batch["input_ids"][:, start:end]
        alone = _fused_log_probs(model, input_ids=ids, labels=ids)
        worst = max(worst, float((packed[start:end - 1] - alone).abs().max()))
    assert worst < 1e-5, worst


def test_dpo_default_config(folder, tokenizer):
    """DPOTrainer, default config (``trust_remote_code=True``, else TRL builds its reference model from the folder
    with transformers' built-in glm5_next): one step; chosen / rejected end with the closing <|endoftext|>; the start
    warns that the MTP layer is not trained (DPO's loss is not the LM loss), and it is not changed."""
    from trl import DPOConfig, DPOTrainer

    dataset = datasets.Dataset.from_list([
        {"prompt": [{"role": "user", "content": f"Say {i}."}], "chosen": [{"role": "assistant", "content": f"{i}."}],
         "rejected": [{"role": "assistant", "content": "No."}]} for i in range(4)
    ])  # fmt: skip
    model = load(folder)
    args = DPOConfig(output_dir="out", max_steps=1, per_device_train_batch_size=2, trust_remote_code=True, **CPU)
    with pytest.warns(UserWarning, match=r"'dpo' trainer .* MTP layer \(layers\.6"):
        trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    assert type(trainer.ref_model).__module__ == type(model).__module__  # not transformers' built-in glm5_next
    assert tokenizer.decode(trainer.train_dataset[0]["chosen_ids"]).endswith("0.<|endoftext|>")
    mtp = {n: model.get_parameter(n).detach().clone() for n in mtp_names(model)}
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))
    assert all(torch.equal(p, model.get_parameter(n)) for n, p in mtp.items())


def test_grpo_default_config(folder, tokenizer):
    """GRPOTrainer, default config without vLLM (transformers' generate), a Python reward function, short completions:
    one step; the start warns that the MTP layer is not trained."""
    from trl import GRPOConfig, GRPOTrainer

    dataset = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": f"Count to {i}."}]}
                                          for i in range(4)])  # fmt: skip

    def reward_length(completions, **kwargs):
        return [float(len(c[0]["content"])) for c in completions]

    args = GRPOConfig(output_dir="out", max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, **CPU)  # fmt: skip
    with pytest.warns(UserWarning, match=r"'grpo' trainer .* MTP layer"):
        trainer = GRPOTrainer(model=load(folder), reward_funcs=reward_length, args=args, train_dataset=dataset,
                              processing_class=tokenizer)  # fmt: skip
    trainer.train()
    log = trainer.state.log_history[0]
    assert torch.isfinite(torch.tensor(log["loss"])) and log["completions/mean_length"] > 0


def test_fused_head_outside_sft_warns_and_leaves_mtp_out(folder):
    """Without an SFT trainer's tag a fused-head training call keeps TRL's output as it is, with one warning."""
    from trl.trainer.utils import add_fused_lm_head

    model = load(folder, dtype=torch.float32).train()
    add_fused_lm_head(model)
    ids = torch.randint(0, 1900, (1, 12))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert [str(w.message) for w in caught if "MTP layer" in str(w.message)] == [
        "fused_lm_head=True outside TRL's SFTTrainer: the loss made of the returned log_probs is not known to be "
        "the LM loss, so the MTP layer is not trained by it"
    ]
    assert "mtp_loss" not in out
    out.loss.backward()
    assert all(model.get_parameter(n).grad is None for n in mtp_names(model))


@pytest.mark.parametrize("auto_class", ["AutoModelForCausalLM", "AutoModelForImageTextToText"])
def test_fused_head_loss_carries_mtp_loss(folder, auto_class):
    """Both heads under TRL's fused LM head, tagged by an SFT trainer: TRL's SFT loss ``-sum(log_probs) / N`` has
    our own ``out.loss`` gradients (``num_items_in_batch=N``; right padding, two rows), while ``log_probs`` and the
    head's own ``loss`` keep their values and the output reports our ``mtp_loss``."""
    import transformers
    from trl.trainer.utils import add_fused_lm_head

    model = getattr(transformers, auto_class).from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    reference = copy.deepcopy(model).train()
    model.train().add_model_tags(["trl", "sft"])
    add_fused_lm_head(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1900, (2, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    count = torch.tensor(int((labels[:, 1:] != -100).sum()))
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    (-out.log_probs.sum() / count).backward()
    ours = reference(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=count)
    ours.loss.backward()
    with torch.no_grad():
        plain = reference(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=count, mtp=False)
    assert abs(float(out.mtp_loss) - float(ours.mtp_loss)) < 1e-5
    assert abs(float(out.loss) - float(plain.loss)) < 1e-5  # the fused head's loss value: the main loss alone
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert_same_grads(got, want, [n for n, _ in reference.named_parameters()])
    assert all(n in got for n in mtp_names(reference) if ".indexer." not in n)
