"""Training helpers: the ``Trainer`` subclass of the fine-tune job, a LoRA configuration for GLM-5.3-Flash, the
aux-loss-free expert-balancing callback and the job's progress / loss-log callbacks.

Sources: DeepSeek-V3 technical report §2.1.2 ("Auxiliary-Loss-Free Load Balancing"); transformers
``TrainerCallback``; PEFT 0.21 ``LoraConfig(target_parameters=...)``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import shutil

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from .distributed import process_mesh
from .sft import IGNORE_INDEX

ROUTER_CLASS_NAME = "Glm53FlashTopkRouter"

#: ``nn.Linear`` leaf names adapted by default: MLA's, KDA's and the dense / shared-expert SwiGLU MLP's projections,
#: ``kv_b_proj`` included (the absorbed attention takes its effective weight from the wrapped module,
#: ``Glm53FlashAttention.kv_b_weight``). The routed experts are parameters: :data:`EXPERT_TARGET_PARAMETERS`.
DEFAULT_TARGET_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_proj", "k_proj", "v_proj",
                          "o_proj", "gate_proj", "up_proj", "down_proj")

#: The routed experts' 3-D parameters (``Glm53FlashExperts``), as PEFT ``target_parameters`` suffixes.
EXPERT_TARGET_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def default_lora_config(
    r: int = 8, lora_alpha: int | None = None, target_modules=DEFAULT_TARGET_MODULES, experts: bool = True, **kwargs
):
    """Return a ``peft.LoraConfig`` for GLM-5.3-Flash (``task_type="CAUSAL_LM"``, no dropout, no bias, vision excluded).

    ``r`` is per expert for the experts; ``lora_alpha`` defaults to ``2 * r``; empty ``target_modules``: experts only;
    ``experts``: adapt :data:`EXPERT_TARGET_PARAMETERS`; ``kwargs`` override the ``LoraConfig`` defaults. Raises
    ``ValueError`` for ``r < 1`` or nothing to adapt.
    """
    from peft import LoraConfig

    if r < 1:
        raise ValueError(f"r must be >= 1; got r={r}")
    modules = list(target_modules or ())
    if not modules and not experts:
        raise ValueError("nothing to adapt: give target_modules or set experts=True")
    # full-matches the qualified names that end in one of ``modules``, outside the vision tower
    regex = rf"(?!(?:.*\.)?visual\.)(?:.*\.)?(?:{'|'.join(re.escape(n) for n in modules)})"
    options = dict(
        r=r, lora_alpha=2 * r if lora_alpha is None else lora_alpha, lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM", target_modules=regex if modules else None,
        target_parameters=list(EXPERT_TARGET_PARAMETERS) if experts else None,
    )  # fmt: skip
    options.update(kwargs)
    return LoraConfig(**options)


def find_routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{qualified name: router}`` for every MoE router in ``model`` (wrappers included; matched by class name along
    the MRO, so remote-code and FSDP2 copies of the class count); each needs an ``e_score_correction_bias`` ``[E]``.
    """
    return {
        name: module
        for name, module in model.named_modules()
        if any(c.__name__ == ROUTER_CLASS_NAME for c in type(module).__mro__)
        and hasattr(module, "e_score_correction_bias")
    }


