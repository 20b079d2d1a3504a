"""FSDP2: ``glm53flash_hf.train.distributed`` and ``configuration/accelerate_fsdp2.yaml``.

accelerate 1.15 silently drops FSDP on CPU (``--cpu`` runs one process, ``MULTI_CPU`` ignores the plugin: DDP), so
the distributed test does not go through ``accelerate launch``: two processes
(``torch.multiprocessing``, gloo, ``tests/fsdp2_worker.py``) shard the tiny model with raw ``fully_shard``
(:func:`glm53flash_hf.train.distributed.apply_fsdp2`), and the accelerate path is exercised by calling accelerate's own
``fsdp2_prepare_model`` with the plugin the yaml's environment builds. Sharding is proven, not assumed: every block
parameter is a ``DTensor`` with a ``Shard(0)`` placement and a local shard smaller than the full tensor, and the
checkpoint folder holds one file per rank.

Oracle: the same model trained in one process on the whole global batches (:func:`fsdp2_worker.reference_run`), each
rank training on half of the rows with the loss divided by the global ``num_items_in_batch`` and multiplied by the
world size before backward (see the worker's docstring), so losses and gradients must equal the single-process ones.
For the bf16 policy the oracle is an unsharded copy holding the dtypes the policy should produce (bf16 except the
fp32-kept parameters and mHC ``fn``), run on the rank's rows; a copy with *every* parameter bf16 is the negative
control (the check must be able to fail).

Tolerances:

* losses vs single process, 1e-5 absolute (the global loss is the sum of the two ranks' losses, the reference one
  sum over all rows);
* step-1 gradients vs single process, 1e-5 of the tensor's largest magnitude (fp32 sums over all tokens formed in
  two halves plus the reduce-scatter, instead of one matmul);
* resumed step-3 loss vs uninterrupted step 3: bit-equal (same shards, same optimizer state, same operations);
* bf16 policy vs the dtype-matched copy: loss and gradients bit-equal (the same bf16/fp32 operations on the same
  values; the gradients' fp32 reduce-scatter of two bf16 sums is exact);
  the all-bf16 control must differ by more than 1e-5.
"""

from __future__ import annotations

import os

import accelerate
import fsdp2_worker
import pytest
import torch
from mp_launch import free_port, run_workers
from packaging.version import Version

from glm53flash_hf.train.distributed import (
    apply_fsdp2,
    fp32_kept_parameter_names,
    load_sharded_checkpoint,
    no_split_blocks,
    shard_fp32_kept_units,
)

# accelerate's FSDP2 bf16 policy casts the root's outputs to bf16 up to 1.15 and leaves them in the compute dtype
# from 1.16 (``output_dtype=None``); the loss dtype our recipe returns follows it.
ACCELERATE_OUTPUT_DTYPE = torch.bfloat16 if Version(accelerate.__version__) < Version("1.16") else None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YAML = os.path.join(ROOT, "configuration", "accelerate_fsdp2.yaml")
WORKER_DEADLINE_S = 300

#: independent oracle of the fp32-kept parameters (transformers' glm5_next list)
KEPT_SUFFIXES = (
    ".A_log", ".dt_bias", ".conv1d.weight", "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale",
    ".mlp.gate.weight",
)


def _accelerate_env() -> dict:
    """The environment ``accelerate launch --config_file configuration/accelerate_fsdp2.yaml`` gives the script."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", YAML, "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_"))}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Single-process reference, then the two workers; returns ``(reference, [result_rank0, result_rank1])``."""
    tmpdir = str(tmp_path_factory.mktemp("fsdp2"))
    ref_path = os.path.join(tmpdir, "ref.pt")
    threads = torch.get_num_threads()
    try:
        fsdp2_worker.reference_run(ref_path)
    finally:
        torch.set_num_threads(threads)
    env = _accelerate_env()
    args = (fsdp2_worker.WORLD, free_port(), tmpdir, ref_path, env)
    run_workers(fsdp2_worker.worker, args, fsdp2_worker.WORLD, "FSDP2", WORKER_DEADLINE_S)
    out = []
    for rank in range(fsdp2_worker.WORLD):
        res = torch.load(os.path.join(tmpdir, f"result_{rank}.pt"))
        assert "error" not in res, res["error"]
        out.append(res)
    return torch.load(ref_path), out


# ---------------------------------------------------------------------------------------------- single process


