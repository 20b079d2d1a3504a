"""Saves that a kill cannot destroy (:func:`glm53flash_hf.checkpoint_io.atomic_save`): kill points, mount points
(journal), non-finite weights, and the Trainer's checkpoints.

Kill-point oracle: a forked child saves a new checkpoint (one ``model.safetensors``) over an old one (several shards
+ index, a README and an ``adapter/`` subfolder) and SIGKILLs itself right before its k-th file operation (renames,
exchanges, links, deletions, folder creations, files opened for writing, including those inside ``shutil.rmtree``),
for every k until the save completes. After each kill the folder's file names equal the old or the new checkpoint's
(a mix would show), ``from_pretrained`` loads the weights of the one the names say, and the next save leaves no
hidden copy beside or inside the folder.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import signal
import sys
import traceback

import pytest
import torch
from ckpt_fixtures import tiny_config
from tiny import randomize_

from glm53flash_hf import checkpoint_io
from glm53flash_hf.modeling_glm53flash import Glm53FlashForCausalLM

TEXT = dict(num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"], indexer_types=["full"],
            num_nextn_predict_layers=0)
PROBE = "model.embed_tokens.weight"
OS_OPS = ("rename", "replace", "link", "unlink", "remove", "rmdir", "mkdir", "symlink")


def _model(seed: int) -> Glm53FlashForCausalLM:
    torch.manual_seed(seed)
    model = Glm53FlashForCausalLM(tiny_config(**TEXT)).eval()
    randomize_(model, seed)
    return model


@pytest.fixture(scope="module")
def models():
    return _model(1), _model(2)


@pytest.fixture(scope="module")
def old_folder(models, tmp_path_factory):
    """The old checkpoint: sharded + index, with a README and an adapter subfolder (kept by every save)."""
    folder = tmp_path_factory.mktemp("old") / "ckpt"
    models[0].save_pretrained(str(folder), max_shard_size="150KB")
    (folder / "README.md").write_text("notes")
    (folder / "adapter").mkdir()
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    return str(folder)


def _names(folder) -> set[str]:
    return set(os.listdir(folder))


def _probe(folder) -> torch.Tensor:
    return Glm53FlashForCausalLM.from_pretrained(folder).state_dict()[PROBE]


def _no_leftovers(folder) -> None:
    parent = os.path.dirname(folder)
    assert os.listdir(parent) == [os.path.basename(folder)], os.listdir(parent)
    assert not [n for n in os.listdir(folder) if n.startswith(".")], os.listdir(folder)


def _mount_point(monkeypatch, target: str) -> None:
    """Make ``target`` behave as a mount point: renaming or exchanging the folder itself fails with EBUSY."""
    real_rename, real_exchange = os.rename, checkpoint_io.exchange_paths
    target = os.path.realpath(target)

    def busy(a, b):
        if target in (os.path.realpath(a), os.path.realpath(b)):
            raise OSError(errno.EBUSY, "Device or resource busy (test)", a)

    def rename(a, b, *args, **kwargs):
        busy(a, b)
        return real_rename(a, b, *args, **kwargs)

    def exchange(a, b):
        busy(a, b)
        return real_exchange(a, b)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(checkpoint_io, "exchange_paths", exchange)


def _hook_file_operations(on_op) -> None:
    """Call ``on_op(kind)`` before every file operation of this process (the ``os`` functions of
    :data:`OS_OPS`, also those ``shutil`` calls, the exchange, and ``open`` for writing)."""

    def wrap(kind, fn, writes_only=False):
        def op(*args, **kwargs):
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
            if not writes_only or (isinstance(mode, str) and any(c in mode for c in "wax+")):
                on_op(kind)
            return fn(*args, **kwargs)

        return op

    for name in OS_OPS:
        setattr(os, name, wrap(name, getattr(os, name)))
    checkpoint_io.exchange_paths = wrap("exchange", checkpoint_io.exchange_paths)
    builtins.open = wrap("open", builtins.open, writes_only=True)


def _fork_save(model, folder: str, mode: str, on_op) -> str:
    """Fork a child that saves ``model`` to ``folder`` with ``on_op`` hooked on its file operations; returns
    "killed" (SIGKILL), "done", or raises for a failed or hung child."""
    import time

    pid = os.fork()
    if pid == 0:  # the child never returns
        code = 1
        try:
            if mode == "mount":
                _mount_point(pytest.MonkeyPatch(), folder)
            elif mode == "no-exchange":
                checkpoint_io.exchange_paths = lambda a, b: False
            _hook_file_operations(on_op)
            model.save_pretrained(folder)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise RuntimeError(f"the child saving {folder} hung")
        time.sleep(0.005)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return "done"
    raise RuntimeError(f"the child saving {folder} failed (status {status}; traceback above)")


# Kinds of operation of which only every BULK_STRIDE-th and the last are kill points (each is one of many alike:
# files written into the unfinished folder, files of a hidden copy deleted, entries moved into an uncommitted
# journal, files moved from a committed journal into place); every other operation (the exchange, links, folder
# creation and removal) is one each.
BULK_KINDS, BULK_STRIDE = ("open", "unlink", "remove", "rename", "replace"), 8


def _kill_points_server(old_folder: str, root: str, modes: list[str]) -> dict:
    """Body of the helper process (a fresh interpreter with one thread of computation: forking it is safe). For
    each mode, a first child records the save's file operations; then, for each chosen k, a child saving over a
    copy ``{root}/{mode}/k{k}/ckpt`` of ``old_folder`` is killed before operation k."""
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    new = _model(2)
    out = {"exchange": checkpoint_io.exchange_paths(old_folder, old_folder)}
    for mode in modes:
        folder = os.path.join(root, mode, "dry", "ckpt")
        shutil.copytree(old_folder, folder)
        record = os.path.join(root, mode, "ops.txt")
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            assert _fork_save(new, folder, mode, lambda kind, fd=fd: os.write(fd, f"{kind}\n".encode())) == "done"
        finally:
            os.close(fd)
        with open(record) as f:
            ops = f.read().split()
        shutil.rmtree(os.path.dirname(folder))
        seen, points = {}, []
        for k, kind in enumerate(ops, start=1):
            seen[kind] = seen.get(kind, 0) + 1
            last = kind not in ops[k:]
            if kind not in BULK_KINDS or seen[kind] % BULK_STRIDE == 1 or last:
                points.append(k)
        results = {}
        for k in points:
            folder = os.path.join(root, mode, f"k{k}", "ckpt")
            shutil.copytree(old_folder, folder)
            count = [0]

            def die(kind, k=k, count=count):
                count[0] += 1
                if count[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)

            results[k] = _fork_save(new, folder, mode, die)
        out[mode] = {"ops": ops, "results": results}
    return out


MODES = ["exchange", "mount", "no-exchange"]


@pytest.fixture(scope="module")
def killed_saves(old_folder, tmp_path_factory):
    """Run :func:`_kill_points_server` in a fresh interpreter (never fork pytest, which may hold threads)."""
    import subprocess

    root = str(tmp_path_factory.mktemp("kills"))
    script = (
        "import json, os, sys; sys.path[:0] = [sys.argv[1], os.path.join(os.path.dirname(sys.argv[1]), 'scripts')]; "
        "import test_checkpoint_save as t; "
        "json.dump(t._kill_points_server(sys.argv[2], sys.argv[3], sys.argv[4:]), open(sys.argv[3] + '/out.json', 'w'))"
    )
    tests = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, "-c", script, tests, old_folder, root, *MODES], check=True, timeout=600)
    with open(os.path.join(root, "out.json")) as f:
        return root, json.load(f)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("mode", MODES)
def test_kill_at_file_operations_leaves_old_or_new(models, old_folder, killed_saves, tmp_path, mode):
    root, out = killed_saves
    if mode == "exchange" and not out["exchange"]:
        pytest.skip("renameat2(RENAME_EXCHANGE) unavailable here")
    old, new = models
    ops, results = out[mode]["ops"], out[mode]["results"]
    expected_kind = {"exchange": "exchange", "mount": "replace", "no-exchange": "rename"}[mode]
    assert expected_kind in ops and set(results.values()) == {"killed"}, (ops, results)
    reference = str(tmp_path / "reference" / "ckpt")
    shutil.copytree(old_folder, reference)
    new.save_pretrained(reference)
    old_names, new_names = _names(old_folder), _names(reference)
    assert new_names != old_names and "model.safetensors" in new_names
    probes = {"old": old.state_dict()[PROBE], "new": new.state_dict()[PROBE]}
    seen = {"old": 0, "new": 0}
    for k in sorted(results, key=int):
        folder = os.path.join(root, mode, f"k{k}", "ckpt")
        probe = _probe(folder)  # from_pretrained first finishes or undoes what the killed save left
        names = _names(folder)
        assert names in (old_names, new_names), f"k={k} ({ops[int(k) - 1]}): old and new mixed: {sorted(names)}"
        which = "new" if names == new_names else "old"
        assert torch.equal(probe, probes[which]), f"k={k}: the files of the {which} checkpoint, other weights"
        with open(os.path.join(folder, "README.md")) as f:
            assert f.read() == "notes"
        seen[which] += 1
        new.save_pretrained(folder)
        _no_leftovers(folder)
    assert seen["old"] > 0 and seen["new"] > 0, seen


def test_mount_point_folder_is_saved_in_place(models, old_folder, tmp_path, monkeypatch):
    """The folder itself cannot be renamed (EBUSY): the save goes through the journal inside it; the folder (same
    inode) holds the new checkpoint, the README and adapter are kept, the old shards and index are gone."""
    old, new = models
    folder = str(tmp_path / "volume")
    shutil.copytree(old_folder, folder)
    inode = os.stat(folder).st_ino
    _mount_point(monkeypatch, folder)
    with pytest.raises(OSError, match="busy"):  # the simulation is effective
        os.rename(folder, str(tmp_path / "elsewhere"))
    new.save_pretrained(folder)
    monkeypatch.undo()
    assert os.stat(folder).st_ino == inode
    names = _names(folder)
    assert "model.safetensors" in names and "model.safetensors.index.json" not in names
    assert not [n for n in names if n.startswith("model-")] and {"README.md", "adapter"} <= names
    _no_leftovers(folder)
    assert torch.equal(_probe(folder), new.state_dict()[PROBE])


def test_detected_mount_point_writes_into_the_journal_directly(models, old_folder, tmp_path, monkeypatch):
    """``os.path.ismount`` true: nothing is written beside the folder (its parent may be another file system)."""
    _, new = models
    folder = str(tmp_path / "volume")
    shutil.copytree(old_folder, folder)
    import tempfile

    real_ismount, real, made = os.path.ismount, tempfile.mkdtemp, []

    def mkdtemp(*args, **kwargs):
        path = real(*args, **kwargs)
        made.append(os.path.dirname(path))
        return path

    monkeypatch.setattr(os.path, "ismount", lambda p: os.path.realpath(p) == folder or real_ismount(p))
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    new.save_pretrained(folder)
    monkeypatch.undo()
    assert made and all(os.path.realpath(p) == os.path.realpath(folder) for p in made), made
    _no_leftovers(folder)
    assert torch.equal(_probe(folder), new.state_dict()[PROBE])


@pytest.mark.parametrize("committed", [True, False])
def test_load_finishes_a_committed_journal_and_drops_an_uncommitted_one(models, old_folder, tmp_path, monkeypatch,
                                                                        committed):
    """A save into a mount point cut off after its commit (the roll-forward raised) leaves a journal that
    ``from_pretrained`` completes before reading (new weights); one cut off before the commit is removed (old)."""
    old, new = models
    folder = str(tmp_path / "volume")
    shutil.copytree(old_folder, folder)
    _mount_point(monkeypatch, folder)

    def cut(*args, **kwargs):
        raise KeyboardInterrupt("cut off (test)")

    if committed:
        monkeypatch.setattr(checkpoint_io, "_roll_forward", cut)
    else:
        rename = os.rename

        def commit(a, b, *args, **kwargs):
            if os.path.basename(a).startswith(".glm53flash-save.tmp-"):
                cut()
            return rename(a, b, *args, **kwargs)

        monkeypatch.setattr(os, "rename", commit)
    with pytest.raises(KeyboardInterrupt, match="cut off"):
        new.save_pretrained(folder)
    monkeypatch.undo()
    journals = [n for n in os.listdir(folder) if n.startswith(".glm53flash-save.")]
    if committed:  # the journal stays for the next load; without the lock of a living save it is not in use
        assert len(journals) == 1 and journals[0].startswith(".glm53flash-save.commit-")
    else:  # an exception (not a kill) already removes the uncommitted journal
        assert journals == []
    expected = (new if committed else old).state_dict()[PROBE]
    assert torch.equal(_probe(folder), expected)
    _no_leftovers(folder)


def test_leftovers_of_a_running_save_are_left_alone(old_folder, tmp_path):
    """A load while another save of the folder runs (it holds the lock on its work folder; ``flock`` locks of two
    ``open`` calls conflict also within one process) removes nothing; once the lock is released it cleans up."""
    folder = str(tmp_path / "ckpt")
    shutil.copytree(old_folder, folder)
    busy = tmp_path / ".ckpt.tmp-running"
    busy.mkdir()
    lock = checkpoint_io.FileLock(str(busy))
    assert lock.acquire()
    checkpoint_io.recover_interrupted_save(folder)
    assert busy.is_dir()
    lock.release()
    checkpoint_io.recover_interrupted_save(folder)
    assert not busy.exists()


def test_missing_folder_is_restored_from_its_old_copy(models, old_folder, tmp_path):
    """Killed between the two renames of the fallback (or by an earlier version of the save): the folder is absent,
    its complete old copy and a new folder sit beside it; the load renames the old one back."""
    old, _ = models
    shutil.copytree(old_folder, tmp_path / ".ckpt.old-abcd1234")
    (tmp_path / ".ckpt.tmp-efgh5678").mkdir()
    (tmp_path / ".ckpt.old-empty000").mkdir()
    folder = str(tmp_path / "ckpt")
    assert torch.equal(_probe(folder), old.state_dict()[PROBE])
    _no_leftovers(folder)


# A save without renameat2(RENAME_EXCHANGE), SIGKILLed right before its second rename (the new folder into place), in a
# fresh interpreter (never fork pytest).
_KILL_BETWEEN_RENAMES = """
import os, signal, sys
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1]), os.path.join(os.path.dirname(sys.argv[1]), "scripts")]
import test_checkpoint_save as t
from glm53flash_hf import checkpoint_io
folder = sys.argv[2]
checkpoint_io.exchange_paths = lambda a, b: False  # the fallback, as where the exchange is unavailable
def die(kind):
    if kind == "rename" and not os.path.lexists(folder):  # the old folder is aside, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