class AuxLossFreeBalancingCallback(TrainerCallback):
    """Aux-loss-free MoE load balancing (DeepSeek-V3 §2.1.2) for ``transformers.Trainer``: per optimizer step and
    router, ``bias += speed * sign(load.mean() - load)`` (fp32) from the step's training routing counts (summed over
    ranks).

    ``speed``: the update step ``gamma`` (finite, >= 0; 0: no hooks, no updates); ``last_loads``: ``{router name:
    float32 [E]}`` loads of the last completed step.

    Raises:
        ValueError: negative or non-finite ``speed``; ``speed > 0`` and no MoE router at train begin.
    """

    def __init__(self, speed: float = 0.0):
        if not (math.isfinite(speed) and speed >= 0):
            raise ValueError(f"speed must be a finite number >= 0; got speed={speed}")
        self.speed = float(speed)
        self.last_loads: dict[str, torch.Tensor] = {}
        self._routers: dict[str, torch.nn.Module] = {}
        self._counts: dict[str, torch.Tensor] = {}
        self._handles = []

    def _make_hook(self, name: str):
        def hook(module, args, output):
            if module.training:  # output[2]: the int64 [T, k] expert indices
                self._counts[name] += torch.bincount(output[2].reshape(-1), minlength=self._counts[name].numel())

        return hook

    def attach(self, model: torch.nn.Module) -> None:
        """Register the counting hooks on ``model``'s routers (idempotent; a no-op when ``speed == 0``)."""
        if self.speed == 0.0 or self._handles:
            return
        self._routers = find_routers(model)
        if not self._routers:
            raise ValueError(f"AuxLossFreeBalancingCallback: no {ROUTER_CLASS_NAME} in {type(model).__name__}")
        for name, router in self._routers.items():
            bias = router.e_score_correction_bias
            self._counts[name] = torch.zeros(bias.numel(), dtype=torch.int64, device=bias.device)
            self._handles.append(router.register_forward_hook(self._make_hook(name)))

    def detach(self) -> None:
        """Remove the hooks and drop the pending counts."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._counts, self._routers = [], {}, {}

    @torch.no_grad()
    def update(self) -> None:
        """Apply one bias update from the counts gathered since the last update, then reset the counts."""
        if not self._handles:
            return
        loads = {name: count.to(torch.float32) for name, count in self._counts.items()}
        if dist.is_available() and dist.is_initialized() and loads:
            flat = torch.cat(list(loads.values()))
            dist.all_reduce(flat)
            loads = dict(zip(loads, flat.split([load.numel() for load in loads.values()])))
        for name, load in loads.items():
            if load.sum() == 0:  # no training forward reached this router during the step
                continue
            bias = self._routers[name].e_score_correction_bias
            bias.add_((load.mean() - load).sign().to(bias.dtype), alpha=self.speed)
            self._counts[name].zero_()
        self.last_loads = {name: load.clone() for name, load in loads.items()}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self.attach(model)

    def on_step_end(self, args, state, control, **kwargs):
        self.update()

    def on_train_end(self, args, state, control, **kwargs):
        self.detach()


#: the row tensors of a text batch that :func:`sp_micro_batches` pads and gathers, and the keys it drops
_SP_ROW_KEYS = ("input_ids", "labels", "position_ids", "attention_mask", "mm_token_type_ids", "seq_idx")
_SP_DROPPED = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "max_length_q", "max_length_k")


def sp_micro_batches(inputs: dict, group, pad_token_id: int, min_shard: int = 4) -> list[dict]:
    """The ``W`` micro-batches of an SP group, equal in shape: every rank's ``[B, S_r]`` text batch all-gathered,
    right-padded to a common multiple of ``W`` (at least ``W * min_shard``), in rank order.

    Padding: ``input_ids`` = ``pad_token_id``, ``labels`` -100, ``position_ids`` restarting at 0, ``attention_mask`` 0,
    ``mm_token_type_ids`` 0, ``seq_idx`` a fresh index; ``cu_seq_lens_*`` / ``max_length_*`` are dropped.

    Raises:
        ValueError: visual inputs, a batch without ``input_ids``, or ranks with different batch sizes (names them).
    """
    for key in ("pixel_values", "pixel_values_videos"):
        if inputs.get(key) is not None:
            raise ValueError(f"sequence parallelism trains text batches only; got {key}")
    if "input_ids" not in inputs:
        raise ValueError(f"sequence parallelism needs input_ids in the batch; got keys {sorted(inputs)}")
    world = dist.get_world_size(group)
    ids = inputs["input_ids"]
    batch = {k: v for k, v in inputs.items() if k not in _SP_DROPPED}
    if batch.get("position_ids") is None and batch.get("attention_mask") is None:
        batch["attention_mask"] = torch.ones_like(ids)
    shape = torch.tensor(list(ids.shape), device=ids.device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape, group=group)
    rows = {int(t[0]) for t in shapes}
    if len(rows) != 1:
        raise ValueError(f"sequence parallelism needs the same batch size on the ranks of an SP group; got "
                         f"{[int(t[0]) for t in shapes]}")
    longest = max(int(t[1]) for t in shapes)
    target = max(world * min_shard, -(-longest // world) * world)
    pad_values = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0, "mm_token_type_ids": 0}
    out = [dict() for _ in range(world)]
    for key, value in batch.items():
        if key not in _SP_ROW_KEYS or not isinstance(value, torch.Tensor):
            for o in out:
                o[key] = value
            continue
        extra = target - value.shape[1]
        if key == "position_ids":
            tail = torch.arange(extra, device=value.device, dtype=value.dtype).expand(value.shape[0], extra)
        elif key == "seq_idx":
            tail = (value.max() + 1).expand(value.shape[0], extra).to(value.dtype)
        else:
            tail = torch.full((value.shape[0], extra), pad_values[key], device=value.device, dtype=value.dtype)
        value = torch.cat([value, tail], dim=1).contiguous()
        parts = [torch.empty((value.shape[0], target), dtype=value.dtype, device=value.device) for _ in range(world)]
        # every rank's own (unpadded) length differs: pad first, then gather the common shape
        dist.all_gather(parts, value, group=group)
        for o, part in zip(out, parts):
            o[key] = part
    return out


class Glm53FlashTrainer(Trainer):
    """``transformers.Trainer`` for GLM-5.3-Flash fine-tuning: ``mtp_loss`` in the logs, :attr:`trained_tokens`, a stop
    on non-finite losses or gradient norms, atomic checkpoints read back through ``from_pretrained``, and sequence
    parallelism (:func:`sp_micro_batches`).

    ``mtp=False`` is passed to the model unless ``mtp``; ``sp_mesh``: an optional ``DeviceMesh`` with an ``"sp"``
    dimension, built from ``sequence_parallel_size`` when absent (``1``: off).

    Raises:
        ValueError: ``sequence_parallel_size`` not dividing the world size or without a process group; an SP mesh of
            several processes outside distributed mode.
        FloatingPointError: during training, a non-finite loss or gradient norm (names the step and the value).
    """

    def __init__(self, *args, pad_token_id: int, mtp: bool = True, sp_mesh=None, sequence_parallel_size: int = 1,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.pad_token_id = pad_token_id
        self.mtp = mtp
        self.trained_tokens = 0
        self._mtp_sum, self._mtp_logged_step = 0.0, 0
        if sp_mesh is None and sequence_parallel_size > 1:
            sp_mesh = process_mesh(sequence_parallel_size, ("dp_shard", "sp"), "sequence_parallel_size")
        if sp_mesh is not None and sp_mesh.size() > 1:
            from transformers.training_args import ParallelMode

            if self.args.parallel_mode != ParallelMode.DISTRIBUTED:
                raise ValueError(
                    f"sequence parallelism over {sp_mesh.size()} processes needs the Trainer in distributed mode, but "
                    f"args.parallel_mode is {self.args.parallel_mode} (each process would train on its own, without "
                    "gradient sync); on CPU, accelerate launch needs ACCELERATE_USE_CPU=true"
                )
        self.sp_mesh = sp_mesh
        self.sp_group = sp_mesh["sp"].get_group() if sp_mesh is not None else None

    def _get_output_dir(self, trial):
        staging = getattr(self, "_checkpoint_staging", None)
        return staging if staging is not None else super()._get_output_dir(trial)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if getattr(self, "_checkpoint_staging", None) is not None:
            self._checkpoint_push = True  # pushed from the final folder, once it is in place
            return
        super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial) -> None:
        """``Trainer._save_checkpoint`` run in ``.checkpoint-N.partial/``, swapped in when all processes are done."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        from ..checkpoint_io import exchange_paths

        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        staging = os.path.join(run_dir, f".{name}.partial")
        if self.args.should_save:
            for left in glob.glob(os.path.join(glob.escape(run_dir), f".{PREFIX_CHECKPOINT_DIR}-*.partial")):
                shutil.rmtree(left, ignore_errors=True)  # left by a killed checkpoint save
            os.makedirs(staging, exist_ok=True)
        self.accelerator.wait_for_everyone()
        self._checkpoint_staging, self._checkpoint_push = staging, False
        try:
            super()._save_checkpoint(model, trial)  # its rotation sees only the one checkpoint in `staging`
        finally:
            self._checkpoint_staging = None
        self.accelerator.wait_for_everyone()
        written = os.path.join(staging, name)
        if self.state.best_model_checkpoint == written:
            self.state.best_model_checkpoint = final
            if self.args.should_save:
                self.state.save_to_json(os.path.join(written, "trainer_state.json"))
        if self.args.should_save and os.path.isdir(written):
            if not (os.path.isdir(final) and exchange_paths(written, final)):
                if os.path.isdir(final):
                    os.rename(final, os.path.join(staging, "replaced"))
                os.rename(written, final)
            shutil.rmtree(staging, ignore_errors=True)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()
        if self._checkpoint_push:
            super()._push_from_checkpoint(final)

    def _load_saved_weights(self, folder: str, model) -> bool:
        """Load a ``save_pretrained`` folder into ``model`` by ``from_pretrained``; False: the Trainer's own path."""
        from transformers.trainer import _is_peft_model

        target = self.accelerator.unwrap_model(model)
        ours = any(c.__name__ == "Glm53FlashPreTrainedModel" for c in type(target).__mro__)
        weights = any(os.path.isfile(os.path.join(folder, n))
                      for n in ("model.safetensors", "model.safetensors.index.json"))
        if not ours or not weights or _is_peft_model(target) or self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return False
        dtype = next(target.parameters()).dtype
        loaded = type(target).from_pretrained(folder, config=target.config, dtype=dtype)
        target.load_state_dict(loaded.state_dict(), strict=True)
        return True

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._load_saved_weights(resume_from_checkpoint, self.model if model is None else model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if not self._load_saved_weights(self.state.best_model_checkpoint, self.model):
            super()._load_best_model()

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = self._training_step(model, inputs, num_items_in_batch)
        if not bool(torch.isfinite(loss.detach()).all()):
            raise FloatingPointError(
                f"non-finite training loss {float(loss.detach().float().sum()):g} at step {self.state.global_step + 1} "
                "(the raw loss of this process's micro-batch); training stopped"
            )
        return loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        # called after every optimizer step with the step's gradient norm (before clipping), logged or not
        if grad_norm is not None and not self.accelerator.optimizer_step_was_skipped:
            value = float(grad_norm)
            if not math.isfinite(value):
                raise FloatingPointError(f"non-finite gradient norm {value:g} at step {self.state.global_step} "
                                         "(before clipping); training stopped")
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _training_step(self, model, inputs, num_items_in_batch=None):
        ids, labels = inputs["input_ids"], inputs["labels"]
        self.trained_tokens += int(((ids != self.pad_token_id) | (labels != IGNORE_INDEX)).sum())
        if self.sp_group is None:
            return super().training_step(model, inputs, num_items_in_batch)
        from .sequence_parallel import apply_sequence_parallel, shard_sequence

        world, rank = dist.get_world_size(self.sp_group), dist.get_rank(self.sp_group)
        total = None
        apply_sequence_parallel(model, self.sp_group)  # only inside the training step: other forwards run unsharded
        try:
            for j, batch in enumerate(sp_micro_batches(inputs, self.sp_group, self.pad_token_id)):
                sync = contextlib.nullcontext() if j == world - 1 else self.accelerator.no_sync(model)
                with sync:
                    loss = super().training_step(model, shard_sequence(batch, rank, world), num_items_in_batch)
                total = loss if total is None else total + loss
        finally:
            apply_sequence_parallel(model, None)
        return total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.mtp:
            inputs = {**inputs, "mtp": False}
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
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


class ProgressWithLossCallback(TrainerCallback):
    """A tqdm progress bar over the optimizer steps showing the current loss (main process only)."""

    def __init__(self):
        self.bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from tqdm.auto import tqdm

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


class LossLogCallback(TrainerCallback):
    """Writes one JSON line per logged training step (``step``, ``epoch`` and the log dict) to ``path`` (truncated at
    train begin; main process only).
    """

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            open(self.path, "w").close()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "epoch": state.epoch, **logs}) + "\n")