def test_yaml_builds_the_intended_accelerate_fsdp2_plugin(monkeypatch):
    """The yaml parses with accelerate's config loader; the environment ``accelerate launch`` derives from it builds a
    ``FullyShardedDataParallelPlugin`` with FSDP2, sharded state dicts, resharding, bf16 and transformer-based wrap,
    and accelerate's wrap policy selects exactly our ``_no_split_modules`` blocks (decoder layers + MTP layer)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = load_config_from_file(YAML)
    assert config.distributed_type == DistributedType.FSDP and config.mixed_precision == "bf16"
    assert config.fsdp_config["fsdp_version"] == 2
    assert "fsdp_transformer_layer_cls_to_wrap" not in config.fsdp_config  # accelerate uses _no_split_modules
    env = _accelerate_env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert str(plugin.state_dict_type) == "StateDictType.SHARDED_STATE_DICT"
    assert plugin.activation_checkpointing is False and plugin.cpu_ram_efficient_loading is False
    assert plugin.transformer_cls_names_to_wrap is None
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=ACCELERATE_OUTPUT_DTYPE
    )
    model = fsdp2_worker.make_model(0)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    wrapped = [q for q, m in model.named_modules() if m is not model and policy(m)]
    ours = [q for q, _ in no_split_blocks(model)]
    n = model.config.get_text_config().num_hidden_layers
    assert wrapped == ours == [f"model.layers.{i}" for i in range(n + 1)]


def test_fp32_kept_parameter_names():
    """transformers' keep-in-fp32 rule on our model = the suffix oracle; nothing is kept for fp32 compute."""
    model = fsdp2_worker.make_model(0)
    oracle = [n for n, _ in model.named_parameters() if n.endswith(KEPT_SUFFIXES)]
    assert len(oracle) == 3 * 3 + 6 * 4 + 6  # 3 KDA layers (A_log, dt_bias, conv), 6 layers x 2 hc x 2, 6 routers
    assert fp32_kept_parameter_names(model) == oracle
    assert fp32_kept_parameter_names(model, torch.float16) == oracle
    assert fp32_kept_parameter_names(model, None) == fp32_kept_parameter_names(model, torch.float32) == []


