"""``glm53flash-finetune`` publishing its output folder: non-finite runs stop with an error naming the step, a model
that no longer predicts is not published, a second run into a held output folder is refused, the previous output
folder stays byte-for-byte as it was after any failed run (its loss log, adapter and merged weights are replaced as
one unit by a complete run only), publishing works across file systems, and the balanced router biases reach both
adapters and the merged model.

The job runs in this process with tiny settings (1-2 steps of 2 text samples packed into rows of 128 tokens, no
reload); the previous output is one such complete run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("skimage")

import shared_fixtures  # noqa: E402
from shared_fixtures import INF  # noqa: E402
from shared_fixtures import finetune_argv as _argv  # noqa: E402
from tiny import no_warnings  # noqa: E402

from glm53flash_hf.tools import finetune  # noqa: E402

tiny_checkpoint = shared_fixtures.tiny_checkpoint  # fixture


def _snapshot(folder) -> dict:
    """``{relative path: bytes}`` of every file under ``folder`` (and ``None`` for each folder)."""
    result = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            result[os.path.relpath(os.path.join(root, name), folder)] = None
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                result[os.path.relpath(path, folder)] = f.read()
    return result


def _lr_inf(monkeypatch):
    """Train with lr = inf (the command line refuses it): the first optimizer step makes the weights NaN."""
    original = finetune.training_arguments

    def training_arguments(args, out, dtype):
        result = original(args, out, dtype)
        result.learning_rate = INF
        return result

    monkeypatch.setattr(finetune, "training_arguments", training_arguments)



# ------------------------------------------------------------------------------------------------ the job


@pytest.fixture(scope="module")
def previous(tiny_checkpoint, tmp_path_factory):
    """A complete LoRA run into a folder that holds a README, beside the staging folder and the lock file a killed
    run left (the lock file names a dead pid): the run succeeds, keeps the README and drops the stale staging."""
    root = tmp_path_factory.mktemp("previous")
    out = root / "out"
    out.mkdir()
    (out / "README.md").write_text("user notes\n")
    stale = root / ".out.staging"
    stale.mkdir()
    (stale / "junk.bin").write_bytes(b"left by a killed run")
    (root / ".out.lock").write_text("999999999\n")
    assert finetune.main(_argv(tiny_checkpoint, out)) == 0
    assert sorted(os.listdir(root)) == [".out.lock", "out"]
    finetune.check_saved_folder(str(out), adapter=True)
    assert (out / "README.md").read_text() == "user notes\n" and not (out / "junk.bin").exists()
    assert len((out / finetune.LOSS_LOG).read_text().splitlines()) == 1
    return str(out)


@pytest.fixture
def old_output(previous, tmp_path):
    """A copy of the previous run's folder (and its snapshot) for one failing run to leave alone."""
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    return out, _snapshot(out)


def _assert_untouched(out, snapshot):
    assert _snapshot(out) == snapshot
    assert sorted(os.listdir(out.parent)) == [".out.lock", "out"]  # no staging or temporary folder left


def test_non_finite_loss_stops_the_job_and_keeps_the_old_output(tiny_checkpoint, old_output, monkeypatch):
    out, snapshot = old_output
    _lr_inf(monkeypatch)
    with pytest.raises(FloatingPointError, match=r"non-finite training loss nan at step 2 "):
        finetune.main(_argv(tiny_checkpoint, out, "--max-steps", "2", "--warmup-steps", "0"))
    _assert_untouched(out, snapshot)


def test_non_finite_weights_after_the_last_step_are_not_saved(tiny_checkpoint, old_output, monkeypatch):
    """One ``--full`` step at lr = inf: the loss and gradient norm of that step are finite, the weights it leaves
    are not."""
    out, snapshot = old_output
    _lr_inf(monkeypatch)
    with pytest.raises(FloatingPointError, match=r"the trained model \(after step 1\) holds non-finite values"):
        finetune.main(_argv(tiny_checkpoint, out, "--full", "--warmup-steps", "0", "--no-mtp"))
    _assert_untouched(out, snapshot)


