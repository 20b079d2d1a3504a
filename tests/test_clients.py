"""The clients people evaluate and generate with, called as a user calls them, on a folder the package writes:
lm-eval's ``HFLM`` (``loglikelihood`` and ``generate_until`` at batch sizes 1 and 4, checked against the model's own
logits and ``generate``; ``simple_evaluate`` on a local task), transformers' pipelines (``text-generation`` with text
and chat input, ``image-text-to-text``), streamers, beam search, ``num_return_sequences``, ``stop_strings``,
left-padded batched greedy and ``DataCollatorWithFlattening``. Each is compared with an independent computation on
the same weights, never with itself."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    DataCollatorWithFlattening,
    TextIteratorStreamer,
    TextStreamer,
    pipeline,
)

from glm53flash_hf.tools.make_tiny import make_tiny

PROMPTS = ["The river Danube flows", "Once upon a time", "def fibonacci(n):", "Paris is the capital of"]
NEW = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(str(tmp_path_factory.mktemp("clients") / "tiny"), seed=0, show_progress=False)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=True)


@pytest.fixture(scope="module")
def model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()


def greedy(model, tokenizer, text: str, new: int = NEW) -> torch.Tensor:
    """The new token ids of greedy ``generate`` on ``text`` alone (no padding), ``[new]`` int64."""
    ids = tokenizer(text, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, ids["input_ids"].shape[1]:]


def own_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of log p(continuation | context) and whether every continuation token is the argmax, from the model's own
    logits in float64 (the quantity lm-eval's ``loglikelihood`` reports)."""
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    cont = tokenizer(context + continuation, add_special_tokens=False)["input_ids"][len(ctx):]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(ctx) - 1:-1].double()
    logp = logits.log_softmax(-1)
    target = torch.tensor(cont)
    return float(logp.gather(-1, target[:, None]).sum()), bool((logits.argmax(-1) == target).all())


# --- lm-eval ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hflm_pair(folder):
    lm_eval = pytest.importorskip("lm_eval")
    del lm_eval
    from lm_eval.models.huggingface import HFLM

    return {bs: HFLM(pretrained=folder, trust_remote_code=True, dtype="float32", batch_size=bs, device="cpu")
            for bs in (1, 4)}


def _requests(kind: str, pairs):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(pairs)]


LL_PAIRS = [("The river Danube", " flows east"), ("Once upon", " a time there was"), ("2 + 2 =", " 4"),
            ("The capital of France is", " Paris"), ("def f(x):", "\n    return x"), ("Hello", ",")]


def test_lm_eval_loglikelihood_batch_sizes_agree_with_own_logits(hflm_pair, model, tokenizer):
    got = {bs: lm.loglikelihood(_requests("loglikelihood", LL_PAIRS)) for bs, lm in hflm_pair.items()}
    for (context, continuation), one, four in zip(LL_PAIRS, got[1], got[4]):
        want, want_greedy = own_loglikelihood(model, tokenizer, context, continuation)
        assert one[0] == pytest.approx(want, rel=1e-5, abs=1e-4), (context, one, want)
        assert four[0] == pytest.approx(want, rel=1e-5, abs=1e-4), (context, four, want)
        assert one[1] == four[1] == want_greedy


