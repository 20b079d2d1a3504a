"""``glm53flash-finetune``: supervised fine-tuning of GLM-5.3-Flash with the HF Trainer, end to end.

With no arguments it runs the embedded default on CPU in a few minutes:

1. makes the embedded tiny checkpoint ``./glm53flash-tiny`` with ``glm53flash-make-tiny`` when it is absent;
2. builds an SFT set from real data that ships with Python and scikit-image: "Explain <topic>" questions answered
   by the opening paragraphs of that topic in CPython's ``pydoc_data.topics`` (the language reference), plus
   "Describe the image." / "Describe the video." turns on scikit-image's bundled photos and animated GIF, each
   rendered with the GLM-5.3 chat template (labels only on the assistant answers);
3. trains with ``transformers.Trainer``: samples packed into rows by the packing collator (documents kept apart),
   the MTP loss added to the main loss, LoRA on the attention/MLP projections and the routed experts' 3-D
   weights (plus ``lm_head`` in full on the random-init tiny checkpoint, see ``--train-lm-head``; ``--full``
   trains every weight instead), a progress bar and a loss log (``loss_log.jsonl``);
4. saves a Hub-style folder: the merged weights (LoRA merged into the base, or the fully fine-tuned weights),
   ``config.json`` with ``auto_map``, the remote-code modules, the processor and the chat template; with LoRA
   also the adapter in ``<output-dir>/adapter`` (and a check that the merged model's logits equal the adapter's);
5. reloads the folder in a fresh Python process (offline, without importing this package) through
   ``AutoModelForCausalLM`` and ``AutoModelForImageTextToText`` with ``trust_remote_code=True``, and greedily
   answers a held-out question (a topic left out of the training set) and an image prompt.

It prints the first and last loss, the trained tokens per second, the wall time and where the output is.

``--model PATH`` fine-tunes another checkpoint (a folder in the published layout or a Hub id).
``accelerate launch --config_file configuration/accelerate_fsdp2.yaml -m glm53flash_hf.finetune ...`` runs it on
several GPUs: the Trainer shards the model, only the main process saves, reloads and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_MODEL = "glm53flash-tiny"
DEFAULT_OUTPUT_DIR = "glm53flash-finetune-out"
#: ``pydoc_data.topics`` key left out of the training set and asked after training.
DEFAULT_HELD_OUT = "pass"
LOSS_LOG = "loss_log.jsonl"
ADAPTER_DIR = "adapter"
IGNORE_INDEX = -100

IMAGE_PROMPT = "Describe the image."
VIDEO_PROMPT = "Describe the video."
#: scikit-image's bundled photos (``skimage.data.<name>()``, no download) and what they show.
PHOTOS = (
    ("astronaut", "An astronaut in an orange spacesuit, smiling, in front of a flag and a model of the space shuttle."),
    ("chelsea", "A close-up of a tabby cat with green eyes."),
    ("coffee", "A cup of coffee on a red saucer with a spoon, on a wooden table."),
    ("rocket", "A rocket on its launch pad at dusk, between two towers."),
    ("camera", "A black-and-white photo of a man looking through a camera on a tripod."),
)
#: scikit-image's animated GIF (24 frames of 25 x 14 pixels, 70 ms each) and what it shows.
GIF_NAME = "no_time_for_that_tiny.gif"
GIF_CAPTION = "A tiny, blurry clip of a person standing in the middle of the frame."
#: Photos are resized to this square size (pixels): 8 x 8 patches of 14, 16 image tokens after the 2 x 2 merge.
PHOTO_SIZE = 112
#: The photo of the image prompt asked after training.
PROBE_PHOTO = "astronaut"
#: Prefix of the line carrying the fresh process's result (JSON).
RELOAD_MARKER = "GLM53FLASH_RELOAD_RESULT "


# ------------------------------------------------------------------------------------------------ the SFT set


def _topics() -> dict:
    from pydoc_data.topics import topics

    return topics


def topic_title(name: str) -> str:
    """The title line of ``pydoc_data.topics[name]`` (e.g. ``'The "pass" statement'`` for ``"pass"``).

    Raises:
        KeyError: ``name`` is not a topic (the message lists a few valid names).
    """
    topics = _topics()
    if name not in topics:
        raise KeyError(f"{name!r} is not a pydoc_data.topics topic; valid names include {sorted(topics)[:8]}")
    return topics[name].split("\n", 1)[0].strip()


def explain_prompt(name: str) -> str:
    """The user question for topic ``name``: ``"Explain <title>."`` with a leading ``"The "`` lower-cased,
    e.g. ``'Explain the "pass" statement.'``, ``'Explain Lambdas.'``."""
    title = topic_title(name)
    if title.startswith("The "):
        title = "the " + title[4:]
    return f"Explain {title}."


def topic_answer(name: str, max_chars: int = 400) -> str:
    """The assistant answer for topic ``name``: the topic's text without its title, whole paragraphs from the
    start while they fit in ``max_chars`` characters; a first paragraph longer than that is cut after its last
    sentence (or word) that fits.

    Raises:
        KeyError: unknown topic. ValueError: ``max_chars < 40``.
    """
    if max_chars < 40:
        raise ValueError(f"max_chars must be >= 40; got max_chars={max_chars}")
    topic_title(name)  # raises for an unknown name
    lines = _topics()[name].split("\n")
    body_start = 2 if len(lines) > 1 and set(lines[1].strip()) <= {"*", "=", "-"} else 1
    paragraphs = [p.strip("\n") for p in "\n".join(lines[body_start:]).strip().split("\n\n") if p.strip()]
    answer = ""
    for paragraph in paragraphs:
        candidate = f"{answer}\n\n{paragraph}" if answer else paragraph
        if len(candidate) > max_chars:
            break
        answer = candidate
    if not answer:  # the first paragraph alone is too long: cut it
        head = paragraphs[0][:max_chars]
        cut = max(head.rfind(". "), head.rfind(".\n"))
        answer = head[: cut + 1] if cut >= max_chars // 3 else head.rsplit(None, 1)[0]
    return answer


def text_topics(samples: int, held_out: str, seed: int) -> list[str]:
    """``samples`` distinct ``pydoc_data.topics`` keys for the training set, in a seeded random order, never
    ``held_out`` and never a topic whose text duplicates another's (``"else"`` repeats ``"if"``).

    Raises:
        ValueError: ``samples < 0`` or more than the topics available (the message gives the number).
    """
    import random

    topics = _topics()
    topic_title(held_out)
    seen, names = {topics[held_out]}, []
    for name in sorted(topics):
        if topics[name] not in seen:
            seen.add(topics[name])
            names.append(name)
    if not 0 <= samples <= len(names):
        raise ValueError(f"--samples must be between 0 and {len(names)} (distinct topics besides the held-out one); "
                         f"got {samples}")
    random.Random(seed).shuffle(names)
    return names[:samples]


def _skimage():
    try:
        import skimage
        import skimage.data
    except ImportError as error:
        raise ImportError("the image and video samples come from scikit-image, which is not installed: "
                          "pip install 'scikit-image>=0.24', or pass --no-media (text only)") from error
    return skimage


def load_photo(name: str, size: int = PHOTO_SIZE):
    """scikit-image's bundled photo ``name`` (``skimage.data.<name>()``, no download) as RGB uint8
    ``[size, size, 3]`` (grayscale photos are repeated over the three channels; bicubic resize).

    Raises:
        ImportError: scikit-image is not installed (the message says what to do).
    """
    import numpy as np
    from PIL import Image

    skimage = _skimage()
    photo = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
    return np.asarray(photo.resize((size, size), Image.BICUBIC))


def load_gif():
    """scikit-image's animated GIF ``skimage/data/no_time_for_that_tiny.gif`` as an RGB video.

    Returns:
        ``(video, metadata)``: uint8 ``[T, H, W, 3]`` (24 frames of 25 x 14 pixels) and a
        ``transformers.video_utils.VideoMetadata`` with ``fps`` from the GIF's frame duration (70 ms → 14.3 fps).

    Raises:
        FileNotFoundError: the GIF is not in the installed scikit-image. ImportError: no scikit-image.
    """
    import numpy as np
    from PIL import Image
    from transformers.video_utils import VideoMetadata

    skimage = _skimage()
    path = os.path.join(os.path.dirname(skimage.__file__), "data", GIF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"scikit-image's {GIF_NAME} is missing at {path}; reinstall scikit-image>=0.24")
    clip = Image.open(path)
    frames = []
    for index in range(clip.n_frames):
        clip.seek(index)
        frames.append(np.asarray(clip.convert("RGB")))
    frame_ms = float(clip.info.get("duration") or 70)
    video = np.stack(frames)
    metadata = VideoMetadata(total_num_frames=len(frames), fps=1000.0 / frame_ms,
                             duration=len(frames) * frame_ms / 1000)
    return video, metadata


def _user(text: str, media: str | None = None) -> dict:
    content = [{"type": media}] if media else []
    return {"role": "user", "content": content + [{"type": "text", "text": text}]}


def sft_conversations(samples: int, held_out: str = DEFAULT_HELD_OUT, seed: int = 0, answer_chars: int = 400,
                      media: bool = True) -> list[dict]:
    """The SFT set as conversations (no tokenization).

    Args:
        samples: number of "Explain <topic>" samples (see :func:`text_topics`).
        held_out: topic excluded from the set (asked after training).
        seed: order of the topics.
        answer_chars: answer length cap (:func:`topic_answer`).
        media: add one "Describe the image." sample per :data:`PHOTOS` entry and one "Describe the video." sample
            on the GIF.

    Returns:
        list of ``{"name", "messages", "images", "videos", "video_metadata"}``; ``images`` uint8 ``[H, W, 3]``
        arrays, ``videos`` uint8 ``[T, H, W, 3]`` arrays (empty lists for text samples). Text samples come first,
        then the photos, then the video.
    """
    out = []
    for name in text_topics(samples, held_out, seed):
        messages = [_user(explain_prompt(name)), {"role": "assistant", "content": topic_answer(name, answer_chars)}]
        out.append(dict(name=f"topic:{name}", messages=messages, images=[], videos=[], video_metadata=None))
    if media:
        for name, caption in PHOTOS:
            messages = [_user(IMAGE_PROMPT, "image"), {"role": "assistant", "content": caption}]
            out.append(dict(name=f"photo:{name}", messages=messages, images=[load_photo(name)], videos=[],
                            video_metadata=None))
        video, metadata = load_gif()
        messages = [_user(VIDEO_PROMPT, "video"), {"role": "assistant", "content": GIF_CAPTION}]
        out.append(dict(name=f"video:{GIF_NAME}", messages=messages, images=[], videos=[video],
                        video_metadata=[metadata]))
    return out


def build_sft_dataset(processor, samples: int, held_out: str = DEFAULT_HELD_OUT, seed: int = 0,
                      max_length: int = 512, answer_chars: int = 400, media: bool = True) -> list[dict]:
    """Tokenized SFT examples for the packing collator.

    Each conversation of :func:`sft_conversations` goes through ``processor.build_sft_example`` with
    ``enable_thinking=False`` (prompt ``...<|assistant|><think></think>``, as generation with thinking off) and
    ``max_length`` truncation.

    Returns:
        list of dicts with 1-D long ``input_ids`` / ``labels`` (-100 outside the answers) / ``mm_token_type_ids``
        and, for media samples, ``pixel_values`` float32 ``[patches, 1176]`` + ``image_grid_thw`` long ``[1, 3]``
        or ``pixel_values_videos`` + ``video_grid_thw``; plus ``"name"`` (str; the packing collator ignores it).

    Raises:
        ValueError: a sample with no trained token left after truncation (raise ``max_length``), and the errors
            of :func:`sft_conversations` / ``build_sft_example``.
    """
    examples = []
    for conv in sft_conversations(samples, held_out, seed, answer_chars, media):
        example = processor.build_sft_example(
            conv["messages"], images=conv["images"], videos=conv["videos"], video_metadata=conv["video_metadata"],
            enable_thinking=False, max_length=max_length, sample_id=conv["name"],
        )
        example = {k: v for k, v in example.items() if k != "attention_mask"}
        if int((example["labels"] != IGNORE_INDEX).sum()) == 0:
            raise ValueError(f"SFT sample {conv['name']!r} has no trained token within max_length={max_length}")
        example["name"] = conv["name"]
        examples.append(example)
    return examples


# ------------------------------------------------------------------------------------------------ training


def _trainer_class():
    """``Trainer`` subclass counting the trained tokens and logging the MTP loss (a function, so that this module
    imports nothing heavy at the top: the fresh-process reload runs it standalone)."""
    from transformers import Trainer

    class FinetuneTrainer(Trainer):
        """``transformers.Trainer`` plus:

        * ``mtp_loss`` in the logs: the unweighted MTP loss per optimizer step (the model's ``mtp_loss``, summed over
          the step's micro-batches since the Trainer passes ``num_items_in_batch``), averaged over the logging
          interval; this process's value (with several processes, an estimate of the global one);
        * ``trained_tokens``: positions that are not padding, counted per micro-batch as ``input_ids != pad`` or a
          trained target (the collator's padding has ``pad`` ids and -100 labels; the trained ``<|endoftext|>``,
          equal to ``pad``, has a label);
        * ``mtp=False`` passed to the model when the MTP loss is off.
        """

        def __init__(self, *args, pad_token_id: int, mtp: bool, **kwargs):
            super().__init__(*args, **kwargs)
            self.pad_token_id = pad_token_id
            self.mtp = mtp
            self.trained_tokens = 0
            self._mtp_sum, self._mtp_logged_step = 0.0, 0

        def training_step(self, model, inputs, num_items_in_batch=None):
            ids, labels = inputs["input_ids"], inputs["labels"]
            self.trained_tokens += int(((ids != self.pad_token_id) | (labels != IGNORE_INDEX)).sum())
            return super().training_step(model, inputs, num_items_in_batch)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not self.mtp:
                inputs = {**inputs, "mtp": False}
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            mtp_value = getattr(outputs, "mtp_loss", None)
            if mtp_value is not None and model.training:
                value = float(mtp_value.detach().float())
                if num_items_in_batch is None:  # a per-micro-batch mean: the step's value is their mean
                    value /= self.args.gradient_accumulation_steps
                elif self.args.average_tokens_across_devices:  # num_items_in_batch counts every process's tokens
                    value *= self.accelerator.num_processes
                self._mtp_sum += value
            return (loss, outputs) if return_outputs else loss

        def log(self, logs, start_time=None):
            steps = self.state.global_step - self._mtp_logged_step
            if "loss" in logs and self._mtp_sum and steps > 0:
                logs["mtp_loss"] = round(self._mtp_sum / steps, 6)
                self._mtp_sum, self._mtp_logged_step = 0.0, self.state.global_step
            return super().log(logs, start_time)

    return FinetuneTrainer


def _callbacks(loss_log: str):
    """A progress bar with the current loss (replacing the Trainer's bar, which prints every log dict) and the
    loss-log writer (one JSON line per logged step, main process only)."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class ProgressWithLoss(TrainerCallback):
        def __init__(self):
            self.bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.bar = tqdm(total=state.max_steps, desc="fine-tuning", unit="step", dynamic_ncols=True)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is not None and logs and "loss" in logs:
                self.bar.set_postfix(loss=f"{logs['loss']:.4f}", refresh=False)

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    class LossLog(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                os.makedirs(os.path.dirname(loss_log) or ".", exist_ok=True)
                open(loss_log, "w").close()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                record = {"step": state.global_step, "epoch": state.epoch, **logs}
                with open(loss_log, "a") as f:
                    f.write(json.dumps(record) + "\n")

    return [ProgressWithLoss(), LossLog()]


def loss_summary(losses: list[float], k: int = 3) -> tuple[float, float, int]:
    """``(first, last, n)``: means of the first and of the last ``n = min(k, len(losses) // 2)`` (at least 1)
    logged losses, so that with few steps the two windows never overlap (one loss: ``first == last``).

    Raises:
        ValueError: no loss was logged.
    """
    if not losses:
        raise ValueError("no training loss was logged (max_steps must be >= 1)")
    n = max(1, min(k, len(losses) // 2))
    return sum(losses[:n]) / n, sum(losses[-n:]) / n, n


def _fsdp_launch() -> bool:
    """Whether ``accelerate launch`` was configured for FSDP (it exports ``ACCELERATE_USE_FSDP=true``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def _resolve_dtype(name: str):
    """``--dtype`` as a torch dtype. ``auto``: float32 on CPU and under FSDP (fp32 masters; the FSDP mixed-precision
    policy computes in bf16), bfloat16 on a single CUDA device."""
    import torch

    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and not _fsdp_launch() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _save_trained(trainer, path: str, main_process: bool) -> None:
    """Save the trained model (a PEFT model saves its adapter only) to ``path``.

    Without FSDP this is ``Trainer.save_model``. Under FSDP the full state dict is gathered on every rank
    (``Accelerator.get_state_dict``: FSDP2 ``full_state_dict=True``, CPU offload; a collective) and the main process
    saves it, whatever ``fsdp_state_dict_type`` the accelerate config names (``Trainer.save_model`` writes nothing
    for ``SHARDED_STATE_DICT``)."""
    if not trainer.is_fsdp_enabled:
        trainer.save_model(path)
        return
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    if main_process:
        trainer.accelerator.unwrap_model(trainer.model).save_pretrained(path, state_dict=state_dict)


def _load_model(path: str, dtype):
    """The VL model (``Glm53FlashForConditionalGeneration``) from ``path``, by this package's class (so that a
    published checkpoint without ``auto_map`` is read by our code, never by transformers' built-in class)."""
    from .modeling_glm53flash import Glm53FlashForConditionalGeneration

    model = Glm53FlashForConditionalGeneration.from_pretrained(path, dtype=dtype)
    model.config.use_cache = False
    return model


def _load_processor(path: str):
    from .processing_glm53flash import Glm53FlashProcessor

    return Glm53FlashProcessor.from_pretrained(path)


def check_saved_folder(out: str, adapter: bool) -> list[str]:
    """Check that ``out`` is a self-contained Hub-style folder; return the list of files found.

    Checked: ``config.json`` with ``auto_map`` entries for ``AutoConfig``, ``AutoModelForCausalLM`` and
    ``AutoModelForImageTextToText`` whose modules (``<module>.py``) are in ``out``; safetensors weights;
    ``processor_config.json`` with an ``AutoProcessor`` entry whose module is in ``out``; the tokenizer and
    ``chat_template.jinja``; with ``adapter``, ``adapter/adapter_config.json`` and
    ``adapter/adapter_model.safetensors``.

    Raises:
        RuntimeError: naming every missing piece.
    """
    missing = []
    files = sorted(os.listdir(out))

    def need(condition, what):
        if not condition:
            missing.append(what)

    config = {}
    if os.path.isfile(os.path.join(out, "config.json")):
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
    need(config, "config.json")
    auto_map = config.get("auto_map", {})
    for auto in ("AutoConfig", "AutoModelForCausalLM", "AutoModelForImageTextToText"):
        need(auto in auto_map, f"config.json auto_map[{auto!r}]")
        if auto in auto_map:
            module = auto_map[auto].split("--")[-1].rsplit(".", 1)[0]
            need(f"{module}.py" in files, f"{module}.py (remote code for {auto})")
    need(any(f.endswith(".safetensors") for f in files), "*.safetensors weights")
    processor_config = {}
    if os.path.isfile(os.path.join(out, "processor_config.json")):
        with open(os.path.join(out, "processor_config.json")) as f:
            processor_config = json.load(f)
    need(processor_config, "processor_config.json")
    processor_map = processor_config.get("auto_map", {})
    need("AutoProcessor" in processor_map, "processor_config.json auto_map['AutoProcessor']")
    if "AutoProcessor" in processor_map:
        module = processor_map["AutoProcessor"].split("--")[-1].rsplit(".", 1)[0]
        need(f"{module}.py" in files, f"{module}.py (remote code for AutoProcessor)")
    need("tokenizer.json" in files, "tokenizer.json")
    need("chat_template.jinja" in files, "chat_template.jinja")
    if adapter:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            need(os.path.isfile(os.path.join(out, ADAPTER_DIR, name)), f"{ADAPTER_DIR}/{name}")
    if missing:
        raise RuntimeError(f"the saved folder {out} is incomplete; missing: {', '.join(missing)}")
    return files


def merge_adapter(base_path: str, adapter_dir: str, dtype):
    """Load the base VL model from ``base_path`` (this package's class, on CPU, ``dtype``), apply the LoRA adapter
    saved in ``adapter_dir`` with ``peft.PeftModel.from_pretrained`` and return ``merge_and_unload()``: a plain
    ``Glm53FlashForConditionalGeneration`` with the deltas added to the base weights (experts' 3-D weights
    included). Works the same after single-process and sharded (FSDP) training, since the adapter on disk is
    complete."""
    from peft import PeftModel

    base = _load_model(base_path, dtype)
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()


# ------------------------------------------------------------------------------------------------ generation

#: Largest ``max |logit difference| / max(1, max |logit|)`` accepted between the trained LoRA model (adapter applied
#: on the fly) and the merged model, in float32. Merging changes only the rounding of ``W x + s B (A x)`` vs
#: ``(W + s B A) x`` (float32 eps 1.2e-7 per operation, compounded over the layers; measured on the tiny model:
#: 1.7e-5 at max |logit| 12.1 after the default run, 1.4e-6 relative, and 6e-7 at 1.3 after 6 steps); a lost or
#: misplaced delta moves trained logits by 1e-1 or more.
MERGE_RTOL = 2e-5


def max_logit_difference(model_a, model_b, processor, question: str) -> tuple[float, float]:
    """``(max |logits_a - logits_b|, max |logits_a|)`` (floats) of two models on the chat prompt for ``question``
    and on the :data:`PROBE_PHOTO` image prompt (one forward each, no grad; both models are left in eval mode)."""
    import torch

    diff = scale = 0.0
    for inputs in (chat_inputs(processor, question), chat_inputs(processor, IMAGE_PROMPT, load_photo(PROBE_PHOTO))):
        with torch.no_grad():
            a = model_a.eval()(**inputs).logits.float()
            b = model_b.eval()(**inputs).logits.float()
        diff = max(diff, float((a - b).abs().max()))
        scale = max(scale, float(a.abs().max()))
    return diff, scale



def chat_inputs(processor, question: str, image=None):
    """Model inputs (batch of 1, torch) for a one-turn chat with the generation prompt and thinking off
    (``...<|assistant|><think></think>``), as in training; ``image`` (uint8 ``[H, W, 3]``) is placed before the
    question."""
    messages = [_user(question, "image" if image is not None else None)]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                           enable_thinking=False)
    kwargs = dict(images=[image]) if image is not None else {}
    return processor(text=[prompt], return_tensors="pt", **kwargs)


def greedy_answer(model, processor, question: str, image=None, max_new_tokens: int = 48) -> str:
    """Greedy answer (``do_sample=False``, at most ``max_new_tokens`` tokens, stopping at the config's EOS ids) of
    ``model`` to ``question`` (with ``image`` when given), decoded without special tokens and stripped."""
    import torch

    inputs = chat_inputs(processor, question, image)
    if image is None:  # text only: the text-only class takes no mm_token_type_ids (all zeros here)
        inputs.pop("mm_token_type_ids", None)
    inputs = {k: v.to(model.device) if hasattr(v, "to") else v for k, v in inputs.items()}
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = generated[0, inputs["input_ids"].shape[1]:]
    return processor.tokenizer.decode(new, skip_special_tokens=True).strip()


def reload_check(out: str, question: str, max_new_tokens: int = 48) -> dict:
    """Load ``out`` as a new user would (``HF_HUB_OFFLINE=1``, Auto classes, ``trust_remote_code=True``, CPU,
    float32) and answer ``question`` with ``AutoModelForCausalLM`` and the :data:`PROBE_PHOTO` image prompt with
    ``AutoModelForImageTextToText``. Meant to run in a fresh process (:func:`run_reload_check`).

    Returns:
        ``{"text_class", "vl_class", "processor_class"}`` (qualified class names), ``"text_answer"``,
        ``"image_answer"``, ``"package_imported"`` (whether ``glm53flash_hf`` got imported: it must not, the
        folder's own modules are used).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

    def qualname(obj):
        return f"{type(obj).__module__}.{type(obj).__name__}"

    processor = AutoProcessor.from_pretrained(out, trust_remote_code=True)
    lm = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    text_answer = greedy_answer(lm, processor, question, max_new_tokens=max_new_tokens)
    text_class = qualname(lm)
    del lm
    vl = AutoModelForImageTextToText.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    image_answer = greedy_answer(vl, processor, IMAGE_PROMPT, load_photo(PROBE_PHOTO), max_new_tokens)
    return dict(text_class=text_class, vl_class=qualname(vl), processor_class=qualname(processor),
                text_answer=text_answer, image_answer=image_answer,
                package_imported="glm53flash_hf" in sys.modules)


def _reload_child_main(argv) -> int:
    """Entry point of the fresh process: ``OUT QUESTION MAX_NEW_TOKENS``; prints :data:`RELOAD_MARKER` + JSON."""
    out, question, max_new_tokens = argv
    result = reload_check(out, question, int(max_new_tokens))
    print(RELOAD_MARKER + json.dumps(result), flush=True)
    return 0


def run_reload_check(out: str, question: str, max_new_tokens: int = 48, timeout: float = 900) -> dict:
    """Run :func:`reload_check` in a fresh Python process and return its result.

    The child runs this file with ``runpy`` (not ``import glm53flash_hf``), with ``HF_HUB_OFFLINE=1`` and its
    working directory in ``out``, so only the saved folder's modules can serve the Auto classes.

    Raises:
        RuntimeError: the child failed or printed no result (its output is in the message).
    """
    code = ("import runpy, sys; ns = runpy.run_path(sys.argv[1], run_name='glm53flash_reload'); "
            "raise SystemExit(ns['_reload_child_main'](sys.argv[2:]))")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(
        [sys.executable, "-c", code, os.path.abspath(__file__), os.path.abspath(out), question, str(max_new_tokens)],
        cwd=os.path.abspath(out), env=env, capture_output=True, text=True, timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RELOAD_MARKER):
            return json.loads(line[len(RELOAD_MARKER):])
    raise RuntimeError(f"the fresh-process reload of {out} failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


# ------------------------------------------------------------------------------------------------ the job


def build_parser() -> argparse.ArgumentParser:
    """The command-line options of ``glm53flash-finetune`` (see ``--help``)."""
    parser = argparse.ArgumentParser(
        prog="glm53flash-finetune", description="S" + __doc__.split("\n\n")[0].split(": s", 1)[-1],
        epilog=__doc__.split("\n\n", 1)[1].replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"checkpoint to fine-tune (folder or Hub id); ./{DEFAULT_MODEL} is made with "
                             "glm53flash-make-tiny when it is absent (default)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help="where to save (default: %(default)s)")
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    parser.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=32,
                        help='"Explain <topic>" samples from pydoc_data.topics (default: %(default)s); the 5 photo '
                             "and 1 video samples come on top (--no-media drops them)")
    parser.add_argument("--no-media", action="store_true", help="text samples only")
    parser.add_argument("--held-out", default=DEFAULT_HELD_OUT,
                        help="pydoc_data.topics topic kept out of training and asked afterwards (default: %(default)s)")
    parser.add_argument("--answer-chars", type=int, default=400,
                        help="cap on each answer's length in characters (default: %(default)s)")
    parser.add_argument("--max-steps", type=int, default=400, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="samples per step and device, packed into rows of --max-length (default: %(default)s)")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=512,
                        help="tokens per packed row; longer samples are truncated (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate (default: 5e-3 with LoRA, 1e-3 with --full), linear decay")
    parser.add_argument("--warmup-steps", type=int, default=2, help="linear warm-up steps (default: %(default)s)")
    parser.add_argument("--train-lm-head", action=argparse.BooleanOptionalAction, default=None,
                        help="with LoRA, also train lm_head in full (PEFT modules_to_save). Default: on for the "
                             "embedded tiny checkpoint only, whose random-init lm_head and final norm, frozen, bound "
                             "every logit to about +-1.3 and so the loss to about 7.5; off with --model")
    parser.add_argument("--no-mtp", action="store_true", help="train without the MTP loss")
    parser.add_argument("--balance-speed", type=float, default=0.0,
                        help="aux-loss-free expert balancing bias update speed (DeepSeek-V3 used 1e-3; default off). "
                             "With LoRA the updated biases reach only the merged model, not the adapter")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="weights dtype for training and saving (auto: float32 on CPU and under FSDP, bfloat16 on one "
                        "GPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data order and the LoRA init")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per answer after training")
    parser.add_argument("--no-reload", action="store_true", help="skip the fresh-process reload and generation")
    return parser


def _check_args(parser, args) -> None:
    positive = ("lora_r", "max_steps", "batch_size", "grad_accum", "max_length", "answer_chars", "max_new_tokens")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.samples < 0 or (args.samples == 0 and args.no_media):
        parser.error(f"--samples must be >= 1 (or >= 0 with media); got {args.samples}")
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be > 0; got {args.lr}")
    if args.warmup_steps < 0 or args.balance_speed < 0:
        parser.error("--warmup-steps and --balance-speed must be >= 0")
    try:
        text_topics(args.samples, args.held_out, args.seed)
    except KeyError as error:
        parser.error(f"--held-out: {error.args[0]}")
    except ValueError as error:
        parser.error(str(error))


def main(argv=None) -> int:
    """Command-line entry point of ``glm53flash-finetune``; returns the exit status (0 on success)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    start = time.perf_counter()

    import torch
    from transformers import ProgressCallback, TrainingArguments

    from .collator import Glm53FlashPackingCollator
    from .training import AuxLossFreeBalancingCallback, default_lora_config

    lr = args.lr if args.lr is not None else (1e-3 if args.full else 5e-3)
    out = os.path.abspath(args.output_dir)
    dtype = _resolve_dtype(args.dtype)
    training_args = TrainingArguments(
        output_dir=out,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=lr,
        lr_scheduler_type="linear",
        warmup_steps=args.warmup_steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        remove_unused_columns=False,
        label_names=["labels"],
        dataloader_num_workers=0,
        seed=args.seed,
        data_seed=args.seed,
        bf16=torch.cuda.is_available() and (dtype == torch.bfloat16 or (
            _fsdp_launch() and os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16")),
        dataloader_pin_memory=torch.cuda.is_available(),
        activation_checkpointing=args.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
    )
    main_process = training_args.process_index == 0

    def say(*parts):
        if main_process:
            print(*parts, flush=True)

    model_path = args.model
    with training_args.main_process_first(desc="checkpoint"):
        if args.model == DEFAULT_MODEL and not os.path.exists(os.path.join(model_path, "config.json")):
            from .make_tiny import make_tiny

            say(f"making the embedded tiny checkpoint in ./{model_path} ...")
            if main_process:
                make_tiny(model_path, show_progress=False)
    if os.path.isdir(model_path):
        model_path = os.path.abspath(model_path)

    processor = _load_processor(model_path)
    model = _load_model(model_path, dtype)
    text_config = model.config.get_text_config(decoder=True)
    dataset = build_sft_dataset(processor, args.samples, args.held_out, args.seed, args.max_length,
                                args.answer_chars, media=not args.no_media)
    n_tokens = sum(len(e["input_ids"]) for e in dataset)
    n_trained = sum(int((e["labels"] != IGNORE_INDEX).sum()) for e in dataset)
    n_media = sum(1 for e in dataset if not e["name"].startswith("topic:"))
    say(f"model: {model_path} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {dtype})")
    say(f"SFT set: {len(dataset) - n_media} 'Explain <topic>' samples from pydoc_data.topics + {n_media} "
        f"image/video samples from scikit-image; {n_tokens} tokens, {n_trained} trained (answers only); "
        f"held out: {explain_prompt(args.held_out)!r}")

    if args.full:
        mode = "full fine-tuning"
    else:
        import peft

        torch.manual_seed(args.seed)
        train_head = args.train_lm_head if args.train_lm_head is not None else args.model == DEFAULT_MODEL
        extra = dict(modules_to_save=["lm_head"]) if train_head else {}
        model = peft.get_peft_model(model, default_lora_config(r=args.lora_r, **extra))
        mode = f"LoRA r={args.lora_r}" + (" + lm_head" if train_head else "")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    mtp = not args.no_mtp and text_config.num_nextn_predict_layers > 0 and text_config.mtp_loss_weight > 0
    say(f"training: {mode}, {trainable / 1e6:.3f} M trainable parameters, lr {lr:g}, {args.max_steps} steps x "
        f"{args.batch_size} samples packed into rows of <= {args.max_length} tokens, MTP loss "
        + (f"on (weight {text_config.mtp_loss_weight:g})" if mtp else "off"))

    collator = Glm53FlashPackingCollator(max_length=args.max_length, pad_token_id=processor.tokenizer.pad_token_id)
    loss_log = os.path.join(out, LOSS_LOG)
    callbacks = _callbacks(loss_log)
    if args.balance_speed > 0:
        callbacks.append(AuxLossFreeBalancingCallback(speed=args.balance_speed))
    trainer = _trainer_class()(
        model=model, args=training_args, train_dataset=dataset, data_collator=collator, callbacks=callbacks,
        pad_token_id=processor.tokenizer.pad_token_id, mtp=mtp,
    )
    trainer.remove_callback(ProgressCallback)
    if trainer.is_fsdp_enabled and training_args.bf16:
        # accelerate's single bf16 policy would cast the fp32-kept parameters (A_log, dt_bias, KDA conv, mHC
        # base/scale, router) for the forward: give them their own fp32 units first
        # (configuration/accelerate_fsdp2.yaml).
        from .distributed import shard_fp32_kept_units

        shard_fp32_kept_units(model, param_dtype=torch.bfloat16)
    result = trainer.train()
    train_seconds = float(result.metrics["train_runtime"])
    tokens = torch.tensor(trainer.trained_tokens, device=training_args.device)
    tokens = int(trainer.accelerator.reduce(tokens, reduction="sum")) if trainer.accelerator.num_processes > 1 \
        else trainer.trained_tokens
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    first, last, n = loss_summary(losses)

    # ---- save ----
    os.makedirs(out, exist_ok=True)
    if args.full:
        stale = os.path.join(out, ADAPTER_DIR)
        if main_process and os.path.isfile(os.path.join(stale, "adapter_config.json")):
            import shutil

            say(f"removing the adapter of an earlier LoRA run: {stale}")
            shutil.rmtree(stale)
        _save_trained(trainer, out, main_process)
        saved_model = trainer.model if trainer.accelerator.num_processes == 1 else None
    else:
        adapter_dir = os.path.join(out, ADAPTER_DIR)
        _save_trained(trainer, adapter_dir, main_process)
        saved_model = None
        if main_process:
            saved_model = merge_adapter(model_path, adapter_dir, dtype)
            saved_model.save_pretrained(out)
    if main_process:
        processor.save_pretrained(out)
        check_saved_folder(out, adapter=not args.full)
    trainer.accelerator.wait_for_everyone()
    if not main_process:
        return 0
    status = 0
    single_cpu_fp32 = trainer.accelerator.num_processes == 1 and dtype == torch.float32 and \
        next(trainer.model.parameters()).device.type == "cpu"
    merge_diff = None
    if not args.full and single_cpu_fp32:
        merge_diff = max_logit_difference(trainer.model, saved_model, processor, explain_prompt(args.held_out))

    say("")
    say(f"loss: first {first:.4f} (mean of the first {n} steps), last {last:.4f} (mean of the last {n}); "
        + (f"fell by {first - last:.4f}" if last < first else "WARNING: the loss did not fall"))
    say(f"trained {tokens} tokens (no padding) in {train_seconds:.1f} s: {tokens / train_seconds:.0f} tokens/s")
    say(f"saved: {out} ({'merged LoRA weights' if not args.full else 'fully fine-tuned weights'}, {dtype}; "
        f"remote code, auto_map, processor, chat template)"
        + ("" if args.full else f"; adapter: {os.path.join(out, ADAPTER_DIR)}") + f"; loss log: {loss_log}")

    if merge_diff is not None:
        diff, scale = merge_diff
        ok = diff <= MERGE_RTOL * max(1.0, scale)
        say(f"merged model vs the trained adapter: max |dlogit| = {diff:.2e} (max |logit| {scale:.1f}) "
            + ("ok" if ok else f"ERROR: above {MERGE_RTOL:g} relative"))
        status = status if ok else 1
    if not args.no_reload:
        question = explain_prompt(args.held_out)
        say("reloading in a fresh process (HF_HUB_OFFLINE=1, trust_remote_code=True) ...")
        reloaded = run_reload_check(out, question, args.max_new_tokens)
        say(f"  AutoModelForCausalLM -> {reloaded['text_class']}")
        say(f"  Q (held out): {question}\n  A: {reloaded['text_answer']!r}")
        say(f"  AutoModelForImageTextToText -> {reloaded['vl_class']}")
        say(f"  Q: [{PROBE_PHOTO} photo] {IMAGE_PROMPT}\n  A: {reloaded['image_answer']!r}")
        if reloaded["package_imported"]:
            say("  ERROR: the fresh process imported glm53flash_hf; the folder is not self-contained")
            status = 1
        if saved_model is not None and single_cpu_fp32:
            saved_model.eval()
            expected = (greedy_answer(saved_model, processor, question, max_new_tokens=args.max_new_tokens),
                        greedy_answer(saved_model, processor, IMAGE_PROMPT, load_photo(PROBE_PHOTO),
                                      args.max_new_tokens))
            same = expected == (reloaded["text_answer"], reloaded["image_answer"])
            say(f"  reloaded answers equal the in-memory model's: {'yes' if same else 'NO'}")
            if not same:
                say(f"  ERROR: in-memory answers differ: {expected!r}")
                status = 1
    say(f"wall time {time.perf_counter() - start:.0f} s; output: {out}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
