"""``glm53flash-make-tiny OUT``: write the embedded default checkpoint, a tiny random-init GLM-5.3-Flash.

The folder has the published layout and loads like a release download (text weights with the MTP layer, remote
code, a small vision tower under ``model.visual.*``, a byte-level BPE tokenizer trained on CPython's
``pydoc_data.topics``). Deterministic given ``--seed``; nothing is downloaded. The BPE vocabulary fills ids
``0 .. P-1`` (``P`` = the config's ``pad_token_id``), :data:`SPECIAL_TOKENS` follow in order. ``--fp8`` stores the
tensors the FP8 release quantizes as block-scaled ``float8_e4m3fn`` and builds ``tiny_fp8_config.json`` (64 routed
experts, so that the quantized modules hold most of the weight bytes, as in the release).

Token layout: ``<|endoftext|>`` = ``P`` = pad, ``<|user|>`` = ``P+7``, ``<|observation|>`` = ``P+9`` (the three EOS
ids), image/video begin/end = ``P+10 .. P+13``, ``<|image|>`` = ``P+16``, ``<|video|>`` = ``P+17``; every id in the
config is checked against the tokenizer.
"""

from __future__ import annotations

import json
import os

from . import docstring_parser

HERE = os.path.dirname(os.path.abspath(__file__))
# Shipped inside the package (so non-editable installs have it); configuration/tiny.json links to it.
DEFAULT_CONFIG = os.path.join(HERE, "tiny_config.json")
# The default of ``--fp8``: DEFAULT_CONFIG with more and wider routed experts (configuration/tiny_fp8.json links to it).
DEFAULT_FP8_CONFIG = os.path.join(HERE, "tiny_fp8_config.json")

# GLM special tokens in id order (the release's tokenizer_config.json); the first one sits at the config's pad_token_id.
SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>", "<|image|>", "<|video|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
)

# Added tokens that decode as text (kept by ``decode(..., skip_special_tokens=True)``) so reasoning and tool-call
# parsers see them; they are still never split. The others are special tokens.
TEXT_TAG_TOKENS = frozenset(SPECIAL_TOKENS[SPECIAL_TOKENS.index("<think>") :])

# The sampling defaults of the checkpoint's generation_config.json: those GLM's model cards recommend (temperature 1.0,
# top-p 0.95). With ``do_sample`` off, ``transformers serve`` and pipelines ignore a request's temperature and top_p.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 1.0, "top_p": 0.95}

# Config fields holding special-token ids → the token each must name (``eos_token_id`` is a list).
TOKEN_ID_FIELDS = {
    "pad_token_id": "<|endoftext|>",
    "eos_token_id": ["<|endoftext|>", "<|user|>", "<|observation|>"],
    "image_token_id": "<|image|>",
    "video_token_id": "<|video|>",
    "image_start_token_id": "<|begin_of_image|>",
    "image_end_token_id": "<|end_of_image|>",
    "video_start_token_id": "<|begin_of_video|>",
    "video_end_token_id": "<|end_of_video|>",
}

# GPT-4-style split before byte-level encoding (contractions, letter runs, up to 3 digits, punctuation, spaces).
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def corpus_texts() -> list[str]:
    """The training text: every topic of CPython's ``pydoc_data.topics``, in sorted topic order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def train_tokenizer(bpe_vocab_size: int):
    """A deterministic ``tokenizers.Tokenizer``: ``bpe_vocab_size`` byte-level BPE tokens, then :data:`SPECIAL_TOKENS`
    (``special=True`` except :data:`TEXT_TAG_TOKENS`); ``ValueError`` when ``bpe_vocab_size`` is below the 256-byte
    alphabet or the corpus cannot fill it."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if bpe_vocab_size <= len(alphabet):
        raise ValueError(f"the BPE vocabulary (pad_token_id={bpe_vocab_size}) must exceed the {len(alphabet)}-symbol "
                         "byte alphabet")
    tokenizer = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab_size, show_progress=False, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(corpus_texts(), trainer=trainer)
    if tokenizer.get_vocab_size() != bpe_vocab_size:
        raise ValueError(f"BPE training on pydoc_data.topics reached {tokenizer.get_vocab_size()} tokens, not the "
                         f"{bpe_vocab_size} requested (pad_token_id)")
    for token in SPECIAL_TOKENS:  # one at a time: ids follow SPECIAL_TOKENS order
        text = token in TEXT_TAG_TOKENS
        add = tokenizer.add_tokens if text else tokenizer.add_special_tokens
        add([AddedToken(token, special=not text, normalized=False)])
    return tokenizer