def test_failed_merge_keeps_the_old_adapter_weights_and_loss_log(tiny_checkpoint, old_output, monkeypatch):
    """The merge fails after training (the new loss log and adapter are written by then): the old adapter, merged
    weights and loss log are all still there, unchanged."""
    out, snapshot = old_output
    seen = []

    def failing_merge(base_path, adapter_dir, dtype, merged_format):
        seen.append(_snapshot(out) == snapshot and os.path.isfile(os.path.join(adapter_dir, "adapter_config.json")))
        raise RuntimeError(f"merge failed on {adapter_dir}")

    monkeypatch.setattr(finetune, "merge_adapter", failing_merge)
    with pytest.raises(RuntimeError, match=r"merge failed on .*\.out\.staging/adapter"):
        finetune.main(_argv(tiny_checkpoint, out))
    assert seen == [True]  # training and the adapter save wrote nothing into the output folder
    _assert_untouched(out, snapshot)


def test_huge_learning_rate_dead_model_is_not_published(tiny_checkpoint, old_output):
    """``--lr 1e30``, one step without warm-up: every weight stays finite (LoRA factors near 1e30), but the squares
    inside the RMS norms overflow to inf, so every norm outputs 0 and every logit is 0.0 (the merge check would
    compare 0 with 0). The job stops naming what happened; the old output is untouched."""
    out, snapshot = old_output
    with pytest.raises(FloatingPointError) as error_info:  # finetune.DeadModelError
        finetune.main(_argv(tiny_checkpoint, out, "--lr", "1e30", "--warmup-steps", "0"))
    message = str(error_info.value)
    assert isinstance(error_info.value, finetune.DeadModelError)
    assert message.startswith("the trained model (after step 1) no longer predicts: "), message
    assert "its logits are constant across the vocabulary (every logit 0.0)" in message
    assert "divides by a mean square of inf" in message and "the learning rate 1e+30 may be too large" in message
    _assert_untouched(out, snapshot)


def test_check_predicts_sees_the_dead_model(tiny_checkpoint):
    """The dead model by hand (the embeddings scaled by 1e30): every weight finite, every logit exactly 0.0;
    :func:`check_predicts` names it, the untouched model passes."""
    from glm53flash_hf.processing_glm53flash import Glm53FlashProcessor

    tiny_processor = Glm53FlashProcessor.from_pretrained(tiny_checkpoint)
    model = finetune.load_model(tiny_checkpoint, torch.float32)
    question = "Explain the pass statement."
    finetune.check_predicts(model, tiny_processor, question, "the fresh model", 1e-3)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e30)
    finetune.check_finite(model, "the broken model")  # finite: the NaN / inf checks see nothing
    with torch.no_grad():
        assert bool((model.eval()(**finetune.chat_inputs(tiny_processor, question)).logits == 0).all())
    with pytest.raises(finetune.DeadModelError, match=r"the broken model no longer predicts: .*every logit 0\.0.*"
                                                      r"mean square of inf"):
        finetune.check_predicts(model, tiny_processor, question, "the broken model", 1e30)


