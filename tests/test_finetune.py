"""The main job ``glm53flash-finetune``: the SFT-set builder, and the job itself run as a user
would (a subprocess on the embedded tiny checkpoint) with LoRA and with ``--full``.

The job runs with small settings here (6 or 2 steps, 12 text samples + the 6 media samples); the default run (400
steps) is too slow for the suite. Independent checks beside the job's own: the saved folder is read back in this
process with PEFT (adapter on the base) and with this package's class, and the trained token spans are decoded.
Refused command lines (a missing model, an output folder that is, lies inside or links into the model, bad numbers)
exit with status 2 and one error line, writing nothing. Publishing the output folder: tests/test_finetune_publish.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("skimage")

import shared_fixtures  # noqa: E402
from shared_fixtures import INF, NAN  # noqa: E402
from shared_fixtures import cli_error as _cli_error  # noqa: E402
from shared_fixtures import finetune_argv as _argv  # noqa: E402
from tiny import no_warnings  # noqa: E402

from glm53flash_hf.modeling_glm53flash import AUTO_MAP  # noqa: E402
from glm53flash_hf.tools import export, finetune, sft_data  # noqa: E402
from glm53flash_hf.tools.make_tiny import SAMPLING_DEFAULTS, make_tiny  # noqa: E402
from glm53flash_hf.train.trainer import AuxLossFreeBalancingCallback  # noqa: E402

tiny_checkpoint, tiny_processor = shared_fixtures.tiny_checkpoint, shared_fixtures.tiny_processor  # fixtures

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORE = -100


def _run_job(args, cwd, script=False):
    """Run the job in a fresh process; return (stdout, stderr). Fails the test on a non-zero exit."""
    console = os.path.join(os.path.dirname(sys.executable), "glm53flash-finetune")
    entry = [console] if script else [sys.executable, "-m", "glm53flash_hf.tools.finetune"]
    env = dict(os.environ, PYTHONPATH=REPO, HF_HUB_OFFLINE="1")
    proc = subprocess.run([*entry, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=480)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout, proc.stderr


# ------------------------------------------------------------------------------------------------ the SFT set


def test_topic_prompts_and_answers_are_real_text():
    from pydoc_data.topics import topics

    assert sft_data.explain_prompt("pass") == 'Explain the "pass" statement.'
    assert sft_data.explain_prompt("lambda") == "Explain Lambdas."
    for name in ("pass", "types", "assert", "debugger"):  # short, very long, and a title without "The"
        answer = sft_data.topic_answer(name, max_chars=300)
        assert 40 <= len(answer) <= 300, (name, len(answer))
        body = topics[name].split("\n", 2)[2]
        assert answer.split("\n\n")[0] in body and not answer.startswith(topics[name].split("\n")[0])
    # whole paragraphs when they fit: "pass" has a grammar line then its explanation
    assert sft_data.topic_answer("pass", 400).startswith('pass_stmt ::= "pass"\n\n"pass" is a null operation')
    with pytest.raises(KeyError, match="not a pydoc_data.topics topic"):
        sft_data.explain_prompt("no-such-topic")
    with pytest.raises(ValueError, match="max_chars"):
        sft_data.topic_answer("pass", 10)


def test_text_topics_exclude_held_out_and_duplicates():
    from pydoc_data.topics import topics

    every = sft_data.text_topics(77, held_out="pass", seed=0)  # 79 topics, "else" repeats "if", "pass" held out
    assert len(every) == len(set(every)) == 77 and "pass" not in every
    assert len({topics[n] for n in every}) == 77
    assert sft_data.text_topics(5, "pass", seed=1) != sft_data.text_topics(5, "pass", seed=2)
    assert "if" not in sft_data.text_topics(77, held_out="if", seed=0)
    with pytest.raises(ValueError, match="--samples must be between 0 and 77"):
        sft_data.text_topics(78, held_out="pass", seed=0)
    with pytest.raises(KeyError):
        sft_data.text_topics(3, held_out="nope", seed=0)


def test_sft_dataset(tiny_processor):
    """Real topics as "Explain <topic>" prompts, the held-out topic absent, 5 photos + 1 video, and labels exactly
    on the answers: the trained tokens decode to the answer followed by <|endoftext|> (thinking off: the
    ``<think></think>`` of the prompt is not trained), and no visual placeholder is trained."""
    tokenizer = tiny_processor.tokenizer
    convs = sft_data.sft_conversations(12, held_out="lambda", seed=0)
    examples = sft_data.build_sft_dataset(tiny_processor, 12, held_out="lambda", seed=0, max_length=512)
    assert len(examples) == len(convs) == 12 + len(sft_data.PHOTOS) + 1
    names = [e["name"] for e in examples]
    assert names[:12] == [f"topic:{n}" for n in sft_data.text_topics(12, "lambda", 0)]
    assert "topic:lambda" not in names
    assert names[12:] == [f"photo:{n}" for n, _ in sft_data.PHOTOS] + [f"video:{sft_data.GIF_NAME}"]
    for conv, example in zip(convs, examples):
        question = conv["messages"][0]["content"][-1]["text"]
        answer = conv["messages"][1]["content"]
        labels, ids = example["labels"], example["input_ids"]
        trained = ids[labels != IGNORE]
        assert tokenizer.decode(trained) == answer + "<|endoftext|>", conv["name"]
        text = tokenizer.decode(ids)
        assert question in text and text.endswith("<|assistant|><think></think>" + answer + "<|endoftext|>")
        types = example["mm_token_type_ids"]
        assert (labels[types != 0] == IGNORE).all()
        if conv["name"].startswith("topic:"):
            assert question.startswith("Explain ") and (types == 0).all() and "pixel_values" not in example
        elif conv["name"].startswith("photo:"):
            assert question == sft_data.IMAGE_PROMPT and int((types == 1).sum()) == 16  # 112 px: 8x8 patches / 4
            assert example["pixel_values"].shape == (64, 1176) and example["image_grid_thw"].tolist() == [[1, 8, 8]]
        else:
            assert question == sft_data.VIDEO_PROMPT and int((types == 2).sum()) > 0
            assert int(example["video_grid_thw"][0, 0]) >= 2  # several tubelets of the 24-frame GIF
    video, meta = sft_data.load_gif()
    assert video.shape == (24, 25, 14, 3) and video.dtype.name == "uint8" and abs(meta.fps - 1000 / 70) < 1e-9
    # truncation that leaves no answer token is refused
    with pytest.raises(ValueError, match="no trained token"):
        sft_data.build_sft_dataset(tiny_processor, 1, max_length=12, media=False)


def test_long_text_dataset(tiny_processor):
    """--long-text's samples: windows of exactly max_length tokens, each label its own token, one after another in the
    stream of the seeded standard-library files (each tokenized on its own after a ``# <name>`` line); another seed
    gives other files; more tokens than the sources hold is refused."""
    tokenizer = tiny_processor.tokenizer
    examples = sft_data.build_long_text_dataset(tokenizer, samples=3, max_length=256, seed=0)
    stream = []
    for path in sft_data.stdlib_sources(0):
        text = f"# {os.path.basename(path)}\n\n{open(path, encoding='utf-8', errors='replace').read()}\n\n"
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(stream) >= 3 * 256:
            break
    assert [len(e["input_ids"]) for e in examples] == [256] * 3
    for i, e in enumerate(examples):
        assert e["input_ids"].tolist() == stream[i * 256:(i + 1) * 256]
        assert torch.equal(e["labels"], e["input_ids"]) and not e["mm_token_type_ids"].any()
    first = os.path.basename(sft_data.stdlib_sources(0)[0])
    assert examples[0]["name"] == f"stdlib:{first}"
    assert tokenizer.decode(examples[0]["input_ids"][:8]).startswith(f"# {first}")
    assert sft_data.stdlib_sources(1) != sft_data.stdlib_sources(0)
    with pytest.raises(ValueError, match="fewer than samples \\* max_length"):
        sft_data.build_long_text_dataset(tokenizer, samples=10**4, max_length=10**4)
    with pytest.raises(ValueError, match="samples and max_length must be >= 1"):
        sft_data.build_long_text_dataset(tokenizer, samples=0, max_length=256)


def test_loss_summary_and_folder_check(tmp_path):
    assert finetune.loss_summary([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0]) == (4.0, 0.0, 3)
    assert finetune.loss_summary([3.0, 1.0]) == (3.0, 1.0, 1)
    assert finetune.loss_summary([2.0]) == (2.0, 2.0, 1)
    with pytest.raises(ValueError):
        finetune.loss_summary([])
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "configuration_x.C"}}))
    with pytest.raises(RuntimeError) as error:
        finetune.check_saved_folder(str(tmp_path), adapter=True)
    for piece in ("configuration_x.py", "AutoModelForCausalLM", "processor_config.json", "adapter/adapter_config.json"):
        assert piece in str(error.value)


def test_cli_rejects_bad_arguments(capsys):
    for argv, message in ((["--samples", "78"], "--samples must be between 0 and 77"),
                          (["--held-out", "nope"], "'nope' is not a pydoc_data.topics topic"),
                          (["--max-steps", "0"], "--max-steps must be >= 1"),
                          (["--lr", "-1"], "--lr must be > 0"),
                          (["--no-media", "--samples", "0"], "--samples must be >= 1"),
                          (["--ep", "0"], "--ep must be >= 1")):
        with pytest.raises(SystemExit) as exit_info:
            finetune.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv


# ------------------------------------------------------------------------------------------------ the job


@pytest.fixture(scope="module")
def lora_run(tiny_checkpoint, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("lora_job")
    out = str(cwd / "out")
    stdout, stderr = _run_job(["--model", tiny_checkpoint, "--output-dir", out, "--max-steps", "6", "--samples", "12",
                               "--train-lm-head", "--max-new-tokens", "12"], cwd)
    return out, stdout, stderr


def test_lora_job_trains_saves_and_reloads(lora_run):
    """Exit 0; the loss falls (seeded: the job's reported last loss at least 0.1 below its first); the loss log has
    one line per step with the MTP loss; the folder is complete; the fresh process loaded the folder's own classes
    and generated both answers, equal to the in-memory model's; the merged model matches the adapter."""
    out, stdout, _ = lora_run
    first, last = map(float, re.search(r"loss: first ([0-9.]+) .* last ([0-9.]+) ", stdout).groups())
    assert last < first - 0.1, stdout
    assert 8.0 < first < 8.8  # ln(2048) * (1 + 0.1 MTP weight) = 8.39 at the random init
    log = [json.loads(line) for line in open(os.path.join(out, finetune.LOSS_LOG))]
    assert [r["step"] for r in log] == list(range(1, 7))
    assert all(r["loss"] > 0 and 7.0 < r["mtp_loss"] < 8.5 for r in log)
    tokens, rate, peak = re.search(r"trained (\d+) tokens \(no padding\) in [0-9.]+ s: (\d+) tokens/s; peak memory "
                                   r"([0-9.]+) GiB per process \(resident\)", stdout).groups()
    assert int(tokens) > 6 * 8 * 30 and int(rate) > 0 and 0.1 < float(peak) < 8
    assert f"saved: {out} " in stdout

    files = finetune.check_saved_folder(out, adapter=True)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "glm5_next"
    assert config["auto_map"] == AUTO_MAP  # every Auto class (tests/test_auto_classes.py derives the list)
    generation = json.load(open(os.path.join(out, "generation_config.json")))
    assert {k: generation.get(k) for k in SAMPLING_DEFAULTS} == SAMPLING_DEFAULTS  # the base folder's, kept
    for name in ("modeling_glm53flash.py", "configuration_glm53flash.py", "processing_glm53flash.py", "kda.py",
                 "dsa.py", "moe.py", "mhc.py", "tokenizer.json", "chat_template.jinja", "processor_config.json",
                 "generation_config.json"):
        assert name in files, name
    assert json.load(open(os.path.join(out, "adapter", "adapter_config.json")))["modules_to_save"] == ["lm_head"]

    merge = re.search(r"merged model vs the trained adapter: max \|dlogit\| = ([0-9.e+-]+) .* ok", stdout)
    assert merge and float(merge.group(1)) < 1e-4
    assert re.search(r"AutoModelForCausalLM -> transformers_modules\.\S+\.modeling_glm53flash\.Glm53FlashForCausalLM",
                     stdout)
    assert re.search(r"AutoModelForImageTextToText -> transformers_modules\.\S+\.Glm53FlashForConditionalGeneration",
                     stdout)
    answers = re.findall(r"^  A: '(.*)'$", stdout, flags=re.M)
    assert len(answers) == 2 and all(a.strip() for a in answers), stdout
    assert 'Q (held out): Explain the "pass" statement.' in stdout
    assert "reloaded answers equal the in-memory model's: yes" in stdout
    for key in ("text", "image"):  # MTP speculative decoding in the fresh process
        assert re.search(rf"generate\(use_mtp=True\), {key} prompt: equals plain greedy: yes; acceptance \d+/\d+ = ",
                         stdout), stdout
    assert "ERROR" not in stdout


def test_long_text_job(tiny_checkpoint, tmp_path):
    """``--long-text`` with checkpointing: windows of --max-length tokens from the standard library, every token
    trained and counted (2 steps x 1 row x 1024), the peak memory printed."""
    out = str(tmp_path / "out")
    stdout, _ = _run_job(["--model", tiny_checkpoint, "--output-dir", out, "--long-text", "--max-length", "1024",
                          "--samples", "2", "--batch-size", "1", "--max-steps", "2", "--no-media", "--no-reload",
                          "--gradient-checkpointing"], tmp_path)
    assert "SFT set: 2 windows of 1024 tokens from the standard-library sources + 0 image/video samples" in stdout
    assert "2048 tokens, 2048 trained (every text token)" in stdout
    assert re.search(r"trained 2048 tokens \(no padding\) in [0-9.]+ s: \d+ tokens/s; peak memory [0-9.]+ GiB per "
                     r"process \(resident\)", stdout), stdout
    finetune.check_saved_folder(out, adapter=True)


def test_lora_adapter_reproduces_merged_folder(lora_run, tiny_checkpoint):
    """Independent of the job's own check: the saved adapter applied with PEFT on the base (this process, this
    package's class) gives the merged folder's logits (float32 rounding only);
    the base alone does not (negative control: the 6 trained steps moved the logits by far more)."""
    from glm53flash_hf.modeling_glm53flash import Glm53FlashForConditionalGeneration

    out, _, _ = lora_run
    ids = torch.tensor([[2002, 2004, 2007, 300, 41, 977, 5, 2008, 18, 19]])  # [gMASK]<sop><|user|>...<|assistant|>
    merged = Glm53FlashForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    base = Glm53FlashForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(base, os.path.join(out, finetune.ADAPTER_VL_DIR)).eval()
        adapted_logits = adapted(input_ids=ids).logits
        merged_logits = merged(input_ids=ids).logits
    torch.testing.assert_close(merged_logits, adapted_logits, rtol=0, atol=1e-4)
    assert (merged_logits - base_logits).abs().max() > 0.05


@pytest.mark.parametrize("folder, auto_peft, task_type, base_auto, base_class", [
    (finetune.ADAPTER_DIR, "AutoPeftModelForCausalLM", "CAUSAL_LM", "AutoModelForCausalLM", "Glm53FlashForCausalLM"),
    (finetune.ADAPTER_VL_DIR, "AutoPeftModel", None, "AutoModelForImageTextToText",
     "Glm53FlashForConditionalGeneration"),
])
def test_adapters_load_through_peft_auto_classes(lora_run, tiny_checkpoint, tiny_processor, monkeypatch, folder,
                                                 auto_peft, task_type, base_auto, base_class):
    """Each adapter the job saves loads, offline, through the PEFT Auto class its config names (the causal LM's
    ``adapter/``: ``CAUSAL_LM``, ``AutoPeftModelForCausalLM``; the VL model's ``adapter-vl/``: no task type,
    ``auto_mapping`` ``AutoModelForImageTextToText``, ``AutoPeftModel``) from the base folder the config records (an
    absolute path), with no warning (no missing / unexpected adapter keys), and gives the merged folder's float32
    logits loaded through the same transformers Auto class (text prompt; the VL model also on an image prompt)."""
    import transformers

    from glm53flash_hf.tools.sft_data import IMAGE_PROMPT, PROBE_PHOTO, chat_inputs, explain_prompt, load_photo

    out, _, _ = lora_run
    adapter = os.path.join(out, folder)
    config = json.load(open(os.path.join(adapter, "adapter_config.json")))
    assert config["task_type"] == task_type
    assert config["auto_mapping"] == (None if task_type else {"base_model_class": base_auto,
                                                              "parent_library": "transformers"})
    # where the job read the base: no network
    assert config["base_model_name_or_path"] == os.path.abspath(tiny_checkpoint)
    assert config["modules_to_save"] == ["lm_head"]

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with no_warnings():
        adapted = getattr(peft, auto_peft).from_pretrained(adapter, trust_remote_code=True, dtype=torch.float32)
    adapted.eval()
    assert type(adapted.get_base_model()).__name__ == base_class
    assert type(adapted.get_base_model()).__module__.startswith("transformers_modules.")
    merged = getattr(transformers, base_auto).from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(merged).__name__ == base_class
    prompts = [chat_inputs(tiny_processor, explain_prompt("pass"))]
    if task_type is None:
        prompts.append(chat_inputs(tiny_processor, IMAGE_PROMPT, load_photo(PROBE_PHOTO)))
    for inputs in prompts:
        with torch.no_grad():
            got, expected = adapted(**inputs).logits, merged(**inputs).logits
            with adapted.disable_adapter():
                base_logits = adapted(**inputs).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        assert (expected - base_logits).abs().max() > 0.05  # the adapter matters: 6 steps moved the logits by more


def test_full_finetune_saves_full_weights(tiny_checkpoint, tmp_path):
    """``--full`` (through the glm53flash-finetune console script, no MTP, 2 steps without warm-up): full weights in
    the folder, no adapter, no MTP loss logged, and every weight kind moved (attention, experts, vision tower)."""
    from safetensors import safe_open

    out = str(tmp_path / "out")
    stdout, _ = _run_job(["--model", tiny_checkpoint, "--output-dir", out, "--full", "--max-steps", "2", "--samples",
                          "4", "--warmup-steps", "0", "--no-mtp", "--no-reload"], tmp_path, script=True)
    assert "training: full fine-tuning" in stdout and "MTP loss off" in stdout
    files = finetune.check_saved_folder(out, adapter=False)
    assert not any(os.path.exists(os.path.join(out, d)) for d in (finetune.ADAPTER_DIR, finetune.ADAPTER_VL_DIR))
    assert "model.safetensors" in files
    log = [json.loads(line) for line in open(os.path.join(out, finetune.LOSS_LOG))]
    assert len(log) == 2 and not any("mtp_loss" in r for r in log)

    def tensors(folder):
        index = os.path.join(folder, "model.safetensors.index.json")
        shards = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) \
            else ["model.safetensors"]
        result = {}
        for shard in shards:
            with safe_open(os.path.join(folder, shard), framework="pt") as f:
                result.update({k: f.get_tensor(k).float() for k in f.keys()})
        return result

    before, after = tensors(tiny_checkpoint), tensors(out)
    assert before.keys() == after.keys()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    for pattern in ("self_attn.q_a_proj", "mlp.experts.0.", "model.visual.", "lm_head", "self_attn.q_proj"):
        assert any(pattern in k for k in moved), pattern


def test_lora_job_on_fp8_checkpoint(tmp_path):
    """``glm53flash-finetune --model <tiny FP8 folder>`` with the smallest settings (3 steps of one 64-token text
    row, LoRA r=2, no MTP, no fresh-process reload, ``--balance-speed``): exit 0, a finite loss that falls (seeded),
    the merge into the FP8 base reported within the e4m3 round-trip bound; the output reloads here kept in FP8
    (transformers' FP8 module classes, e4m3 weights that differ from the base's: the deltas are in) with finite
    logits and the balanced router biases; the base folder is untouched."""
    import hashlib

    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

    base = make_tiny(str(tmp_path / "tiny_fp8"), fp8=True, show_progress=False)

    def digest(folder):
        return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest()
                for f in os.listdir(folder) if f.endswith(".safetensors")}

    before = digest(base)
    out = str(tmp_path / "out")
    stdout, _ = _run_job(["--model", base, "--output-dir", out, "--max-steps", "3", "--samples", "2", "--no-media",
                          "--batch-size", "1", "--max-length", "64", "--warmup-steps", "0", "--lora-r", "2",
                          "--no-mtp", "--no-reload", "--balance-speed", "0.01"], tmp_path)
    first, last = map(float, re.search(r"loss: first ([0-9.]+) .* last ([0-9.]+) ", stdout).groups())
    assert 0 < last < first, stdout
    assert re.search(r"merged into the FP8 base as fp8: 49 FP8 weights", stdout), stdout
    assert re.search(r"of the elementwise e4m3 bound ok", stdout) and "ERROR" not in stdout, stdout
    assert digest(base) == before
    finetune.check_saved_folder(out, adapter=True)
    merged = Glm53FlashForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    original = Glm53FlashForCausalLM.from_pretrained(base, dtype=torch.float32)
    fp8 = {n: m for n, m in merged.named_modules() if isinstance(m, (FP8Linear, FP8Experts))}
    assert len(fp8) == 43 and merged.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    moved = [n for n, p in merged.named_parameters() if p.dtype == torch.float8_e4m3fn
             and not torch.equal(p.view(torch.uint8), original.get_parameter(n).view(torch.uint8))]
    assert any(".experts." in n for n in moved) and any("q_b_proj" in n for n in moved), moved
    # --balance-speed: the router biases are in the merged FP8 model (fp32) as the adapter has them (the balancing
    # moved those of the main layers; --no-mtp leaves the MTP layer's router without tokens)
    from safetensors import safe_open

    from glm53flash_hf.train.trainer import find_routers

    with safe_open(os.path.join(out, finetune.ADAPTER_VL_DIR, "adapter_model.safetensors"), "pt") as f:
        stored = {k.removeprefix("base_model.model.model.language_model.").removesuffix(".e_score_correction_bias"):
                  f.get_tensor(k) for k in f.keys() if k.endswith(".e_score_correction_bias")}
    routers = {n.removeprefix("model."): r.e_score_correction_bias for n, r in find_routers(merged).items()}
    assert stored and sorted(stored) == sorted(routers) and any(bool(b.abs().max() > 0) for b in stored.values())
    for name, bias in stored.items():
        assert routers[name].dtype == torch.float32 and torch.equal(routers[name], bias), name
    with torch.no_grad():
        assert torch.isfinite(merged(input_ids=torch.tensor([[2002, 2004, 300, 41, 977]])).logits).all()


