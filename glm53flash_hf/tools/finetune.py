"""``glm53flash-finetune``: supervised fine-tuning of GLM-5.3-Flash with the HF Trainer, end to end.

With no arguments it runs the embedded default on CPU in a few minutes: it makes the tiny checkpoint
``./glm53flash-tiny`` when absent, builds an SFT set from CPython's ``pydoc_data.topics`` and scikit-image's photos
and GIF, trains with ``transformers.Trainer`` (packed rows, MTP loss, LoRA on the projections and the routed experts,
or ``--full``), saves a Hub-style folder (merged weights, remote code, processor; with LoRA the adapters in
``<output-dir>/adapter`` for the causal LM and ``<output-dir>/adapter-vl`` for the VL model) that replaces
``--output-dir`` as a unit, and reloads it in a fresh process to answer a held-out question and an image prompt.
A NaN / inf loss, gradient norm or weight stops the job naming the step.

``--model PATH`` fine-tunes another checkpoint. Under ``accelerate launch`` (``configuration/accelerate_*.yaml``)
the Trainer shards the model (FSDP2); ``--ep N`` adds expert parallelism and ``--sp N`` sequence parallelism (text
samples only).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import shutil
import time
from dataclasses import dataclass

from .reload_check import run_reload_check
from .sft_data import (
    DEFAULT_HELD_OUT,
    IGNORE_INDEX,
    IMAGE_PROMPT,
    PROBE_PHOTO,
    build_long_text_dataset,
    build_sft_dataset,
    chat_inputs,
    explain_prompt,
    greedy_answer,
    load_photo,
    text_topics,
)

DEFAULT_MODEL = "glm53flash-tiny"
DEFAULT_OUTPUT_DIR = "glm53flash-finetune-out"
LOSS_LOG = "loss_log.jsonl"
#: The LoRA adapters: for ``Glm53FlashForCausalLM`` (task type ``CAUSAL_LM``, ``peft.AutoPeftModelForCausalLM``) and
#: for ``Glm53FlashForConditionalGeneration`` (no task type, ``auto_mapping`` ``AutoModelForImageTextToText``,
#: ``peft.AutoPeftModel``); the same tensors under each class's names (``glm53flash_hf.train.adapters``).
ADAPTER_DIR = "adapter"
ADAPTER_VL_DIR = "adapter-vl"


def loss_summary(losses: list[float], k: int = 3) -> tuple[float, float, int]:
    """``(first, last, n)``: means of the first and the last ``n = max(1, min(k, len(losses) // 2))`` logged losses.

    Raises:
        ValueError: no loss was logged, or a logged loss is NaN / inf (names the first such, 1-based).
    """
    if not losses:
        raise ValueError("no training loss was logged (max_steps must be >= 1)")
    bad = [i for i, loss in enumerate(losses) if not math.isfinite(loss)]
    if bad:
        raise ValueError(f"logged loss {bad[0] + 1} of {len(losses)} is {losses[bad[0]]}: a non-finite run has no "
                         "first / last loss to compare")
    n = max(1, min(k, len(losses) // 2))
    return sum(losses[:n]) / n, sum(losses[-n:]) / n, n


def _fsdp_launch() -> bool:
    """Whether ``accelerate launch`` was configured for FSDP (it exports ``ACCELERATE_USE_FSDP=true``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


def _resolve_dtype(args):
    """``--dtype`` as a torch dtype (``auto``: bfloat16 on a single CUDA device, float32 on CPU and under FSDP or
    ``--ep``: fp32 masters, the mixed-precision policy computes in bf16)."""
    import torch

    if args.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and not _fsdp_launch() and args.ep == 1 else torch.float32
    return getattr(torch, args.dtype)


def _reduce(accelerator, value: int, reduction: str) -> int:
    """``value`` reduced over every process (``"sum"`` / ``"max"``); as is on a single process."""
    import torch

    if accelerator is None or accelerator.num_processes == 1:
        return value
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction=reduction))


class OutputBusyError(RuntimeError):
    """The output folder is held by another running ``glm53flash-finetune`` (see :func:`output_lock`)."""


def _sibling(out: str, suffix: str) -> str:
    """``<parent>/.<name>.<suffix>`` beside the folder ``out`` resolves to (symbolic links followed)."""
    parent, name = os.path.split(os.path.realpath(os.path.abspath(out)))
    return os.path.join(parent, f".{name}.{suffix}")


def staging_folder(out: str) -> str:
    """The sibling ``.<name>.staging`` of ``out``, where a run writes its output before it replaces ``out``."""
    return _sibling(out, "staging")


@contextlib.contextmanager
def output_lock(out: str):
    """Hold the output folder ``out`` for one run (an exclusive ``flock`` on the sibling ``.<name>.lock``); yields the
    lock file's path.

    Raises:
        OutputBusyError: another process holds ``out`` (names the folder, the holder's pid and the lock file).
    """
    from ..checkpoint_io import FileLock

    path = _sibling(out, "lock")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock = FileLock(path, create=True)
    try:
        if not lock.acquire(wait=False):
            with open(path, errors="replace") as f:
                holder = f.read(64).strip() or "unknown"
            raise OutputBusyError(f"{out!r} is in use by another glm53flash-finetune run (pid {holder}, lock file "
                                  f"{path}); wait for it to end or choose another --output-dir")
        if lock.fd is not None:
            os.ftruncate(lock.fd, 0)
            os.pwrite(lock.fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        lock.release()


class PublishError(RuntimeError):
    """Replacing ``--output-dir`` by the run's staging folder failed; the staging folder is kept, complete, and named
    in the message (see :func:`_publish`)."""


def _publish(staging: str, out: str) -> None:
    """Replace ``out`` by the complete folder ``staging`` (:func:`glm53flash_hf.checkpoint_io.atomic_save`): every entry
    of ``staging`` is hard-linked, or copied where ``out`` lies on another file system (``EXDEV``, e.g. a mount point),
    into the save's temporary folder on ``out``'s file system, which is then swapped in; ``staging`` is removed once
    ``out`` holds the new folder.

    Raises:
        PublishError: anything failed; ``out`` holds its old or new content as a whole and ``staging`` (the run's only
            complete copy) is left in place, its path in the message.
    """
    from ..checkpoint_io import atomic_save, link_or_copy_entries

    try:
        atomic_save(out, lambda folder: link_or_copy_entries(staging, folder))
    except Exception as error:
        with contextlib.suppress(OSError):  # the mark keeps the folder from the next run's cleanup
            with open(os.path.join(staging, UNPUBLISHED_MARK), "w") as f:
                f.write(f"{type(error).__name__}: {error}\n")
        raise PublishError(
            f"could not publish the run's output into {out} ({type(error).__name__}: {error}); the complete output "
            f"(loss log, adapters, model) is kept in {staging}: copy it from there (the next run into this "
            f"--output-dir moves it to a sibling {_sibling(out, 'unpublished')}-<time> and keeps it)") from error
    shutil.rmtree(staging)


#: File that a failed publish writes into the staging folder it keeps (holds the error).
UNPUBLISHED_MARK = ".glm53flash-unpublished"


def clear_staging(staging: str, out: str) -> str | None:
    """Empty ``staging`` for a new run into ``out``: the leftover of a killed run is removed; a folder kept by a
    failed publish (:data:`UNPUBLISHED_MARK`) is renamed to the sibling ``.<name>.unpublished-<UTC time>`` and kept.
    Returns that folder's path, or None."""
    kept = None
    if os.path.isfile(os.path.join(staging, UNPUBLISHED_MARK)):
        kept = f"{_sibling(out, 'unpublished')}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        while os.path.lexists(kept):
            kept += "x"
        os.rename(staging, kept)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return kept


def check_finite(model, what: str, accelerator=None) -> None:
    """Raise unless every floating-point parameter and buffer of ``model`` is finite (on every process).

    Raises:
        FloatingPointError: naming ``what``, the number of tensors holding NaN / inf and the first few names.
    """
    from ..checkpoint_checks import nonfinite_tensors

    bad = nonfinite_tensors([*model.named_parameters(), *model.named_buffers()])
    count = _reduce(accelerator, len(bad), "sum")
    if count:
        names = f": {'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}" if bad else " (on other processes)"
        raise FloatingPointError(f"{what} holds non-finite values (NaN / inf) in {count} tensors{names}; nothing "
                                 "was saved")


class DeadModelError(FloatingPointError):
    """The trained (or merged) model no longer predicts, though every weight is finite (see
    :func:`check_predicts`)."""


def logit_degeneracy(logits) -> str | None:
    """Why the logits ``[..., positions, vocab]`` carry no prediction, or None: the same value for every token of the
    vocabulary at every position (e.g. every logit 0.0, what RMS norms whose squares overflow to inf leave), or the
    same vector at every position (``positions > 1``)."""
    lg = logits.detach().float()
    if bool((lg.amax(-1) == lg.amin(-1)).all()):
        values = lg[..., 0].unique()
        return "constant across the vocabulary (" + (
            f"every logit {float(values[0])}" if values.numel() == 1 else "each position's logits all equal") + ")"
    if lg.shape[-2] > 1 and bool((lg == lg[..., :1, :]).all()):
        return f"the same at every one of the {lg.shape[-2]} positions"
    return None


def check_predicts(model, processor, question: str, what: str, learning_rate: float, accelerator=None) -> None:
    """Raise unless ``model`` still predicts on the chat prompt for ``question`` (eval mode, no grad; a collective
    forward on every process under FSDP / ``--ep``): its logits must not be constant (:func:`logit_degeneracy`) and
    no RMS norm may see a NaN / inf mean square (weights near 1e30 are finite, their squares are not).

    Raises:
        DeadModelError: naming ``what``, the logits' state, the first such norm and ``learning_rate``.
    """
    import torch

    found: list = []  # (name, value) of the first RMS norm whose input's float32 mean square is NaN / inf

    def record(name, module, args, output):
        if found or not args or not torch.is_tensor(args[0]):
            return
        stat = args[0].detach().float().pow(2).mean(-1)
        bad = ~torch.isfinite(stat)
        if bool(bad.any()):
            found.append((name, float(stat[bad].flatten()[0])))

    handles = [module.register_forward_hook(functools.partial(record, name)) for name, module in model.named_modules()
               if "RMSNorm" in type(module).__name__]
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in chat_inputs(processor, question).items()}
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    degenerate = logit_degeneracy(logits)
    if not _reduce(accelerator, int(degenerate is not None or bool(found)), "max"):
        return
    reasons = [f"its logits are {degenerate}" if degenerate else "its logits on other processes are degenerate"]
    if found:
        name, value = found[0]
        reasons.append(f"the RMS norm {name} divides by a mean square of {value} (its input's squares overflow "
                       "float32)")
    elif degenerate is None:
        reasons = ["another process found degenerate logits or a non-finite RMS norm statistic"]
    raise DeadModelError(f"{what} no longer predicts: on the prompt {question!r} {'; '.join(reasons)}; the learning "
                         f"rate {learning_rate:g} may be too large; nothing was saved")


def check_loss_moved(losses: list[float], learning_rate: float) -> None:
    """Raise when two or more logged losses are all exactly equal (a model that stopped predicting gives the same
    loss on every batch).

    Raises:
        DeadModelError: naming the number of losses, their value and ``learning_rate``.
    """
    if len(losses) >= 2 and all(loss == losses[0] for loss in losses):
        raise DeadModelError(f"the training loss never moved: all {len(losses)} logged losses are {losses[0]}; the "
                             f"learning rate {learning_rate:g} may be too large (or too small); nothing was saved")


def _save_trained(trainer, path: str, main_process: bool, processor=None) -> None:
    """Save the trained model (PEFT: the adapter) and ``processor`` to ``path`` atomically (FSDP: gathered, collective).
    """
    from ..checkpoint_io import atomic_save

    state_dict = trainer.accelerator.get_state_dict(trainer.model) if trainer.is_fsdp_enabled else None
    if not main_process:
        return

    def write(folder: str) -> None:
        if state_dict is None:
            trainer.save_model(folder)
        else:
            trainer.accelerator.unwrap_model(trainer.model).save_pretrained(folder, state_dict=state_dict)
        if processor is not None:
            processor.save_pretrained(folder)

    atomic_save(path, write)


def load_model(path: str, dtype):
    """The VL model (``Glm53FlashForConditionalGeneration``) from ``path``, by this package's class."""
    from ..modeling_glm53flash import Glm53FlashForConditionalGeneration

    model = Glm53FlashForConditionalGeneration.from_pretrained(path, dtype=dtype)
    model.config.use_cache = False
    return model


def check_saved_folder(out: str, adapter: bool) -> list[str]:
    """Check that ``out`` is a self-contained Hub-style folder (configs with their ``auto_map`` modules, weights,
    tokenizer, chat template; with ``adapter``, both adapters' files); return the list of files found.

    Raises:
        RuntimeError: naming every missing piece.
    """
    from ..checkpoint_io import read_json

    files = sorted(os.listdir(out))
    missing = []
    for config_name, autos in (("config.json", ("AutoConfig", "AutoModelForCausalLM", "AutoModelForImageTextToText")),
                               ("processor_config.json", ("AutoProcessor",))):
        path = os.path.join(out, config_name)
        config = read_json(path) if os.path.isfile(path) else {}
        if not config:
            missing.append(config_name)
        auto_map = config.get("auto_map", {})
        for auto in autos:
            module = auto_map[auto].split("--")[-1].rsplit(".", 1)[0] if auto in auto_map else None
            if module is None:
                missing.append(f"{config_name} auto_map[{auto!r}]")
            elif f"{module}.py" not in files:
                missing.append(f"{module}.py (remote code for {auto})")
    if not any(f.endswith(".safetensors") for f in files):
        missing.append("*.safetensors weights")
    adapter_files = ("adapter_config.json", "adapter_model.safetensors") if adapter else ()
    adapters = [f"{folder}/{name}" for folder in (ADAPTER_DIR, ADAPTER_VL_DIR) for name in adapter_files]
    required = ["tokenizer.json", "chat_template.jinja"] + adapters
    missing += [name for name in required if not os.path.isfile(os.path.join(out, name))]
    if missing:
        raise RuntimeError(f"the saved folder {out} is incomplete; missing: {', '.join(missing)}")
    return files


def merge_adapter(base_path: str, adapter_dir: str, dtype, merged_format: str = "fp8"):
    """The base VL model from ``base_path`` (CPU, ``dtype``) with the LoRA adapter in ``adapter_dir`` merged
    (``merge_and_unload()``); an FP8 base is merged by :func:`glm53flash_hf.train.fp8_lora.merge_lora_fp8` in
    ``merged_format`` (report in ``model.fp8_merge_report``, None for a dense base).

    Raises:
        ValueError: ``merged_format`` not ``"fp8"`` or ``"dense"``.
    """
    from peft import PeftModel

    if merged_format not in ("fp8", "dense"):
        raise ValueError(f"merged_format must be 'fp8' or 'dense'; got {merged_format!r}")
    base = load_model(base_path, dtype)
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    if getattr(base, "hf_quantizer", None) is None:
        model, report = peft_model.merge_and_unload(), None
    else:
        from ..train.fp8_lora import merge_lora_fp8

        model, report = merge_lora_fp8(peft_model, fp8=merged_format == "fp8", dtype=dtype)
    model.fp8_merge_report = report
    return model


#: Largest ``max |logit difference| / max(1, max |logit|)`` accepted between the trained LoRA model (adapter applied
#: on the fly) and the merged model, in float32 (``docs/design.md``, "Tools").
MERGE_RTOL = 2e-5
#: Largest ``max |requantized - merged| / max |merged|`` of one weight merged into an FP8 base and re-quantized to
#: e4m3 (3 mantissa bits: rounding to nearest errs by at most 2**-4 of the value).
FP8_ROUNDTRIP_RTOL = 2.0**-4
#: Largest elementwise ``|requantized - merged| / glm53flash_hf.fp8_blockwise.roundtrip_error_bound`` of an FP8 merge.
FP8_BOUND_RATIO = 1.0


def max_logit_difference(model_a, model_b, processor, question: str) -> tuple[float, float, str | None]:
    """``(max |logits_a - logits_b|, max |logits_a|, degenerate)`` of two models on the chat prompt for ``question``
    and on the :data:`PROBE_PHOTO` image prompt (eval mode, no grad); ``degenerate`` names the first model and prompt
    whose logits carry no prediction (:func:`logit_degeneracy`: two constant models agree without proving anything),
    else None.
    """
    import torch

    diff = scale = 0.0
    degenerate = None
    prompts = (("text", chat_inputs(processor, question)),
               ("image", chat_inputs(processor, IMAGE_PROMPT, load_photo(PROBE_PHOTO))))
    for prompt, inputs in prompts:
        with torch.no_grad():
            a = model_a.eval()(**inputs).logits.float()
            b = model_b.eval()(**inputs).logits.float()
        diff = max(diff, float((a - b).abs().max()))
        scale = max(scale, float(a.abs().max()))
        for which, logits in (("first", a), ("second", b)):
            why = logit_degeneracy(logits)
            if degenerate is None and why is not None:
                degenerate = f"the {which} model's logits on the {prompt} prompt are {why}"
    return diff, scale, degenerate


def build_parser() -> argparse.ArgumentParser:
    """The command-line options of ``glm53flash-finetune``."""
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
    parser.add_argument("--long-text", action="store_true",
                        help="long context: the text samples are --samples windows of exactly --max-length tokens "
                             "cut from CPython's standard-library sources concatenated, every token trained, instead "
                             "of the pydoc chats (e.g. --long-text --max-length 131072 --samples 2 --batch-size 1 "
                             "--gradient-checkpointing)")
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
                             "With LoRA the updated router biases are saved in both adapters and the merged model")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="weights dtype for training and saving (auto: float32 on CPU and under FSDP or --ep, "
                             "bfloat16 on one GPU)")
    parser.add_argument("--sp", type=int, default=1,
                        help="sequence parallelism: ranks per SP group, each holding a contiguous 1/N of every row "
                             "(needs a launch of a multiple of N processes; text samples only; default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data order and the LoRA init")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size: shard the routed experts over this many ranks (under "
                             "accelerate launch --config_file configuration/accelerate_ep2.yaml; "
                             "default: %(default)s, no EP)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per answer after training")
    parser.add_argument("--no-reload", action="store_true", help="skip the fresh-process reload and generation")
    parser.add_argument("--merged-format", choices=("fp8", "dense"), default="fp8",
                        help="LoRA on an FP8 checkpoint: write the merged model re-quantized to block-scaled FP8 "
                             "(default) or dense in --dtype")
    parser.add_argument("--malloc", choices=("auto", "bounded", "reuse", "default"), default="auto",
                        help="heap policy of this process (glibc; glm53flash_hf.train.malloc): bounded returns every "
                             "block of 2 MiB or more on free (resident memory close to the live tensors); reuse keeps "
                             "freed blocks for the next step (fewer page faults, up to 2x the resident memory); auto: "
                             "bounded when no CUDA device is available (training on CPU); default: leave malloc as it "
                             "is. bounded and reuse also turn on transparent huge pages for torch's large blocks "
                             "unless THP_MEM_ALLOC_ENABLE is set (default: %(default)s)")
    return parser