def check_token_ids(config, tokenizer) -> None:
    """Check every special-token id field of ``config`` (top level and ``text_config``) against ``tokenizer``;
    ``ValueError`` naming the field, its value and the id the tokenizer gives the token, or when the tokenizer does
    not fit in the text config's ``vocab_size``."""
    text = config.get_text_config(decoder=True)
    n_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if n_tokens > text.vocab_size:
        raise ValueError(f"the tokenizer has {n_tokens} tokens but text_config.vocab_size={text.vocab_size}")
    for field, token in TOKEN_ID_FIELDS.items():
        expected = list(map(tokenizer.token_to_id, token)) if isinstance(token, list) else tokenizer.token_to_id(token)
        # pad/eos must be in text_config, the media ids at the top level; a copy elsewhere must agree too.
        home = text if field in ("pad_token_id", "eos_token_id") else config
        for owner, name in ((config, "config"), (text, "text_config")):
            value = getattr(owner, field, None)
            if value is None and owner is not home:
                continue
            if value != expected:
                raise ValueError(f"{name}.{field}={value!r} does not match the tokenizer ({token!r} -> {expected!r}); "
                                 "the special tokens start at pad_token_id and follow "
                                 "glm53flash_hf.tools.make_tiny.SPECIAL_TOKENS")


def _tensor_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def add_vision_and_fp8(out: str, vision_state: dict, total_parameters: int, fp8: bool) -> None:
    """Rewrite the text shards (FP8 when ``fp8``), add ``vision_state`` as the last shard, and write the index."""
    from safetensors.torch import load_file, save_file

    from ..checkpoint_io import SAFETENSORS_INDEX, read_weight_map, write_json
    from ..fp8_blockwise import fp8_keys_of, quantize_fp8_blockwise

    weight_map = read_weight_map(out)
    files = sorted(set(weight_map.values()))
    fp8_keys = fp8_keys_of(weight_map) if fp8 else set()
    n = len(files) + 1
    new_map: dict[str, str] = {}
    total_size = 0
    for i, name in enumerate(files):
        tensors = load_file(os.path.join(out, name))
        for key in sorted(fp8_keys & tensors.keys()):  # the weight in e4m3 and its <key>_scale_inv
            tensors[key], tensors[key + "_scale_inv"] = quantize_fp8_blockwise(tensors[key])
        new_name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.remove(os.path.join(out, name))
        save_file(tensors, os.path.join(out, new_name), metadata={"format": "pt"})
        new_map.update({k: new_name for k in tensors})
        total_size += _tensor_bytes(tensors)
    vision_name = f"model-{n:05d}-of-{n:05d}.safetensors"
    save_file(vision_state, os.path.join(out, vision_name), metadata={"format": "pt"})
    new_map.update({k: vision_name for k in vision_state})
    total_size += _tensor_bytes(vision_state)
    index = {"metadata": {"total_parameters": total_parameters, "total_size": total_size},
             "weight_map": dict(sorted(new_map.items()))}
    write_json(index, os.path.join(out, SAFETENSORS_INDEX), sort_keys=True)


def make_tiny(out: str, config_path: str | None = None, seed: int = 0, fp8: bool = False,
              dtype: str = "bfloat16", overwrite: bool = False, show_progress: bool = True) -> str:
    """Write the tiny checkpoint folder ``out`` (empty unless ``overwrite``) atomically
    (:func:`glm53flash_hf.checkpoint_io.atomic_save`); return ``out``.

    ``config_path``: a GLM-5.3-Flash ``config.json`` with ``text_config`` and ``vision_config`` (default
    :data:`DEFAULT_FP8_CONFIG` with ``fp8``, else :data:`DEFAULT_CONFIG`); ``seed``: ``torch.manual_seed`` of the text
    model's initialisation (vision: ``seed + 1``); ``dtype``: ``"bfloat16"`` or ``"float32"`` (fp32-kept parameters
    stay fp32). ``ValueError`` for a bad ``dtype``, a non-empty ``out`` without ``overwrite``, or config token ids
    that do not match the tokenizer layout.
    """
    import torch
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    from ..checkpoint_io import atomic_save
    from ..configuration_glm53flash import Glm53FlashConfig

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {sorted(dtypes)}; got dtype={dtype!r}")
    if config_path is None:
        config_path = DEFAULT_FP8_CONFIG if fp8 else DEFAULT_CONFIG
    with open(config_path) as f:
        raw = json.load(f)
    for section in ("text_config", "vision_config"):
        if not isinstance(raw.get(section), dict):
            raise ValueError(f"{config_path}: needs a {section!r} object (the defaults are the full-size release)")
    config = Glm53FlashConfig.from_dict(raw)
    text = config.get_text_config(decoder=True)
    if not isinstance(text.pad_token_id, int):
        raise ValueError(f"{config_path}: text_config.pad_token_id must be an int (first special token id); got "
                         f"{text.pad_token_id!r}")
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    if not show_progress:
        hf_logging.disable_progress_bar()
    try:
        bar = tqdm(total=5, desc="glm53flash-make-tiny", disable=not show_progress)
        with torch.random.fork_rng(devices=[]), bar:  # the caller's global RNG state is left as it was
            bar.set_postfix_str("tokenizer")
            tokenizer = train_tokenizer(text.pad_token_id)
            check_token_ids(config, tokenizer)
            if os.path.exists(out) and not os.path.isdir(out):
                raise ValueError(f"OUT={out!r} exists and is not a folder")
            if os.path.isdir(out) and os.listdir(out) and not overwrite:
                raise ValueError(f"OUT={out!r} is not empty; pass --overwrite to replace the checkpoint files in it")
            bar.update(1)
            atomic_save(out, lambda tmp: _write_folder(tmp, config, text, tokenizer, seed, fp8, dtypes[dtype], bar))
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
    return out