# ------------------------------------------------------------------------------------------------ refused command lines


def test_finetune_missing_model_is_one_line(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    err = _cli_error(finetune.main, ["--model", missing, "--output-dir", str(tmp_path / "out")], capsys)
    assert f"--model {missing!r}: no such folder" in err
    assert not os.path.exists(tmp_path / "out")


def test_finetune_missing_model_in_a_fresh_process_is_one_line(tmp_path):
    """As a user runs it: a missing folder and an unknown Hub id (offline) each end with exit status 2 and one
    ``error:`` line, no traceback, nothing written."""
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for model, says in ((str(tmp_path / "nope"), "no such folder"), ("org/missing-model", "couldn't")):
        proc = subprocess.run(
            [sys.executable, "-m", "glm53flash_hf.tools.finetune", "--model", model, "--output-dir",
             str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"glm53flash-finetune: error: --model {model!r}: ") and says in last, last
        assert "Traceback" not in proc.stderr and not os.path.exists(tmp_path / "out")


def test_finetune_model_folder_without_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = _cli_error(finetune.main, ["--model", str(tmp_path / "empty")], capsys)
    assert "the folder holds no config.json, so no checkpoint" in err


def test_finetune_output_dir_equal_to_model_is_refused(tiny_checkpoint, capsys):
    err = _cli_error(finetune.main, ["--model", tiny_checkpoint, "--output-dir", tiny_checkpoint], capsys)
    assert (f"--output-dir={tiny_checkpoint!r} is the input {tiny_checkpoint!r}" in err
            and "must differ from --model" in err)


def test_finetune_output_dir_inside_or_linking_into_model_is_refused(tiny_checkpoint, tmp_path, capsys):
    err = _cli_error(finetune.main, ["--model", tiny_checkpoint, "--output-dir", os.path.join(tiny_checkpoint, "sub")],
                     capsys)
    assert "lies inside the input" in err
    linked = str(tmp_path / "exported")
    export.export(tiny_checkpoint, linked, show_progress=False)  # weights symlinked into tiny_dir
    err = _cli_error(finetune.main, ["--model", tiny_checkpoint, "--output-dir", linked], capsys)
    assert "links into the input" in err and "model.safetensors.index.json" in err
    alias = str(tmp_path / "alias")
    os.symlink(tiny_checkpoint, alias)
    err = _cli_error(finetune.main, ["--model", alias, "--output-dir", tiny_checkpoint], capsys)
    assert "is the input" in err



@pytest.mark.parametrize("option, value, message", [
    ("--lr", "inf", "--lr must be > 0 and finite; got inf"),
    ("--lr", "nan", "--lr must be > 0 and finite; got nan"),
    ("--lr", "0", "--lr must be > 0 and finite; got 0.0"),
    ("--balance-speed", "nan", "--balance-speed must be >= 0 and finite; got nan"),
    ("--balance-speed", "inf", "--balance-speed must be >= 0 and finite; got inf"),
    ("--balance-speed", "-0.1", "--balance-speed must be >= 0 and finite; got -0.1"),
    ("--warmup-steps", "-1", "--warmup-steps must be >= 0; got -1"),
    ("--lora-r", "0", "--lora-r must be >= 1; got 0"),
    ("--batch-size", "0", "--batch-size must be >= 1; got 0"),
    ("--grad-accum", "-2", "--grad-accum must be >= 1; got -2"),
    ("--max-length", "0", "--max-length must be >= 1; got 0"),
    ("--max-new-tokens", "0", "--max-new-tokens must be >= 1; got 0"),
    ("--sp", "0", "--sp must be >= 1; got 0"),
    ("--ep", "-1", "--ep must be >= 1; got -1"),
    ("--ep", "2", "--ep 2 needs a launch of several processes whose number it divides (accelerate launch / torchrun); "
                  "got 1 process"),
    ("--answer-chars", "39", "--answer-chars must be >= 40; got 39"),
    ("--seed", "-1", "--seed must be between 0 and 2**32 - 1; got -1"),
    ("--seed", str(2**32), f"--seed must be between 0 and 2**32 - 1; got {2**32}"),
    ("--samples", "-1", "--samples must be >= 1 (or >= 0 with media); got -1"),
])
def test_cli_refuses_bad_numbers(option, value, message, tiny_checkpoint, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        finetune.main(_argv(tiny_checkpoint, tmp_path / "out", option, value))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"glm53flash-finetune: error: {message}" in err, err
    assert not os.path.exists(tmp_path / "out")


def test_loss_summary_refuses_non_finite_losses():
    with pytest.raises(ValueError, match=r"logged loss 2 of 3 is inf"):
        finetune.loss_summary([8.0, INF, 1.0])
    with pytest.raises(ValueError, match=r"logged loss 1 of 2 is nan"):
        finetune.loss_summary([NAN, 1.0])
    with pytest.raises(ValueError, match=r"speed must be a finite number >= 0; got speed=nan"):
        AuxLossFreeBalancingCallback(speed=NAN)