t._hook_file_operations(die)
t._model(2).save_pretrained(folder)
"""

# README, Limits: what a user runs when a reader other than the package's classes finds the folder gone.
RECOVER_BY_HAND = "mv {parent}/.{name}.old-* {parent}/{name}"


def _killed_between_renames(old_folder, tmp_path) -> str:
    """A copy of ``old_folder`` whose fallback save was killed between the two renames; returns the folder path."""
    import subprocess

    folder = str(tmp_path / "ckpt")
    shutil.copytree(old_folder, folder)
    tests = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, "-c", _KILL_BETWEEN_RENAMES, tests, folder], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert not os.path.lexists(folder)
    left = sorted(os.listdir(tmp_path))
    assert [n.split("-")[0] for n in left] == [".ckpt.old", ".ckpt.tmp"], left
    return folder


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_fallback_killed_between_renames_transformers_reader_and_recovery(models, old_folder, tmp_path):
    """Without RENAME_EXCHANGE a kill between the two renames leaves no folder (a directory cannot be renamed over a
    non-empty one, so the path is vacated before the new folder takes it). transformers' Auto class, which runs none
    of the package's code before it finds the folder, fails with huggingface_hub's "Repo id must be in the form";
    the README's recovery command (or any load or save by the package's classes) brings the old checkpoint back, and
    the Auto class then loads it."""
    from transformers import AutoModelForCausalLM

    old, _ = models
    folder = _killed_between_renames(old_folder, tmp_path / "by_hand")
    with pytest.raises(OSError, match=r"Repo id must be in the form"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    parent, name = os.path.split(folder)
    import subprocess

    subprocess.run(RECOVER_BY_HAND.format(parent=parent, name=name), shell=True, check=True)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert torch.equal(reloaded.state_dict()[PROBE], old.state_dict()[PROBE])
    assert _names(folder) == _names(old_folder)
    Glm53FlashForCausalLM.from_pretrained(folder)  # removes the unfinished new folder left beside it
    _no_leftovers(folder)

    folder = _killed_between_renames(old_folder, tmp_path / "by_the_package")
    assert torch.equal(_probe(folder), old.state_dict()[PROBE])  # the package's class restores it first
    _no_leftovers(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert torch.equal(reloaded.state_dict()[PROBE], old.state_dict()[PROBE])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(models, tmp_path, bad):
    model = _model(3)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = bad
    folder = tmp_path / "ckpt"
    message = r"1 weight tensors hold NaN or Inf values: lm_head\.weight \(.*\); .*allow_nonfinite_weights=True"
    with pytest.raises(ValueError, match=message):
        model.save_pretrained(str(folder))
    assert not folder.exists() and os.listdir(tmp_path) == []
    state = {k: v.clone() for k, v in models[1].state_dict().items()}
    state[PROBE][1, 2] = bad
    with pytest.raises(ValueError, match=rf"NaN or Inf values: {PROBE} \("):
        models[1].save_pretrained(str(folder), state_dict=state)
    model.save_pretrained(str(folder), allow_nonfinite_weights=True)
    reloaded = Glm53FlashForCausalLM.from_pretrained(str(folder), allow_nonfinite_weights=True)
    loaded = reloaded.state_dict()["lm_head.weight"]
    assert not torch.isfinite(loaded[0, 0]) and torch.isfinite(loaded.flatten()[1:]).all()


# ------------------------------------------------------------------------------------------------ Trainer


def _trainer(output_dir, max_steps, evaluate=False, **kwargs):
    from transformers import TrainingArguments

    from glm53flash_hf.train.trainer import Glm53FlashTrainer

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 200, (4, 8), generator=g)
    rows = [{"input_ids": ids[i], "labels": ids[i]} for i in range(4)]
    args = TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, report_to=[], max_steps=max_steps, per_device_train_batch_size=2,
        learning_rate=1e-3, save_strategy="steps", save_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        seed=0, **kwargs,
    )
    return Glm53FlashTrainer(model=_model(5), args=args, train_dataset=rows, eval_dataset=rows if evaluate else None,
                             pad_token_id=0)


def test_trainer_checkpoint_cut_off_is_never_resumed(tmp_path, monkeypatch):
    """The second checkpoint save dies after the model and optimizer are written (an exception in the RNG-state
    save): no ``checkpoint-2`` exists, ``get_last_checkpoint`` gives ``checkpoint-1``, and resuming trains from it,
    writes ``checkpoint-2`` and removes the partial folder."""
    from transformers import Trainer
    from transformers.trainer_utils import get_last_checkpoint

    real, calls = Trainer._save_rng_state, [0]

    def rng_state(self, output_dir):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt("killed (test)")
        return real(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", rng_state)
    with pytest.raises(KeyboardInterrupt, match="killed"):
        _trainer(tmp_path, max_steps=2).train()
    monkeypatch.undo()
    names = sorted(os.listdir(tmp_path))
    assert names == [".checkpoint-2.partial", "checkpoint-1"], names
    partial = os.listdir(tmp_path / ".checkpoint-2.partial" / "checkpoint-2")
    assert "model.safetensors" in partial and "optimizer.pt" in partial  # the part that was written
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")
    trainer = _trainer(tmp_path, max_steps=2)
    trainer.train(resume_from_checkpoint=True)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-2"]
    with open(tmp_path / "checkpoint-2" / "trainer_state.json") as f:
        assert json.load(f)["global_step"] == 2
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= _names(tmp_path / "checkpoint-2")


def test_trainer_checkpoints_rotate_and_track_the_best(tmp_path):
    """``save_total_limit=2`` still rotates in the output folder (the staging folder holds one checkpoint only),
    keeping the best and the last; the best checkpoint's path in the state and in its ``trainer_state.json`` is the
    final ``checkpoint-1`` (the eval loss falls, and ``greater_is_better`` makes step 1 the best)."""
    trainer = _trainer(tmp_path, max_steps=3, evaluate=True, save_total_limit=2, eval_strategy="steps", eval_steps=1,
                       metric_for_best_model="loss", greater_is_better=True)
    trainer.train()
    best = str(tmp_path / "checkpoint-1")
    assert trainer.state.best_model_checkpoint == best
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1", "checkpoint-3"]
    for step in (1, 3):
        with open(tmp_path / f"checkpoint-{step}" / "trainer_state.json") as f:
            assert json.load(f)["best_model_checkpoint"] == best


def test_trainer_resume_restores_the_saved_weights(tmp_path):
    """Resuming reads the checkpoint's weights (saved in the published layout) into the model: after
    ``_load_from_checkpoint`` the model equals ``from_pretrained(checkpoint-1)``, which differs from the fresh
    model the Trainer was built with."""
    _trainer(tmp_path, max_steps=1).train()
    folder = str(tmp_path / "checkpoint-1")
    saved = Glm53FlashForCausalLM.from_pretrained(folder).state_dict()
    trainer = _trainer(tmp_path, max_steps=1)
    assert not torch.equal(trainer.model.state_dict()[PROBE], saved[PROBE])
    trainer._load_from_checkpoint(folder)
    state = trainer.model.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