def _write_folder(out, config, text, tokenizer, seed, fp8, dtype, bar) -> None:
    """Write the checkpoint into the empty folder ``out``."""
    import torch
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    from ..checkpoint_io import read_json, write_json
    from ..fp8_blockwise import fp8_quantization_config
    from ..modeling_glm53flash import Glm53FlashForCausalLM
    from ..processing_glm53flash import Glm53FlashProcessor, Glm53FlashVideoProcessor

    bar.set_postfix_str("text model")
    torch.manual_seed(seed)
    model = Glm53FlashForCausalLM._from_config(config, dtype=dtype)
    model.generation_config.update(**SAMPLING_DEFAULTS)
    model.save_pretrained(out)
    total_parameters = model.num_parameters()
    del model
    bar.update(1)

    bar.set_postfix_str("vision tower" + (" + fp8" if fp8 else ""))
    torch.manual_seed(seed + 1)
    vision = Glm5NextVisionModel._from_config(config.vision_config, dtype=dtype)
    vision_state = {f"model.visual.{k}": v.contiguous() for k, v in sorted(vision.state_dict().items())}
    total_parameters += vision.num_parameters()
    add_vision_and_fp8(out, vision_state, total_parameters, fp8)
    if fp8:
        path = os.path.join(out, "config.json")
        write_json(read_json(path) | {"quantization_config": fp8_quantization_config()}, path, sort_keys=True)
    bar.update(2)

    bar.set_postfix_str("save tokenizer + processor")
    PreTrainedTokenizerFast(  # <|endoftext|> as EOS and pad, the other GLM special tokens as extra special tokens
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left",
        clean_up_tokenization_spaces=False, model_max_length=text.max_position_embeddings,
        extra_special_tokens=[t for t in SPECIAL_TOKENS[1:] if t not in TEXT_TAG_TOKENS],
    ).save_pretrained(out)
    vc = config.vision_config  # the processors take the vision tower's patch / merge sizes
    sizes = dict(patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size)
    processor = Glm53FlashProcessor(Glm5NextImageProcessorPil(**sizes), AutoTokenizer.from_pretrained(out),
                                    Glm53FlashVideoProcessor(**sizes))
    processor.save_pretrained(out)
    bar.update(1)


def main(argv=None) -> int:
    """Command-line entry point of ``glm53flash-make-tiny``; returns the exit status."""
    parser = docstring_parser("glm53flash-make-tiny", __doc__)
    parser.add_argument("out", metavar="OUT", help="folder to write (created; must be empty unless --overwrite)")
    parser.add_argument("--fp8", action="store_true",
                        help="store the tensors the FP8 release quantizes (experts, shared experts, dense MLPs, 4 "
                             "DSA/MTP projections) as float8_e4m3fn with 128x128-block <key>_scale_inv, and write "
                             "quantization_config; without --config, the model of tiny_fp8_config.json "
                             "(configuration/tiny_fp8.json: 64 routed experts of intermediate 128, so that the FP8 "
                             "modules hold most of the bytes, as in the release)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed of the weights (text: seed, vision: seed+1); default 0")
    parser.add_argument("--config", default=None,
                        help="model config JSON with text_config and vision_config (default: the package's "
                             "tiny_config.json, the same file as configuration/tiny.json; with --fp8, "
                             "tiny_fp8_config.json); its special-token ids must follow the layout described below")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="dtype of the stored weights (default bfloat16, as the release); fp32-kept parameters "
                             "stay float32")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty OUT, removing its old safetensors files")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        make_tiny(args.out, config_path=args.config, seed=args.seed, fp8=args.fp8, dtype=args.dtype,
                  overwrite=args.overwrite, show_progress=not args.quiet)
    except (ValueError, FileNotFoundError) as error:  # user mistakes: one clean line, no traceback
        parser.error(str(error))
    print(f"wrote {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