def test_lm_eval_generate_until_batch_sizes_agree_with_generate(hflm_pair, model, tokenizer):
    # "until" strings that the greedy answers contain (taken from them), so the cut is exercised, and one that none
    # contains, so the answer runs to max_gen_toks
    answers = {p: tokenizer.decode(greedy(model, tokenizer, p, new=8), skip_special_tokens=True) for p in PROMPTS}
    untils = {p: [a[len(a) // 2:len(a) // 2 + 2]] if len(a) > 3 else ["\u2603"] for p, a in answers.items()}
    untils[PROMPTS[0]] = ["\u2603"]
    args = [(p, {"until": untils[p], "do_sample": False, "max_gen_toks": 8}) for p in PROMPTS]
    got = {bs: lm.generate_until(_requests("generate_until", args)) for bs, lm in hflm_pair.items()}
    for p, one, four in zip(PROMPTS, got[1], got[4]):
        want = answers[p]
        for stop in untils[p]:
            want = want.split(stop)[0]
        assert one == four == want, (p, one, four, want)
    assert any(untils[p][0] in answers[p] for p in PROMPTS[1:]), "no until string cut an answer"


def test_lm_eval_simple_evaluate_local_task(folder, model, tokenizer, tmp_path, monkeypatch):
    """A user's own task (``--include_path`` with a YAML over a local JSON file), run as ``lm_eval`` runs it, offline:
    its accuracy equals the one computed from the model's own log-likelihoods."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = [{"question": "The river Danube flows", "choices": [" east", " north", " to Paris"], "answer": 0},
            {"question": "Once upon a", "choices": [" time", " river", " seven"], "answer": 0},
            {"question": "2 + 2 =", "choices": [" 4", " 5", " fish"], "answer": 0},
            {"question": "The capital of France is", "choices": [" Rome", " Paris", " Oslo"], "answer": 1}]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "tiny_mc.yaml").write_text(
        "task: tiny_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n")
    results = simple_evaluate(model="hf", model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32",
                              tasks=["tiny_mc"], batch_size=4, device="cpu",
                              task_manager=TaskManager(include_path=str(task_dir)))
    acc = results["results"]["tiny_mc"]["acc,none"]
    scores = [[own_loglikelihood(model, tokenizer, d["question"], c)[0] for c in d["choices"]] for d in docs]
    want = sum(int(max(range(len(s)), key=s.__getitem__) == d["answer"]) for s, d in zip(scores, docs)) / len(docs)
    assert acc == pytest.approx(want)


# --- pipelines ----------------------------------------------------------------------------------------------------


def test_text_generation_pipeline_text_and_chat_equal_generate(folder, model, tokenizer):
    pipe = pipeline("text-generation", model=folder, trust_remote_code=True, dtype=torch.float32)
    prompt = PROMPTS[0]
    out = pipe(prompt, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)[0]["generated_text"]
    assert out == prompt + tokenizer.decode(greedy(model, tokenizer, prompt), skip_special_tokens=True)

    chat = [{"role": "user", "content": "Name three rivers in Europe."}]
    reply = pipe(chat, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)[0]["generated_text"]
    assert reply[:-1] == chat and reply[-1]["role"] == "assistant"
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    want = model.generate(**ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert reply[-1]["content"] == tokenizer.decode(want[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_image_text_to_text_pipeline_equals_generate(folder):
    import skimage.data
    from PIL import Image

    image = Image.fromarray(skimage.data.astronaut()).resize((112, 112))
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "Describe the image."}]}]
    pipe = pipeline("image-text-to-text", model=folder, trust_remote_code=True, dtype=torch.float32)
    out = pipe(text=messages, generate_kwargs={"do_sample": False, "max_new_tokens": NEW, "min_new_tokens": NEW},
               return_full_text=False)
    processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
    vl = AutoModelForImageTextToText.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    assert int(inputs["image_grid_thw"].prod()) > 0
    ids = vl.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    want = processor.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert out[0]["generated_text"] == want


# --- generate's own features --------------------------------------------------------------------------------------


def test_streamers_yield_the_decoded_answer(model, tokenizer, capsys):
    prompt = PROMPTS[1]
    want = tokenizer.decode(greedy(model, tokenizer, prompt), skip_special_tokens=True)
    ids = tokenizer(prompt, return_tensors="pt")
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    thread = threading.Thread(target=model.generate, kwargs=dict(
        **ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, streamer=streamer))
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert "".join(pieces) == want and len(pieces) >= 1

    model.generate(**ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                   streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    assert capsys.readouterr().out.rstrip("\n") == want


def test_beam_search_and_num_return_sequences(model, tokenizer):
    ids = tokenizer(PROMPTS[2], return_tensors="pt")
    kwargs = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, num_beams=3, num_return_sequences=3,
                  output_scores=True, return_dict_in_generate=True)
    a, b = model.generate(**ids, **kwargs), model.generate(**ids, **kwargs)
    assert a.sequences.shape == (3, ids["input_ids"].shape[1] + NEW)
    assert torch.equal(a.sequences, b.sequences)
    assert len({tuple(row.tolist()) for row in a.sequences}) == 3  # three distinct beams
    # beam scores are the length-normalised sums of the model's own log-probabilities of each returned sequence
    prompt_len = ids["input_ids"].shape[1]
    with torch.no_grad():
        logp = model(input_ids=a.sequences).logits[:, prompt_len - 1:-1].double().log_softmax(-1)
    sums = logp.gather(-1, a.sequences[:, prompt_len:, None])[..., 0].sum(-1)
    torch.testing.assert_close(a.sequences_scores.double(), sums / NEW, rtol=1e-4, atol=1e-4)
    assert a.sequences_scores[0] >= a.sequences_scores[1] >= a.sequences_scores[2]

    sampled = model.generate(**ids, max_new_tokens=NEW, do_sample=True, num_return_sequences=4)
    assert sampled.shape[0] == 4


def test_stop_strings_cut_the_answer(model, tokenizer):
    prompt = PROMPTS[3]
    full = greedy(model, tokenizer, prompt, new=10)
    text = tokenizer.decode(full, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert len(stop) == 2 and stop.strip(), text
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=10, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    new = out[0, ids["input_ids"].shape[1]:]
    assert len(new) < len(full) and torch.equal(new, full[:len(new)])
    got = tokenizer.decode(new, skip_special_tokens=True)
    assert got.endswith(stop) or stop in got, (got, stop)
    assert stop not in tokenizer.decode(new[:-1], skip_special_tokens=True)


def test_left_padded_batched_greedy_equals_one_by_one(folder, model):
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True, padding_side="left")
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    assert (batch["attention_mask"] == 0).any(), "the prompts must differ in length"
    out = model.generate(**batch, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    for row, prompt in zip(out, PROMPTS):
        assert torch.equal(row[batch["input_ids"].shape[1]:], greedy(model, tok, prompt)), prompt


def test_data_collator_with_flattening_equals_documents_alone(model, tokenizer):
    texts = ["The river Danube flows east through Vienna.", "Once upon a time", "def f(x):\n    return x + 1"]
    features = [{"input_ids": tokenizer(t)["input_ids"]} for t in texts]
    batch = DataCollatorWithFlattening()(features, return_tensors="pt")
    assert batch["input_ids"].shape[0] == 1 and (batch["position_ids"] == 0).sum() == len(texts)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        start = 0
        for f in features:
            n = len(f["input_ids"])
            alone = model(input_ids=torch.tensor([f["input_ids"]])).logits[0]
            torch.testing.assert_close(packed[start:start + n], alone, rtol=1e-5, atol=1e-5)
            start += n
        # the collator's labels (-100 at every document start) give the mean of the documents' own token losses (plus
        # the MTP term the folder's config weights in)
        out = model(**batch)
    labels = batch["labels"][0]
    assert (labels[batch["position_ids"][0] == 0] == -100).all()
    with torch.no_grad():
        total, count = 0.0, 0
        for f in features:
            ids = torch.tensor([f["input_ids"]])
            logits = model(input_ids=ids).logits[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            count += ids.shape[1] - 1
    assert out.mtp_loss is not None and model.config.get_text_config().mtp_loss_weight > 0
    main = float(out.loss) - model.config.get_text_config().mtp_loss_weight * float(out.mtp_loss)
    assert main == pytest.approx(total / count, rel=1e-5)
