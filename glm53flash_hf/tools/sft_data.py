"""The embedded default SFT set of ``glm53flash-finetune`` and the chat helpers used to ask the model afterwards.

Text: "Explain <topic>" answered by CPython's ``pydoc_data.topics`` (for long context: windows cut from the
standard-library sources); images: "Describe the image." on scikit-image's photos; video: "Describe the video." on
its animated GIF. Imports nothing from ``glm53flash_hf`` at the top (the reload check runs it as a plain file).
"""

from __future__ import annotations

import os

#: ``pydoc_data.topics`` key left out of the training set and asked after training.
DEFAULT_HELD_OUT = "pass"
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


def _topics() -> dict:
    from pydoc_data.topics import topics

    return topics


def topic_title(name: str) -> str:
    """The title line of ``pydoc_data.topics[name]``; ``KeyError`` listing a few valid names for an unknown topic."""
    topics = _topics()
    if name not in topics:
        raise KeyError(f"{name!r} is not a pydoc_data.topics topic; valid names include {sorted(topics)[:8]}")
    return topics[name].split("\n", 1)[0].strip()


def explain_prompt(name: str) -> str:
    """The user question for topic ``name``, e.g. ``'Explain the "pass" statement.'``."""
    title = topic_title(name)
    if title.startswith("The "):
        title = "the " + title[4:]
    return f"Explain {title}."


def topic_answer(name: str, max_chars: int = 400) -> str:
    """The assistant answer for topic ``name``: the text without its title, whole paragraphs within ``max_chars``
    (a longer first paragraph cut after its last sentence or word that fits). ``KeyError`` for an unknown topic,
    ``ValueError`` for ``max_chars < 40``."""
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
    """``samples`` distinct topic keys in a seeded random order, never ``held_out`` nor a duplicate text;
    ``ValueError`` for ``samples < 0`` or more than the topics available (the message gives the number)."""
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
    """scikit-image's bundled photo ``name`` as RGB uint8 ``[size, size, 3]`` (bicubic resize); ``ImportError``
    without scikit-image."""
    import numpy as np
    from PIL import Image

    skimage = _skimage()
    photo = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
    return np.asarray(photo.resize((size, size), Image.BICUBIC))