def test_constant_logits_fail_the_merge_comparison(tiny_checkpoint):
    """Two models with the same constant logits differ by 0: :func:`max_logit_difference` names them degenerate."""
    from types import SimpleNamespace

    from glm53flash_hf.processing_glm53flash import Glm53FlashProcessor

    class Constant(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return SimpleNamespace(logits=torch.full((*input_ids.shape, 7), 0.5))

    tiny_processor = Glm53FlashProcessor.from_pretrained(tiny_checkpoint)
    diff, scale, degenerate = finetune.max_logit_difference(Constant(), Constant(), tiny_processor, "Explain pass.")
    assert (diff, scale) == (0.0, 0.5)
    assert degenerate == ("the first model's logits on the text prompt are constant across the vocabulary (every "
                          "logit 0.5)")
    same = finetune.logit_degeneracy(torch.tensor([[[1.0, 2.0], [1.0, 2.0]]]))
    assert same == "the same at every one of the 2 positions"
    assert finetune.logit_degeneracy(torch.tensor([[[1.0, 2.0], [2.0, 1.0]]])) is None


def test_loss_that_never_moved_is_refused():
    with pytest.raises(finetune.DeadModelError, match=r"all 3 logged losses are 7\.5; the learning rate 1e\+30"):
        finetune.check_loss_moved([7.5, 7.5, 7.5], 1e30)
    finetune.check_loss_moved([7.5], 1e-3)
    finetune.check_loss_moved([7.5, 7.5, 7.25], 1e-3)


def test_second_run_into_a_held_folder_is_refused(tiny_checkpoint, tmp_path, capsys):
    """Another process holds the folder: a run is refused naming the folder and that process's pid; once the holder
    is killed (SIGKILL, no clean-up), its lock file no longer blocks."""
    out = tmp_path / "out"
    with finetune.output_lock(str(out)) as lock_path:
        assert open(lock_path).read() == f"{os.getpid()}\n"
        with pytest.raises(finetune.OutputBusyError, match=rf"'{out}' is in use .* \(pid {os.getpid()}, lock file"):
            with finetune.output_lock(str(out)):
                pass
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
         "fcntl.flock(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); os.write(fd, f'{os.getpid()}\\n'.encode()); "
         "print('held', flush=True); sys.stdin.read()", lock_path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SystemExit) as exit_info:
            finetune.main(_argv(tiny_checkpoint, out))
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, err
        assert f"error: --output-dir '{out}' is in use by another glm53flash-finetune run (pid {holder.pid}" in err
        assert not os.path.exists(out) and not os.path.exists(finetune.staging_folder(str(out)))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with finetune.output_lock(str(out)):
        assert open(lock_path).read() == f"{os.getpid()}\n"



# ------------------------------------------------------------------------------------------------ publishing


def _cross_device(monkeypatch, staging):
    """Renames and hard links from inside ``staging`` to outside it fail as they do when the output folder is on
    another file system."""
    import errno

    for name in ("rename", "replace", "link"):
        original = getattr(os, name)

        def crossing(src, dst, *args, _original=original, _name=name, **kwargs):
            inside = [os.path.abspath(os.fspath(p)).startswith(staging + os.sep) for p in (src, dst)]
            if inside == [True, False]:
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), src, None, dst)
            return _original(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, name, crossing)


@pytest.mark.parametrize("mount_point", [False, True], ids=["other-fs", "mount-point"])
def test_publish_across_file_systems(tiny_checkpoint, old_output, monkeypatch, mount_point):
    """``--output-dir`` on another file system than its staging folder (every rename or link out of staging fails
    with EXDEV); ``mount_point``: the output folder is a mount point, so the save goes through its journal inside
    it. The run publishes a complete folder (the user's README kept) and leaves no staging folder."""
    out, snapshot = old_output
    staging = finetune.staging_folder(str(out))
    _cross_device(monkeypatch, staging)
    if mount_point:
        ismount = os.path.ismount
        monkeypatch.setattr(os.path, "ismount", lambda p: os.path.realpath(p) == os.path.realpath(out) or ismount(p))
    assert finetune.main(_argv(tiny_checkpoint, out, "--seed", "1")) == 0
    finetune.check_saved_folder(str(out), adapter=True)
    assert (out / "README.md").read_text() == "user notes\n"
    assert _snapshot(out)[finetune.LOSS_LOG] != snapshot[finetune.LOSS_LOG]  # the new run's
    assert sorted(os.listdir(out.parent)) == [".out.lock", "out"]
    assert not [name for name in os.listdir(out) if name.startswith(".glm53flash-save")]


