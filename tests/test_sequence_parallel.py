"""Sequence parallelism (:mod:`glm53flash_hf.train.sequence_parallel`): SP-N equals SP-1 in fp32.

Multi-process part (``tests/sp_worker.py``, ``torch.multiprocessing`` + gloo, like tests/test_fsdp2.py): the tiny
model trained on two packed rows of 96 tokens (documents that end inside shards, exactly at a shard boundary, a
1-token document, one document across three shards at SP=4, a conv history that is partly another document's).
Oracle: one process on the whole rows (:func:`sp_worker.reference_run`).

Measure: ``max|g - g_ref| / max|g_ref|`` per parameter (the FSDP2 test's), bound 1e-5; losses 1e-5 relative (also the
loss without ``num_items_in_batch``, main and MTP each a mean);
after two SGD-with-momentum steps the parameters, same measure (why not AdamW: :func:`sp_worker.make_optimizer`).
Step-2 gradients are reported (``grad2_rel_err``), not asserted: they are computed after an update that already
carries step 1's rounding.
The negative control drops the KDA state passing (each shard's first segment starts from a zero state) and must
miss the bound by far.

Op-level part (one process, fast): the affine decomposition ``S_end = A S_start + B`` of the chunked KDA and the
prefix over shards against the chunk op on the whole sequence.
"""

from __future__ import annotations

import os

import pytest
import sp_worker
import torch
from interp import tol_for
from mp_launch import free_port, run_workers
from test_kda import naive_kda
from tiny import fp64_error_tol, rel_err

from glm53flash_hf.kda_ops import chunk_kda_torch
from glm53flash_hf.train.sequence_parallel import (
    apply_sequence_parallel,
    build_shard_layout,
    kda_boundary_transition,
    shard_sequence,
)

WORKER_DEADLINE_S = 420
TOL = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmpdir = str(tmp_path_factory.mktemp("sp"))
    path = os.path.join(tmpdir, "ref.pt")
    threads = torch.get_num_threads()
    try:
        sp_worker.reference_run(path)
    finally:
        torch.set_num_threads(threads)
    return tmpdir, path


_RUNS: dict = {}


def _launch(reference, mode: str, world: int, dp: int = 1) -> tuple[dict, list[dict]]:
    """Run the workers once per ``(mode, world, dp)`` and module (later tests read the same results)."""
    key = (reference[0], mode, world, dp)
    if key not in _RUNS:
        _RUNS[key] = _run_workers(reference, mode, world, dp)
    return _RUNS[key]


def _run_workers(reference, mode: str, world: int, dp: int) -> tuple[dict, list[dict]]:
    tmpdir, ref_path = reference
    run_workers(sp_worker.worker, (world, free_port(), tmpdir, ref_path, mode, dp), world, "SP", WORKER_DEADLINE_S)
    out = []
    for rank in range(world):
        res = torch.load(os.path.join(tmpdir, f"result_{mode}{world}_{rank}.pt"))
        assert "error" not in res, res["error"]
        out.append(res)
    return torch.load(ref_path), out


def _check_sp(reference, world):
    ref, results = _launch(reference, "sp", world)
    for res in results:
        for mine, expect in zip(res["losses"], ref["losses"]):
            assert abs(mine - expect) <= TOL * abs(expect), (res["losses"], ref["losses"])
        # without num_items_in_batch: the main loss and each MTP depth normalised by the group's counts
        assert abs(res["loss_nocount"] - ref["loss_nocount"]) <= TOL * abs(ref["loss_nocount"]), (
            res["loss_nocount"], ref["loss_nocount"])
        assert res["grad_names_match"]
        err, name = res["grad_rel_err"]
        assert err <= TOL, f"SP={world}: gradient of {name} off by {err:.2e} (relative to its max)"
        err, name = res["param_rel_err"]
        assert err <= TOL, f"SP={world}: parameter {name} after two SGD steps off by {err:.2e}"
        # negative control: without the recurrent state passing the same check fails by orders of magnitude
        assert res["control_grad_rel_err"][0] > 1e3 * TOL, res["control_grad_rel_err"]
    print(f"SP={world}: losses {results[0]['losses']} vs {ref['losses']}; grad {results[0]['grad_rel_err']}; "
          f"params {results[0]['param_rel_err']}; step-2 grads {results[0]['grad2_rel_err']}; "
          f"updates {results[0]['update_rel_err']}; control {results[0]['control_grad_rel_err']}")