def load_gif():
    """scikit-image's animated GIF as ``(video uint8 [T, H, W, 3], VideoMetadata)`` (``fps`` from the frame duration);
    ``FileNotFoundError`` when the installed scikit-image lacks the GIF, ``ImportError`` without scikit-image."""
    import numpy as np
    from PIL import Image, ImageSequence
    from transformers.video_utils import VideoMetadata

    skimage = _skimage()
    path = os.path.join(os.path.dirname(skimage.__file__), "data", GIF_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"scikit-image's {GIF_NAME} is missing at {path}; reinstall scikit-image>=0.24")
    clip = Image.open(path)
    frames = [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(clip)]
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
    """The SFT set as ``{"name", "messages", "images", "videos", "video_metadata"}`` conversations: ``samples``
    "Explain <topic>" samples (seeded by ``seed``, without ``held_out``, answers capped at ``answer_chars``), then with
    ``media`` the photo and video samples (uint8 ``[H, W, 3]`` images, ``[T, H, W, 3]`` videos).
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
    """Tokenized SFT examples (:func:`glm53flash_hf.train.sft.build_sft_example`, thinking off, ``max_length``): dicts
    with 1-D long ``input_ids`` / ``labels`` / ``mm_token_type_ids``, the media tensors of media samples, and
    ``"name"``; ``ValueError`` for a sample with no trained token left after truncation."""
    from glm53flash_hf.train.sft import build_sft_example

    examples = []
    for conv in sft_conversations(samples, held_out, seed, answer_chars, media):
        example = build_sft_example(
            processor, conv["messages"], images=conv["images"], videos=conv["videos"],
            video_metadata=conv["video_metadata"], enable_thinking=False, max_length=max_length, sample_id=conv["name"],
        )
        example = {k: v for k, v in example.items() if k != "attention_mask"}
        if int((example["labels"] != IGNORE_INDEX).sum()) == 0:
            raise ValueError(f"SFT sample {conv['name']!r} has no trained token within max_length={max_length}")
        example["name"] = conv["name"]
        examples.append(example)
    return examples


def stdlib_sources(seed: int = 0) -> list[str]:
    """Paths of CPython's standard-library modules (the ``*.py`` files directly in ``sysconfig``'s ``stdlib``
    folder) in a seeded random order; ``FileNotFoundError`` when that folder holds none."""
    import glob
    import random
    import sysconfig

    folder = sysconfig.get_paths()["stdlib"]
    paths = sorted(glob.glob(os.path.join(folder, "*.py")))
    if not paths:
        raise FileNotFoundError(f"no standard-library sources (*.py) in {folder}")
    random.Random(seed).shuffle(paths)
    return paths


def build_long_text_dataset(tokenizer, samples: int, max_length: int, seed: int = 0) -> list[dict]:
    """``samples`` language-modelling examples of exactly ``max_length`` tokens, cut one after another from CPython's
    standard-library sources (:func:`stdlib_sources`, each file after a ``# <name>`` line) concatenated: dicts with
    1-D long ``input_ids``, ``labels`` equal to them (every token trained), zero ``mm_token_type_ids`` and ``"name"``
    (``"stdlib:<first module>"``). ``ValueError`` for ``samples`` or ``max_length`` < 1, or when the sources hold fewer
    than ``samples * max_length`` tokens (the message gives how many they hold)."""
    import torch

    if samples < 1 or max_length < 1:
        raise ValueError(f"samples and max_length must be >= 1; got samples={samples}, max_length={max_length}")
    wanted, ids, names = samples * max_length, [], []
    for path in stdlib_sources(seed):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f"# {os.path.basename(path)}\n\n{f.read()}\n\n"
        names.append((len(ids), os.path.basename(path)))
        ids += tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) >= wanted:
            break
    if len(ids) < wanted:
        raise ValueError(f"the standard-library sources hold {len(ids)} tokens, fewer than samples * max_length = "
                         f"{samples} * {max_length}; lower --samples or --max-length")
    examples = []
    for i in range(samples):
        window = torch.tensor(ids[i * max_length:(i + 1) * max_length], dtype=torch.long)
        first = [name for start, name in names if start <= i * max_length][-1]
        examples.append(dict(input_ids=window, labels=window.clone(), mm_token_type_ids=torch.zeros_like(window),
                             name=f"stdlib:{first}"))
    return examples


def chat_inputs(processor, question: str, image=None):
    """Model inputs (batch of 1, torch) for a one-turn chat with the generation prompt and thinking off; ``image``
    (uint8 ``[H, W, 3]``) before the question.
    """
    messages = [_user(question, "image" if image is not None else None)]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                           enable_thinking=False)
    kwargs = dict(images=[image]) if image is not None else {}
    return processor(text=[prompt], return_tensors="pt", **kwargs)


def greedy_ids(model, processor, question: str, image=None, max_new_tokens: int = 48, **generate_kwargs) -> list:
    """The new token ids of :func:`greedy_answer`."""
    import torch

    inputs = chat_inputs(processor, question, image)
    if image is None:  # text only: the text-only class takes no mm_token_type_ids (all zeros here)
        inputs.pop("mm_token_type_ids", None)
    inputs = {k: v.to(model.device) if hasattr(v, "to") else v for k, v in inputs.items()}
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs)
    return generated[0, inputs["input_ids"].shape[1]:].tolist()


def greedy_answer(model, processor, question: str, image=None, max_new_tokens: int = 48, **generate_kwargs) -> str:
    """Greedy answer (at most ``max_new_tokens`` tokens) of ``model`` to ``question`` (and ``image``), decoded and
    stripped.
    """
    new = greedy_ids(model, processor, question, image, max_new_tokens, **generate_kwargs)
    return processor.tokenizer.decode(new, skip_special_tokens=True).strip()