def malloc_policy(choice: str, cuda_available: bool) -> str:
    """The heap policy ``--malloc`` asks for (``auto``: ``"bounded"`` without CUDA, else ``"default"``)."""
    return ("default" if cuda_available else "bounded") if choice == "auto" else choice


def _looks_local(path: str) -> bool:
    """Whether ``--model`` names a local folder rather than a Hub id."""
    if os.path.exists(path) or os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1:
        return True
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return True
    return False


def _check_args(parser, args) -> None:
    """``parser.error`` naming the option and value for every out-of-range option and conflicting pair."""
    from . import check_output_folder

    at_least_1 = ("lora_r", "max_steps", "batch_size", "grad_accum", "max_length", "max_new_tokens", "sp", "ep")
    for name, low in [(name, 1) for name in at_least_1] + [("answer_chars", 40), ("warmup_steps", 0)]:
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}; got {getattr(args, name)}")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed must be between 0 and 2**32 - 1; got {args.seed}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be > 0 and finite; got {args.lr}")
    if not (math.isfinite(args.balance_speed) and args.balance_speed >= 0):
        parser.error(f"--balance-speed must be >= 0 and finite; got {args.balance_speed}")
    if args.model != DEFAULT_MODEL and _looks_local(args.model):
        if not os.path.isdir(args.model):
            parser.error(f"--model {args.model!r}: no such folder (a checkpoint folder or a Hub id is expected)")
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            parser.error(f"--model {args.model!r}: the folder holds no config.json, so no checkpoint")
    try:
        check_output_folder(args.output_dir, args.model, out_name="--output-dir", source_name="--model")
    except ValueError as error:
        parser.error(str(error))
    if args.samples < 0 or (args.samples == 0 and args.no_media):
        parser.error(f"--samples must be >= 1 (or >= 0 with media); got {args.samples}")
    if args.sp > 1:
        args.no_media = True  # the vision tower is not sequence-parallel: text samples only
    if args.ep > 1 and args.sp > 1:
        parser.error(f"--ep and --sp cannot be combined yet; got --ep {args.ep} --sp {args.sp}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.ep > 1 and world % args.ep:  # also refuses a single process
        parser.error(f"--ep {args.ep} needs a launch of several processes whose number it divides (accelerate launch "
                     f"/ torchrun); got {world} process{'es' if world > 1 else ''}")
    if args.ep > 1 and _fsdp_launch():
        parser.error("--ep builds its own FSDP2 layout: launch with configuration/accelerate_ep2.yaml, not an FSDP "
                     "accelerate config")
    try:
        text_topics(args.samples, args.held_out, args.seed)
    except KeyError as error:
        parser.error(f"--held-out: {error.args[0]}")
    except ValueError as error:
        parser.error(str(error))


@dataclass
class Job:
    """What the steps of one ``glm53flash-finetune`` run share."""

    args: argparse.Namespace
    out: str  # absolute output folder
    staging: str  # where the run writes its output before it replaces ``out``
    dtype: object
    training_args: object
    main_process: bool  # process 0: it alone prints, saves and verifies
    model_path: str = ""  # the checkpoint trained; set by prepare()
    ep_plan: object = None  # the ExpertParallelPlan under --ep N > 1
    processor: object = None  # the checkpoint's processor; set by prepare()

    def say(self, *parts) -> None:
        """Print on the main process only."""
        if self.main_process:
            print(*parts, flush=True)


def training_arguments(args, out: str, dtype):
    """The ``TrainingArguments`` of the job: linear schedule with warm-up, one log per step, no intermediate saves."""
    import torch
    from transformers import TrainingArguments

    lr = args.lr if args.lr is not None else (1e-3 if args.full else 5e-3)
    bf16 = torch.cuda.is_available() and (dtype == torch.bfloat16 or (
        (_fsdp_launch() or args.ep > 1) and os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16"))
    return TrainingArguments(
        output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, learning_rate=lr, lr_scheduler_type="linear",
        warmup_steps=args.warmup_steps, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        report_to=[], remove_unused_columns=False, label_names=["labels"], dataloader_num_workers=0, seed=args.seed,
        data_seed=args.seed, bf16=bf16, dataloader_pin_memory=torch.cuda.is_available(),
        activation_checkpointing=args.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if args.gradient_checkpointing else None,
    )  # fmt: skip


def prepare(job: Job):
    """Step 1: make the embedded checkpoint when absent, load processor and VL model, build the SFT set. Returns
    ``(processor, model, dataset)``.
    """
    args = job.args
    with job.training_args.main_process_first(desc="checkpoint"):
        if args.model == DEFAULT_MODEL and not os.path.exists(os.path.join(args.model, "config.json")):
            from .make_tiny import make_tiny

            job.say(f"making the embedded tiny checkpoint in ./{args.model} ...")
            if job.main_process:
                make_tiny(args.model, show_progress=False)
    job.model_path = os.path.abspath(args.model) if os.path.isdir(args.model) else args.model
    from ..processing_glm53flash import Glm53FlashProcessor

    processor = job.processor = Glm53FlashProcessor.from_pretrained(job.model_path)
    model = load_model(job.model_path, job.dtype)
    if args.ep > 1:
        from ..train.distributed import process_mesh
        from ..train.expert_parallel import apply_expert_parallel

        job.ep_plan = apply_expert_parallel(model, process_mesh(args.ep, ("dp", "ep"), "--ep"))
        job.say(f"expert parallelism: mesh (dp={job.ep_plan.dp_size}, ep={job.ep_plan.ep_size}), "
                f"{len(job.ep_plan.moe_modules)} MoE blocks, rank {job.ep_plan.ep_rank} of the ep group holds experts "
                f"[{job.ep_plan.ep_rank} * E/{args.ep}, ...)")
    dataset = build_sft_dataset(processor, 0 if args.long_text else args.samples, args.held_out, args.seed,
                                args.max_length, args.answer_chars, media=not args.no_media)
    if args.long_text:
        dataset = build_long_text_dataset(processor.tokenizer, args.samples, args.max_length, args.seed) + dataset
    n_tokens = sum(len(e["input_ids"]) for e in dataset)
    n_trained = sum(int((e["labels"] != IGNORE_INDEX).sum()) for e in dataset)
    n_media = sum(1 for e in dataset if not e["name"].startswith(("topic:", "stdlib:")))
    job.say(f"model: {job.model_path} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
            f"{job.dtype})")
    text = (f"windows of {args.max_length} tokens from the standard-library sources" if args.long_text
            else "'Explain <topic>' samples from pydoc_data.topics")
    job.say(f"SFT set: {len(dataset) - n_media} {text} + {n_media} image/video samples from scikit-image; {n_tokens} "
            f"tokens, {n_trained} trained ({'every text token' if args.long_text else 'answers only'}); held out: "
            f"{explain_prompt(args.held_out)!r}")
    return processor, model, dataset


def build_trainer(job: Job, processor, model, dataset):
    """Step 2: LoRA (unless ``--full``) and the :class:`Glm53FlashTrainer` with collator and callbacks."""
    import torch
    from transformers import ProgressCallback

    from ..train.collator import Glm53FlashPackingCollator
    from ..train.distributed import shard_fp32_kept_units
    from ..train.expert_parallel import apply_fsdp2_ep, clip_grad_norm_ep
    from ..train.trainer import (
        AuxLossFreeBalancingCallback,
        Glm53FlashTrainer,
        LossLogCallback,
        ProgressWithLossCallback,
        default_lora_config,
    )

    args = job.args
    text_config = model.config.get_text_config(decoder=True)
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
    job.say(f"training: {mode}, {trainable / 1e6:.3f} M trainable parameters, lr {job.training_args.learning_rate:g}, "
            f"{args.max_steps} steps x {args.batch_size} samples packed into rows of <= {args.max_length} tokens, "
            "MTP loss " + (f"on (weight {text_config.mtp_loss_weight:g})" if mtp else "off"))
    if job.ep_plan is not None:
        # experts on the dp mesh, the rest on all ranks, every reduction group checked; the Trainer then leaves the
        # model as it is (no DDP wrap, no second sharding)
        apply_fsdp2_ep(model, job.ep_plan, param_dtype=torch.bfloat16 if job.training_args.bf16 else None)
        # the Trainer reads the property through PEFT's attribute forwarding, which ends at the base model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base._is_distributed_loading_by_transformers = True
    callbacks = [ProgressWithLossCallback(), LossLogCallback(os.path.join(job.staging, LOSS_LOG))]
    if args.balance_speed > 0:
        callbacks.append(AuxLossFreeBalancingCallback(speed=args.balance_speed))
    pad = processor.tokenizer.pad_token_id
    trainer = Glm53FlashTrainer(
        model=model, args=job.training_args, train_dataset=dataset, callbacks=callbacks, pad_token_id=pad, mtp=mtp,
        data_collator=Glm53FlashPackingCollator(max_length=args.max_length, pad_token_id=pad),
        sequence_parallel_size=args.sp,
    )
    if args.sp > 1:
        job.say(f"sequence parallelism: {args.sp} ranks per SP group, mesh {trainer.sp_mesh}")
    trainer.remove_callback(ProgressCallback)
    if job.ep_plan is not None:
        # the global norm over every rank's experts (transformers' mixed-mesh norm sees only this rank's experts);
        # Trainer._clip_grad_norm / _get_grad_norm are its per-step hooks (transformers 5.24)
        plan = job.ep_plan
        trainer._clip_grad_norm = lambda model: clip_grad_norm_ep(model, plan, trainer.args.max_grad_norm)
        trainer._get_grad_norm = lambda model, grad_norm=None: float(
            grad_norm if grad_norm is not None else clip_grad_norm_ep(model, plan, float("inf")))
    if trainer.is_fsdp_enabled and job.training_args.bf16:
        # accelerate's single bf16 policy would cast the fp32-kept parameters (A_log, dt_bias, KDA conv, mHC base /
        # scale, router) for the forward: give them their own fp32 units first (configuration/accelerate_fsdp2.yaml)
        shard_fp32_kept_units(model, param_dtype=torch.bfloat16)
    return trainer


def train(job: Job, trainer) -> dict:
    """Step 3: ``trainer.train()``. Returns ``{"seconds", "tokens", "first", "last", "n"}``.

    Raises:
        FloatingPointError: a non-finite loss or gradient norm (naming the step), or non-finite weights;
            :class:`DeadModelError`: the trained model no longer predicts (constant logits, a non-finite RMS norm
            statistic: :func:`check_predicts`) or the loss never moved (:func:`check_loss_moved`).
    """
    result = trainer.train()
    what = f"the trained model (after step {trainer.state.global_step})"
    check_finite(trainer.model, what, trainer.accelerator)
    lr = job.training_args.learning_rate
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    check_loss_moved(losses, lr)
    if trainer.sp_group is None:  # under --sp the text model expects its shard of each row
        check_predicts(trainer.model, job.processor, explain_prompt(job.args.held_out), what, lr, trainer.accelerator)
    tokens = _reduce(trainer.accelerator, trainer.trained_tokens, "sum")
    first, last, n = loss_summary(losses)
    peak, where = peak_memory()
    return dict(seconds=float(result.metrics["train_runtime"]), tokens=tokens, first=first, last=last, n=n,
                peak=_reduce(trainer.accelerator, peak, "max"), peak_where=where)


def peak_memory() -> tuple[int, str]:
    """This process's memory high-water in bytes and what it counts: the CUDA allocator's peak of allocated tensors
    on a GPU, else the peak resident set (``getrusage`` ``ru_maxrss``, loading included)."""
    import resource

    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), "allocated on the GPU"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "resident"


def save(job: Job, trainer, processor):
    """Step 4: write the Hub-style folder (adapter with LoRA, merged or fully trained model, processor) in
    ``job.staging``, check it and replace ``job.out`` by it. Returns the saved model on the main process when in
    memory, else ``None``.
    """
    from ..train.adapters import add_router_biases, mark_vl_adapter, write_causal_lm_adapter
    from ..train.expert_parallel import save_adapter_ep, save_pretrained_ep

    stage = job.staging
    saved_model = None
    if job.args.full:
        if job.ep_plan is not None:
            # a collective; rank 0 writes, atomically (the model's save_pretrained), with the processor
            save_pretrained_ep(trainer.model, job.ep_plan, stage, processor=processor)
        else:
            _save_trained(trainer, stage, job.main_process, processor=processor)
        saved_model = trainer.model if trainer.accelerator.num_processes == 1 else None
    else:
        adapter_dir = os.path.join(stage, ADAPTER_VL_DIR)  # trained on the VL model: its names
        if job.ep_plan is not None:
            save_adapter_ep(trainer.model, job.ep_plan, adapter_dir)  # every rank's expert slices, 1-process layout
        else:
            _save_trained(trainer, adapter_dir, job.main_process)
        if job.main_process:
            if job.args.balance_speed > 0:  # the balanced router biases: buffers, which PEFT does not save
                add_router_biases(adapter_dir, trainer.accelerator.unwrap_model(trainer.model))
            # PEFT's Auto classes load both: the VL adapter relabelled for peft.AutoPeftModel, its causal-LM copy
            # (keys model.*, CAUSAL_LM) for peft.AutoPeftModelForCausalLM
            mark_vl_adapter(adapter_dir)
            write_causal_lm_adapter(adapter_dir, os.path.join(stage, ADAPTER_DIR))
            saved_model = merge_adapter(job.model_path, adapter_dir, job.dtype, job.args.merged_format)
            if (report := getattr(saved_model, "fp8_merge_report", None)) is not None:
                job.say(f"merged into the FP8 base as {job.args.merged_format}: {report['merged_fp8_weights']} FP8 "
                        f"weights, max relative re-quantization error {report['max_rel_roundtrip_error']:.2e}")
            check_finite(saved_model, "the merged model")
            check_predicts(saved_model, processor, explain_prompt(job.args.held_out), "the merged model",
                           job.training_args.learning_rate)
            saved_model.save_pretrained(stage, processor=processor)
    if job.main_process:
        check_saved_folder(stage, adapter=not job.args.full)
        _publish(stage, job.out)
        for name in (ADAPTER_DIR, ADAPTER_VL_DIR) if job.args.full else ():
            stale = os.path.join(job.out, name)
            if os.path.isfile(os.path.join(stale, "adapter_config.json")):
                job.say(f"removing the adapter of an earlier LoRA run: {stale}")
                shutil.rmtree(stale)
    trainer.accelerator.wait_for_everyone()
    return saved_model


def verify(job: Job, trainer, saved_model, processor) -> int:
    """Step 5 (main process): merged against adapter logits (LoRA), then the fresh-process reload; returns 0 when
    everything holds, else 1.
    """
    import torch

    args, status = job.args, 0
    question = explain_prompt(args.held_out)
    on_cpu = next(trainer.model.parameters()).device.type == "cpu"
    single_cpu_fp32 = trainer.accelerator.num_processes == 1 and job.dtype == torch.float32 and on_cpu
    report = getattr(saved_model, "fp8_merge_report", None)
    fp8 = report is not None and report["fp8"]
    if not args.full and (fp8 or single_cpu_fp32):
        diff, scale, degenerate = max_logit_difference(trainer.model, saved_model, processor, question)
        if fp8:  # re-quantized to e4m3: the round trip is the only difference, each element within the e4m3 bound
            ok = (report["max_roundtrip_bound_ratio"] <= FP8_BOUND_RATIO
                  and report["max_rel_roundtrip_error"] <= FP8_ROUNDTRIP_RTOL)
            job.say(f"FP8-merged model vs the trained adapter: max |dlogit| = {diff:.2e} (max |logit| {scale:.1f}; "
                    f"the e4m3 round trip of the merged weights); weight re-quantization error "
                    f"{report['max_rel_roundtrip_error']:.2e} of max |W|, {report['max_roundtrip_bound_ratio']:.3f} "
                    "of the elementwise e4m3 bound " + ("ok" if ok else "ERROR: above the bound"))
        else:
            ok = diff <= MERGE_RTOL * max(1.0, scale)
            job.say(f"merged model vs the trained adapter: max |dlogit| = {diff:.2e} (max |logit| {scale:.1f}) "
                    + ("ok" if ok else f"ERROR: above {MERGE_RTOL:g} relative"))
        if degenerate is not None:  # (the adapter's model is the first)
            job.say(f"  ERROR: {degenerate}: the comparison proves nothing")
            ok = False
        status = 0 if ok else 1
    if args.no_reload:
        return status
    job.say("reloading in a fresh process (HF_HUB_OFFLINE=1, trust_remote_code=True) ...")
    reloaded = run_reload_check(job.out, question, args.max_new_tokens)
    job.say(f"  AutoModelForCausalLM -> {reloaded['text_class']}")
    job.say(f"  Q (held out): {question}\n  A: {reloaded['text_answer']!r}")
    job.say(f"  AutoModelForImageTextToText -> {reloaded['vl_class']}")
    job.say(f"  Q: [{PROBE_PHOTO} photo] {IMAGE_PROMPT}\n  A: {reloaded['image_answer']!r}")
    if reloaded.get("mtp") is None:
        job.say("  MTP speculative decoding: skipped (the model has no MTP layer)")
    else:
        for key, res in reloaded["mtp"].items():
            job.say(f"  generate(use_mtp=True), {key} prompt: equals plain greedy: {'yes' if res['equal'] else 'NO'}; "
                    f"acceptance {res['accepted']}/{res['drafted']} = {res['acceptance_rate']:.2f}")
            if not res["equal"]:
                job.say(f"  ERROR: MTP speculative decoding changed the greedy {key} answer")
                status = 1
    if reloaded["package_imported"]:
        job.say("  ERROR: the fresh process imported glm53flash_hf; the folder is not self-contained")
        status = 1
    if saved_model is not None and single_cpu_fp32:
        saved_model.eval()
        expected = (greedy_answer(saved_model, processor, question, max_new_tokens=args.max_new_tokens),
                    greedy_answer(saved_model, processor, IMAGE_PROMPT, load_photo(PROBE_PHOTO), args.max_new_tokens))
        same = expected == (reloaded["text_answer"], reloaded["image_answer"])
        job.say(f"  reloaded answers equal the in-memory model's: {'yes' if same else 'NO'}")
        if not same:
            job.say(f"  ERROR: in-memory answers differ: {expected!r}")
            status = 1
    return status


def main(argv=None) -> int:
    """Command-line entry point of ``glm53flash-finetune``; returns the exit status.

    Raises:
        SystemExit: bad options, or ``--output-dir`` held by another run (status 2).
        FloatingPointError: the run diverged (names the step); ``--output-dir`` is left as it was.
        PublishError: the output could not replace ``--output-dir`` (left as it was); the staging folder is kept.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    start = time.perf_counter()
    import torch

    from ..train.malloc import huge_pages_in_use, set_malloc_policy

    heap = malloc_policy(args.malloc, torch.cuda.is_available())
    heap_set = set_malloc_policy(heap)
    out, dtype = os.path.abspath(args.output_dir), _resolve_dtype(args)
    staging = staging_folder(out)
    training_args = training_arguments(args, staging, dtype)
    job = Job(args=args, out=out, staging=staging, dtype=dtype, training_args=training_args,
              main_process=training_args.process_index == 0)
    if heap_set:
        job.say(f"heap: malloc policy {heap!r} (--malloc default: off); huge pages: "
                + {True: "on", False: "off (THP_MEM_ALLOC_ENABLE set, or a tensor allocated first)",
                   None: "not offered by this kernel"}[huge_pages_in_use()])
    with contextlib.ExitStack() as stack:
        if job.main_process:
            try:
                stack.enter_context(output_lock(out))
            except OutputBusyError as error:
                parser.error(f"--output-dir {error}")
            kept = clear_staging(staging, out)  # the lock is ours: a staging folder is a previous run's
            if kept is not None:
                job.say(f"kept the output of an earlier run that could not be published (see its "
                        f"{UNPUBLISHED_MARK}) in {kept}")
        keep_staging = False
        try:
            return _run(parser, job, start)
        except PublishError:
            keep_staging = True  # the run's only complete copy
            raise
        finally:
            if job.main_process and not keep_staging:
                shutil.rmtree(staging, ignore_errors=True)  # removed by a complete run


def _run(parser, job: Job, start: float) -> int:
    """The steps of :func:`main` once ``--output-dir`` is held."""
    args, out, dtype = job.args, job.out, job.dtype
    try:
        processor, model, dataset = prepare(job)
    except OSError as error:  # a Hub id that does not resolve (offline, unknown repository): one line, no traceback
        if _looks_local(args.model):
            raise
        parser.exit(2, f"glm53flash-finetune: error: --model {args.model!r}: {str(error).splitlines()[0]}\n")
    trainer = build_trainer(job, processor, model, dataset)
    result = train(job, trainer)
    saved_model = save(job, trainer, processor)
    if not job.main_process:
        return 0
    first, last, n = result["first"], result["last"], result["n"]
    job.say("")
    job.say(f"loss: first {first:.4f} (mean of the first {n} steps), last {last:.4f} (mean of the last {n}); "
            + (f"fell by {first - last:.4f}" if last < first else "WARNING: the loss did not fall"))
    job.say(f"trained {result['tokens']} tokens (no padding) in {result['seconds']:.1f} s: "
            f"{result['tokens'] / result['seconds']:.0f} tokens/s; peak memory {result['peak'] / 2**30:.2f} GiB per "
            f"process ({result['peak_where']})")
    job.say(f"saved: {out} ({'merged LoRA weights' if not args.full else 'fully fine-tuned weights'}, {dtype}; "
            "remote code, auto_map, processor, chat template)"
            + ("" if args.full else f"; adapters: {os.path.join(out, ADAPTER_DIR)} (AutoPeftModelForCausalLM), "
                                    f"{os.path.join(out, ADAPTER_VL_DIR)} (AutoPeftModel, the VL model)")
            + f"; loss log: {os.path.join(out, LOSS_LOG)}")
    status = verify(job, trainer, saved_model, processor)
    job.say(f"wall time {time.perf_counter() - start:.0f} s; output: {out}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