def test_sp2_equals_one_process(reference):
    _check_sp(reference, 2)


def test_sp4_equals_one_process(reference):
    _check_sp(reference, 4)


def test_sp2_remote_code_model_equals_one_process(reference):
    """A model loaded through ``AutoModelForCausalLM`` with ``trust_remote_code`` (its modules copied next to the
    weights, so its classes are not the package's) is parallelised by the same ``apply_sequence_parallel``: loss and
    every gradient of one step equal the one-process run within 1e-5."""
    ref, results = _launch(reference, "sp", 2)
    for res in results:
        assert res["remote_module"].startswith("transformers_modules."), res["remote_module"]
        assert abs(res["remote_loss"] - ref["losses"][0]) <= TOL * abs(ref["losses"][0]), (res["remote_loss"], ref)
        assert res["remote_grad_names_match"]
        err, name = res["remote_grad_rel_err"]
        assert err <= TOL, f"SP=2, remote code: gradient of {name} off by {err:.2e} (relative to its max)"


def test_sp2_labels_input_ids_equals_one_process(reference):
    """``labels = input_ids`` on packed rows (no -100 at the document starts, :func:`sp_worker.ids_batch`): the main
    loss keeps transformers' row-wise shift (a document's first token is the label of the previous document's last
    position, on one device as under SP), while the MTP targets stay inside each document. Loss (with and without
    ``num_items_in_batch``) and every gradient of one step equal the one-process run within 1e-5."""
    ref, results = _launch(reference, "sp", 2)
    for res in results:
        for key in ("ids_loss", "ids_nocount"):
            assert abs(res[key] - ref[key]) <= TOL * abs(ref[key]), (key, res[key], ref[key])
        assert res["ids_grad_names_match"]
        err, name = res["ids_grad_rel_err"]
        assert err <= TOL, f"SP=2, labels = input_ids: gradient of {name} off by {err:.2e} (relative to its max)"
    print(f"SP=2 labels=input_ids: loss {results[0]['ids_loss']} vs {ref['ids_loss']}, without count "
          f"{results[0]['ids_nocount']} vs {ref['ids_nocount']}; grad {results[0]['ids_grad_rel_err']}")


def test_sp2_all_ignored_labels_give_zero_loss(reference):
    """Labels all -100 without ``num_items_in_batch``: every rank's loss is 0.0, as one device's (the heads'
    convention), not NaN from a group count of 0."""
    _, results = _launch(reference, "sp", 2)
    assert [res["ignored_loss"] for res in results] == [0.0, 0.0]


def test_sp2_refuses_uneven_shards_and_pads_trainer_micro_batches(reference):
    """Shards of 48 and 40 tokens raise ``ValueError`` naming both shapes on both ranks; the Trainer's
    :func:`~glm53flash_hf.train.trainer.sp_micro_batches` pads the ranks' 5- and 7-token rows to 8 (a multiple of
    2): pad ids, -100 labels, positions restarting at 0, ``cu_seq_lens_q`` dropped, rank order kept."""
    _, results = _launch(reference, "sp", 2)
    for res in results:
        assert "per-rank shapes [(2, 48), (2, 40)]" in res["uneven_error"]
        first, second = res["micro"]
        assert first == {"input_ids": [[0] * 5 + [99] * 3], "labels": [[0] * 5 + [-100] * 3],
                         "position_ids": [[0, 1, 2, 3, 4, 0, 1, 2]]}
        assert second["input_ids"] == [[1] * 7 + [99]] and second["position_ids"] == [[0, 1, 2, 3, 4, 5, 6, 0]]