def test_bad_input_raises(tmp_path, monkeypatch):
    """Input errors name what is wrong, before any process group is needed."""
    from glm53flash_hf.train import distributed

    model = fsdp2_worker.make_model(0)
    with monkeypatch.context() as m:
        m.setattr(distributed, "FP32_ANCHOR_CLASSES", ("Glm53FlashHyperConnection", "Glm53FlashLinearAttention"))
        with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate\.weight is not inside any of"):
            shard_fp32_kept_units(model)
    with pytest.raises(ValueError, match="param_dtype must be"):
        apply_fsdp2(model, param_dtype=torch.int8)
    with pytest.raises(ValueError, match="needs param_dtype bf16 or fp16"):
        shard_fp32_kept_units(model, param_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="initialised process group"):
        apply_fsdp2(model)
    model.lm_head.weight.data = model.lm_head.weight.data.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"lm_head\.weight \(torch\.bfloat16\)"):
        apply_fsdp2(model, param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype for the trainable parameters"):
        apply_fsdp2(model)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_sharded_checkpoint(tmp_path / "nowhere", model)


# --------------------------------------------------------------------------------------------- two processes


def test_block_parameters_are_dtensor_shards(results):
    """FSDP2 really shards: every parameter of every block is a DTensor, Shard(0) on the 2-rank mesh, with a local
    shard smaller than the full tensor; no parameter anywhere is left a plain tensor."""
    _, res = results
    for rank, r in enumerate(res):
        report = r["sharding"]
        assert report["blocks"] == [f"model.layers.{i}" for i in range(7)], rank
        assert report["checked"] > 150 and report["bad"] == [], (rank, report["bad"][:5])
        assert report["not_dtensor_elsewhere"] == [], rank
        assert r["fp32_plan_units"] == ([], []), "fp32 compute needs no fp32 units"


def test_losses_match_single_process(results):
    """Two AdamW steps (and the third) on the sharded model give the single-process losses within 1e-5."""
    ref, res = results
    for rank, r in enumerate(res):
        diffs = [abs(a - b) for a, b in zip(r["losses"], ref["losses"])]
        assert len(diffs) == 3 and max(diffs) <= 1e-5, (rank, r["losses"], ref["losses"])
    assert res[0]["losses"] == res[1]["losses"]


def test_step1_gradients_match_single_process(results):
    """Each rank's gradient shards equal its rows of the single-process gradient (relative 1e-5), for the same
    parameters (the DSA indexer's get none in both)."""
    ref, res = results
    for rank, r in enumerate(res):
        assert r["grad_names_match"] and r["grad_count"] == len(ref["grads"]) > 150, rank
        err, name = r["grad_rel_err"]
        assert err <= 1e-5, (rank, name, err)


def test_resume_from_sharded_checkpoint(results):
    """Step 2's DCP checkpoint (one file per rank) loaded into a differently initialised model and a fresh AdamW
    gives step 3's loss of the uninterrupted run (and of the single-process run)."""
    ref, res = results
    for rank, r in enumerate(res):
        assert r["resumed_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"], rank
        assert r["resumed_loss3"] == r["losses"][2], (rank, r["resumed_loss3"], r["losses"][2])  # same operations
        assert abs(r["resumed_loss3"] - ref["losses"][2]) <= 1e-5, rank


def test_local_tensor_on_real_dtensors(results):
    """``dispatch.local_tensor``: a Replicate DTensor unwraps to its full local tensor; a Shard DTensor — a
    hand-made one and an FSDP2-sharded parameter — raises ValueError naming the parameter."""
    _, res = results
    for rank, r in enumerate(res):
        assert r["replicate_unwrapped"], rank
        sharded, fsdp_param = r["shard_errors"]
        assert sharded is not None and sharded.startswith("test.sharded ") and "Shard(dim=0)" in sharded, rank
        assert fsdp_param is not None and fsdp_param.startswith("lm_head.weight "), rank


def test_bf16_policy_keeps_fp32_parameters(results):
    """``apply_fsdp2(param_dtype=bf16)``: in the forward the fp32-kept parameters (and mHC ``fn``, which shares their
    module) are fp32, every other parameter is bf16, ``e_score_correction_bias`` stays fp32; loss and gradient
    shards equal those of an unsharded copy holding exactly these dtypes, and differ from an all-bf16 copy."""
    _, res = results
    for rank, r in enumerate(res):
        b = r["bf16"]
        oracle = [n for n in b["all_params"] if n.endswith(KEPT_SUFFIXES)]
        assert b["kept"] == oracle
        extra = [n for n in b["all_params"] if n.endswith("_hc.fn")]
        assert sorted(b["plan"]["extra_fp32_parameters"]) == sorted(extra)
        assert sorted(b["plan"]["fp32_parameters"]) == sorted(oracle + extra)
        assert set(b["seen"]) == set(b["all_params"]), "every parameter was observed unsharded in the forward"
        fp32 = set(oracle + extra)
        wrong = {n: d for n, d in b["seen"].items() if d != ("torch.float32" if n in fp32 else "torch.bfloat16")}
        assert wrong == {}, (rank, list(wrong.items())[:5])
        assert len(b["buffers_seen"]) == 6 and set(b["buffers_seen"].values()) == {"torch.float32"}
        assert b["grad_dtypes"] == ["torch.float32"]
        assert r["bf16_grad_names_match"]
        assert b["loss"] == b["ref_loss"], (rank, b["loss"], b["ref_loss"])  # same operations, same values
        assert abs(b["all_bf16_loss"] - b["loss"]) > 1e-5, (rank, b["all_bf16_loss"], b["loss"])
        err, name = b["grad_rel_err"]
        assert err == 0, (rank, name, err)


def test_accelerate_recipe_keeps_fp32_parameters(results):
    """The yaml's recipe: ``shard_fp32_kept_units`` then accelerate's ``fsdp2_prepare_model`` (plugin from the yaml's
    environment). accelerate wraps blocks, embedding, [norm, lm_head] and root around our fp32 units; in the forward
    the fp32 parameters stay fp32 and all others are bf16; everything is sharded and gets a gradient. The loss comes
    back in accelerate's root ``output_dtype`` (bf16 up to accelerate 1.15), else in the loss's fp32."""
    _, res = results
    for rank, r in enumerate(res):
        a = r["accelerate"]
        assert "bfloat16" in a["policy"]
        units = set(a["units"])
        assert set(a["plan_fp32_units"]) <= units
        assert {f"model.layers.{i}" for i in range(7)} | {"", "model.embed_tokens", "lm_head"} <= units
        fp32 = set(a["fp32_parameters"])
        assert len(fp32) == len(r["bf16"]["plan"]["fp32_parameters"])
        wrong = {n: d for n, d in a["seen"].items() if d != ("torch.float32" if n in fp32 else "torch.bfloat16")}
        assert set(a["seen"]) == set(r["bf16"]["all_params"]) and wrong == {}, (rank, list(wrong.items())[:5])
        assert a["not_dtensor"] == [] and a["missing_grads"] == []
        assert a["loss_dtype"] == str(ACCELERATE_OUTPUT_DTYPE or torch.float32)