def test_failed_publish_keeps_staging_and_names_it(tiny_checkpoint, old_output, monkeypatch):
    """The swap into ``--output-dir`` fails (EIO): the old output stays as it was, and the staging folder, the run's
    only complete copy, is kept and named in the error; the next run's cleanup moves it aside instead of deleting it."""
    import errno

    from glm53flash_hf import checkpoint_io

    out, snapshot = old_output
    staging = finetune.staging_folder(str(out))

    exchange_paths = checkpoint_io.exchange_paths

    def failing_exchange(a, b):
        if os.path.realpath(b) != os.path.realpath(out):  # the saves inside staging
            return exchange_paths(a, b)
        raise OSError(errno.EIO, os.strerror(errno.EIO), a, None, b)

    monkeypatch.setattr(checkpoint_io, "exchange_paths", failing_exchange)
    with pytest.raises(RuntimeError, match=rf"kept in {staging}: ") as error_info:  # finetune.PublishError
        finetune.main(_argv(tiny_checkpoint, out, "--seed", "1"))
    assert "Input/output error" in str(error_info.value)
    assert _snapshot(out) == snapshot
    assert sorted(os.listdir(out.parent)) == [".out.lock", ".out.staging", "out"]
    finetune.check_saved_folder(staging, adapter=True)
    assert os.path.isfile(os.path.join(staging, finetune.LOSS_LOG))
    assert "Input/output error" in open(os.path.join(staging, finetune.UNPUBLISHED_MARK)).read()

    # the next run neither deletes that copy nor publishes it: it is moved aside, kept whole, and named
    monkeypatch.setattr(checkpoint_io, "exchange_paths", exchange_paths)
    unpublished = finetune._sibling(str(out), "unpublished")
    kept = finetune.clear_staging(staging, str(out))
    assert kept.startswith(unpublished + "-") and os.listdir(staging) == []
    finetune.check_saved_folder(kept, adapter=True)
    assert os.path.isfile(os.path.join(kept, finetune.LOSS_LOG))
    assert _snapshot(out) == snapshot
    # a killed run's staging folder (no mark) is removed
    open(os.path.join(staging, "partial.bin"), "w").close()
    assert finetune.clear_staging(staging, str(out)) is None and os.listdir(staging) == []



# ------------------------------------------------------------------------------------------------ router biases


def test_balanced_router_biases_reach_both_adapters_and_the_merged_model(tiny_checkpoint, tmp_path, monkeypatch,
                                                                         capsys):
    """``--balance-speed`` with LoRA: the router biases the balancing moved are in the VL adapter, the causal-LM
    adapter (under its names) and the merged model, equal to the trained ones; both adapters load them back through
    PEFT's Auto classes (no warning) and the merge check passes (exit status 0)."""
    import peft
    import transformers
    from safetensors import safe_open

    from glm53flash_hf.train.trainer import find_routers

    trained = {}
    original = finetune.save

    def save(job, trainer, tiny_processor):
        for name, router in find_routers(trainer.model).items():
            trained[name.removeprefix("base_model.model.model.language_model.")] = (
                router.e_score_correction_bias.detach().clone())
        return original(job, trainer, tiny_processor)

    monkeypatch.setattr(finetune, "save", save)
    out = tmp_path / "out"
    assert finetune.main(_argv(tiny_checkpoint, out, "--balance-speed", "0.01")) == 0
    assert "merged model vs the trained adapter" in capsys.readouterr().out
    assert trained and all(bool(bias.abs().max() > 0) for bias in trained.values())  # balancing moved them

    def biases(folder, prefix):
        found = {}
        for fname in sorted(os.listdir(folder)):
            if fname.endswith(".safetensors"):
                with safe_open(os.path.join(folder, fname), "pt") as f:
                    found.update({k[len(prefix):-len(".e_score_correction_bias")]: f.get_tensor(k) for k in f.keys()
                                  if k.endswith(".e_score_correction_bias") and k.startswith(prefix)})
        return found

    for folder, prefix in ((out / finetune.ADAPTER_VL_DIR, "base_model.model.model.language_model."),
                           (out / finetune.ADAPTER_DIR, "base_model.model.model."),
                           (out, "model.language_model.")):
        found = biases(folder, prefix)
        assert sorted(found) == sorted(trained), folder
        for name, bias in trained.items():
            assert torch.equal(found[name], bias), (folder, name)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for folder, auto_peft, prefix in ((finetune.ADAPTER_DIR, "AutoPeftModelForCausalLM", "model."),
                                      (finetune.ADAPTER_VL_DIR, "AutoPeftModel", "model.language_model.")):
        with no_warnings():
            adapted = getattr(peft, auto_peft).from_pretrained(str(out / folder), trust_remote_code=True,
                                                               dtype=torch.float32)
        loaded = {name.removeprefix("base_model.model." + prefix): router.e_score_correction_bias
                  for name, router in find_routers(adapted).items()}
        assert sorted(loaded) == sorted(trained)
        for name, bias in trained.items():
            assert torch.equal(loaded[name], bias), (folder, name)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
    for name, router in find_routers(merged).items():
        assert torch.equal(router.e_score_correction_bias, trained[name.removeprefix("model.")])