def test_sp2_x_fsdp2_equals_one_process(reference):
    """A ``(dp_shard=2, sp=2)`` device mesh on 4 processes: FSDP2 on the flattened mesh, SP on ``mesh["sp"]``."""
    ref, results = _launch(reference, "fsdp_sp", 4, dp=2)
    for res in results:
        assert abs(res["losses"][0] - ref["losses"][0]) <= TOL * abs(ref["losses"][0])
        err, name = res["grad_rel_err"]
        assert err <= TOL, f"SP=2 x FSDP2=2: gradient of {name} off by {err:.2e}"
    print(f"SP2xFSDP2: loss {results[0]['losses']} vs {ref['losses'][0]}; grad {results[0]['grad_rel_err']}")


def test_finetune_sp2_under_accelerate_launch(tmp_path):
    """``glm53flash-finetune --sp 2`` under ``accelerate launch --config_file configuration/accelerate_sp2.yaml``
    (2 CPU processes, gloo): trains 3 steps with every row split over the 2 ranks, saves, checks the merged model."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    cmd = [accelerate, "launch", "--config_file", os.path.join(root, "configuration", "accelerate_sp2.yaml"),
           "--main_process_port", str(free_port()), "-m", "glm53flash_hf.tools.finetune", "--sp", "2",
           "--max-steps", "3", "--samples", "6", "--batch-size", "2", "--max-length", "128", "--no-reload",
           "--output-dir", str(tmp_path / "out")]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=WORKER_DEADLINE_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sequence parallelism: 2 ranks per SP group" in proc.stdout
    with open(tmp_path / "out" / "loss_log.jsonl") as f:
        assert len(f.readlines()) == 3


# ---------------------------------------------------------------------------------------------- op level


def _inputs(T, H=2, K=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, K, generator=g, dtype=torch.float32) for _ in range(3))
    gate = -torch.rand(1, T, H, K, generator=g, dtype=torch.float32) * 2
    beta = torch.rand(1, T, H, generator=g, dtype=torch.float32)
    return q, k, v, gate, beta


@pytest.mark.parametrize("world", [2, 3, 5])
def test_state_passing_equals_whole_sequence(world):
    """One document over ``world`` shards: the prefix over the shards' ``(A_r, B_r)`` gives each shard's incoming
    state, and re-running the shard from it equals the chunk op on the whole sequence.

    State passing is exact algebra; in fp32 the shards are the same recurrence with other chunk boundaries (fp32
    order only). Bound: 4x the whole-sequence fp32 run's own error against the float64 token loop."""
    L = 21
    q, k, v, g, beta = _inputs(world * L)
    whole, final = chunk_kda_torch(q, k, v, g, beta, output_final_state=True, chunk_size=16)
    state = torch.zeros(1, q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
    outs = []
    for r in range(world):
        sl = slice(r * L, (r + 1) * L)
        parts = [t[:, sl] for t in (q, k, v, g, beta)]
        o, _ = chunk_kda_torch(*parts, initial_state=state, chunk_size=16)
        outs.append(o)
        _, b = chunk_kda_torch(*parts, output_final_state=True, chunk_size=16)
        a = kda_boundary_transition(functools_partial_chunk(16), parts[1], parts[3], parts[4], like_q=parts[0])
        state = torch.matmul(a.to(state.dtype), state) + b
    # fp32 order only (docstring): 4x the whole-sequence run's own error against the float64 token loop
    exact, exact_final = naive_kda(q, k, v, g, beta)
    assert rel_err(torch.cat(outs, dim=1), exact) <= fp64_error_tol(whole, exact)
    assert rel_err(state, exact_final) <= fp64_error_tol(final, exact_final)


def functools_partial_chunk(chunk_size):
    import functools

    return functools.partial(chunk_kda_torch, chunk_size=chunk_size)


def test_transition_is_the_linear_part():
    """``A`` from :func:`kda_boundary_transition` is the linear map of the recurrence: for two initial states the
    final states differ by ``A (S1 - S2)``; with per-segment ``cu_seqlens`` it is per segment."""
    q, k, v, g, beta = _inputs(30, seed=1)
    cu = torch.tensor([0, 7, 30])
    gen = torch.Generator().manual_seed(3)
    s1, s2 = (torch.randn(2, 2, 8, 8, generator=gen, dtype=torch.float32) for _ in range(2))
    _, f1 = chunk_kda_torch(q, k, v, g, beta, initial_state=s1, output_final_state=True, cu_seqlens=cu)
    _, f2 = chunk_kda_torch(q, k, v, g, beta, initial_state=s2, output_final_state=True, cu_seqlens=cu)
    a = kda_boundary_transition(chunk_kda_torch, k, g, beta, cu_seqlens=cu)
    # Claim: f1 = f2 + A (s1 - s2), exact algebra, each term an fp32 evaluation of the recurrence. Compared at the
    # states' scale (not the difference's, whose cancellation leaves the fp32 rounding of f1 and f2): 4x the fp32
    # run's own error against the float64 token loop.
    _, exact = naive_kda(q, k, v, g, beta, initial_state=s1, cu_seqlens=cu)
    assert rel_err(f2 + torch.matmul(a.to(s1.dtype), s1 - s2), exact) <= fp64_error_tol(f1, exact)


def test_shard_sequence_contiguous_and_uneven_refused():
    batch = {"input_ids": torch.arange(12).view(1, 12), "labels": torch.arange(12).view(1, 12),
             "cu_seq_lens_q": torch.tensor([0, 5, 12])}
    parts = [shard_sequence(batch, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], dim=1), batch["input_ids"])
    assert parts[1]["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert parts[2]["cu_seq_lens_q"] is batch["cu_seq_lens_q"]
    with pytest.raises(ValueError, match="sequence length 12 of input_ids is not a multiple of the SP world size 5"):
        shard_sequence(batch, 0, 5)


def test_apply_sequence_parallel_sets_and_clears_the_layout_builder():
    """``apply_sequence_parallel`` sets every text model's ``layout_builder`` (the main model's and none other: the
    MTP layer lives in it) and ``None`` clears it, so the forward is the one-process one again; a model without a text
    model is refused by name; a cached forward under SP raises before any collective, naming the way out."""
    from glm53flash_hf import packing

    model = sp_worker.make_model(0)
    batch = sp_worker.global_batch(1)
    with torch.no_grad():
        before = model(**batch).loss
    group = object()  # never used: no forward runs while it is set
    apply_sequence_parallel(model, group)
    text = model.model
    assert text.layout_builder.func is build_shard_layout and text.layout_builder.args == (packing, group)
    apply_sequence_parallel(model, None)
    assert text.layout_builder is None
    with torch.no_grad():
        assert torch.equal(model(**batch).loss, before)
    with pytest.raises(ValueError, match="model=Linear holds no Glm53FlashTextModel"):
        apply_sequence_parallel(torch.nn.Linear(2, 2), group)
    with pytest.raises(ValueError, match=r"uncached forwards only; got a cache \(call apply_sequence_parallel\(model, "
                                         r"None\) before generating\)"):
        build_shard_layout(packing, group, 1, 8, "cpu", cache=object())


def test_trainer_sp2_equals_one_process_trainer(tmp_path):
    """``Glm53FlashTrainer(sequence_parallel_size=2)`` on 2 processes (the Trainer's own gloo group, DDP over the
    ``dp_shard`` x ``sp`` = 1 x 2 mesh, each rank's row split over the group) against the 1-process Trainer on the same
    rows (:func:`sp_worker.trainer_worker`): logged losses of both steps and every parameter after two SGD steps
    within 1e-5 relative (parameters: ``max|p - p_ref| / max|p_ref|``)."""
    tmpdir = str(tmp_path)
    run_workers(sp_worker.trainer_worker, (1, free_port(), tmpdir, 1), 1, "Trainer", WORKER_DEADLINE_S)
    run_workers(sp_worker.trainer_worker, (2, free_port(), tmpdir, 2), 2, "SP Trainer", WORKER_DEADLINE_S)
    ref = torch.load(os.path.join(tmpdir, "trainer_1_0.pt"))
    assert "error" not in ref, ref["error"]
    assert len(ref["losses"]) == 2
    for rank in range(2):
        res = torch.load(os.path.join(tmpdir, f"trainer_2_{rank}.pt"))
        assert "error" not in res, res["error"]
        assert res["sp_group_size"] == 2
        for mine, expect in zip(res["losses"], ref["losses"], strict=True):
            assert abs(mine - expect) <= TOL * abs(expect), (res["losses"], ref["losses"])
        assert sorted(res["params"]) == sorted(ref["params"])
        worst = sp_worker._worst(res["params"], ref["params"])
        moved = sp_worker._worst(ref["params"], {n: p for n, p in sp_worker.make_model(0).named_parameters()})
        assert moved[0] > 1e3 * TOL, moved  # the two steps moved the parameters far more than the bound
        assert worst[0] <= TOL, f"parameter {worst[1]} after two Trainer steps off by {worst[0]:.2e}"
        print(f"Trainer SP=2 rank {rank}: losses {res['losses']} vs {ref['losses']}; params {worst}")


# ---------------------------------------------------------------------------------------------- fla's CP KDA


@pytest.mark.parametrize("world,rows", [(4, 1), (2, 2)])
def test_fused_kda_layer_sp_equals_one_process(tmp_path, monkeypatch, world, rows):
    """One fused KDA layer (fla's kernels under the Triton interpreter, test-only patches of
    :func:`interp.fla_interpreter_patches`, including fla's CUDA-only device check) on ``world`` gloo processes
    against the whole rows in one process.

    ``rows == 1`` (SP=4, a document across shards 1-3, one ending at a shard boundary, a 1-token document): the
    shards run fla's context-parallel ``chunk_kda`` (``cp_context`` with fla's local boundaries, which must equal
    the rank's layout; every call counted). ``rows == 2`` (SP=2): fla's CP chains one row only, so the package's
    state passing runs with fla's chunk kernels, and a warning names why.

    Oracle: the torch path in float64 on the whole rows, with the bounds fla's kernels are held to against float64
    in one process (tests/test_kda_fused_numerics.py, ``interp.tol_for``): 1e-5 relative for the output, the input
    gradient and the gradients of the parameters used per token; 1e-4 for those of the gate parameters (``A_log``,
    ``dt_bias``, ``f_a_proj``, ``f_b_proj``), whose fp32 error is fla's own (one rounding of the in-chunk reverse
    cumulative sum shared by every earlier token, summed coherently over the tokens) and depends on where the chunks
    fall. The first group is also held to 1e-5 of the one-process fused (fp32) run. A wrong state passing misses by
    orders of magnitude (``test_sp2_equals_one_process``'s control)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned workers before they import triton
    run_workers(sp_worker.kda_cp_worker, (world, free_port(), str(tmp_path), rows), world, "KDA CP",
                WORKER_DEADLINE_S)
    for rank in range(world):
        res = torch.load(tmp_path / f"kda_cp{world}x{rows}_{rank}.pt")
        assert "error" not in res, res["error"]
        assert res["grad_names_match"]
        for what in ("o_rel_err64", "dx_rel_err64", "o_rel_err", "dx_rel_err"):
            assert res[what] <= TOL, (what, res[what])
        for name, err in res["grad_rel_err64_by_name"].items():
            assert err <= tol_for(name), f"rank {rank}: gradient of {name} off float64 by {err:.2e}"
        for name, err in res["grad_rel_err_by_name"].items():
            if tol_for(name) == TOL:
                assert err <= TOL, f"rank {rank}: gradient of {name} off the one-process fused run by {err:.2e}"
        if rows == 1:
            assert res["cp_calls"] == [res["local_cu"]] and not res["warnings"], res
        else:
            assert res["cp_calls"] == [] and len(res["warnings"]) == 1, res
            assert "chains one token row and this batch has 2 rows" in res["warnings"][0]
    results = [torch.load(tmp_path / f"kda_cp{world}x{rows}_{rank}.pt") for rank in range(world)]
    worst = {key: max(r[key] for r in results) for key in ("o_rel_err64", "dx_rel_err64", "o_rel_err", "dx_rel_err")}
    print(f"SP={world} rows={rows}, worst rank: vs float64 o {worst['o_rel_err64']:.2e} dx {worst['dx_rel_err64']:.2e}"
          f" grad {max(r['grad_rel_err64'] for r in results)} (the one-process fused run: "
          f"{results[0]['ref_grad_rel_err64']}); vs that run o {worst['o_rel_err']:.2e} dx {worst['dx_rel_err']:.2e} "
          f"grad {max(r['grad_rel_err'] for r in results)}")
