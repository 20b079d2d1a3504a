"""``docs/quickstart.ipynb`` runs from top to bottom and shows what its prose says.

The notebook is executed with nbclient in a fresh ``python3`` kernel (ipykernel's built-in kernelspec, which
jupyter_client starts with this test's interpreter, i.e. the venv's), working directory a temporary folder,
``HF_HUB_OFFLINE=1``, this checkout first on ``PYTHONPATH`` and ``OMP_NUM_THREADS=1`` unless already set. Any cell
that raises fails the test with the cell's traceback. The cells print machine-checkable lines (``CHAT ...``,
``LOSS ...``, ``RELOAD ...``, ``ADAPTER ...``, ``BASE ...``, ``GENERATED ...``) that the test parses. The committed
file must carry no outputs.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

try:
    import nbclient
    import nbformat
except ImportError as exc:  # fail (not skip): a notebook that is never executed rots unnoticed
    nbclient = nbformat = None
    _MISSING = exc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "docs", "quickstart.ipynb")
KERNEL = "python3"
CELL_TIMEOUT_S = 300  # the slowest cells (imports, 15 Trainer steps) take 5-15 s; room for a loaded machine


def _need_jupyter() -> None:
    if nbclient is None or nbformat is None:
        pytest.fail(f"cannot execute the notebook: {_MISSING}; nbclient, nbformat and ipykernel are in the test "
                    "extra (pip install -e '.[test]')")


def _read():
    _need_jupyter()
    with open(NOTEBOOK, encoding="utf-8") as f:
        return nbformat.read(f, as_version=4)


def _text(cell) -> str:
    """All stream and text/plain output of a code cell, concatenated."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, f"notebook output lacks a line matching {pattern!r}; output was:\n{text[-3000:]}"
    return float(match.group(1))


def test_committed_notebook_has_no_outputs():
    """Outputs are stripped before committing (they hold paths, timings and gibberish that would churn diffs)."""
    nb = _read()
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert len(code) >= 8
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"cells {dirty} of {NOTEBOOK} have stored outputs; clear them before committing"
    assert nb.metadata.get("kernelspec", {}).get("name") == KERNEL


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook after a full run in a fresh kernel (cwd: a temporary folder)."""
    _need_jupyter()
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(KERNEL)
    except NoSuchKernel:
        pytest.fail(
            f"no Jupyter kernel named {KERNEL!r} for {sys.executable}: install ipykernel into this environment "
            "(pip install -e '.[test]'), it provides the kernel the notebook test runs in"
        )
    workdir = tmp_path_factory.mktemp("notebook")
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    nb = _read()
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT_S,
        startup_timeout=120,
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute(env=env)  # raises CellExecutionError (with the cell's traceback) when a cell fails
    return nb, workdir


def test_notebook_runs_and_reports(executed):
    """Each section printed what the prose promises.

    * section 1: the model class comes from ``transformers_modules`` (the checkpoint's remote code), not
      ``transformers.models.glm5_next``; the checkpoint folder was made in the working directory;
    * section 2: the image was expanded into placeholders and ``generate`` produced new tokens;
    * section 3: the training loss fell. Same packed batch at every step, so first and last are comparable; the
      run is deterministic on CPU (fixed seeds). ``last < first - 0.1`` fails when the adapter does not learn
      (LoRA gradients not reaching the model, a frozen adapter, lr 0);
    * section 4, reload: the merged folder reloaded gives the in-memory merged model's logits on the image chat
      bit for bit (fp32 weights saved and read back unchanged, the same computation on the same inputs), so a lossy
      save (e.g. through bf16) or a dropped tensor fails;
    * section 4, adapter: base + adapter (unmerged) gives the merged model's logits within 2e-5. The merge rounds
      every adapted weight ``W + s * B @ A`` once in fp32 (<= 0.5 ulp); 2e-5 is about 4x the logits' response to a
      random 1-ulp relative perturbation of all weights (docs/design.md, "Scripts and tests"). A wrong merge or a
      missed adapter weight moves them by the fine-tune's own effect (``BASE`` line, adapter disabled), which must
      exceed 1e-2 for the comparison to mean anything;
    * the reloaded model generated new tokens.
    """
    nb, workdir = executed
    out = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")

    assert re.search(r"model:\s+transformers_modules\.\S+\.Glm53FlashForConditionalGeneration", out), out[:3000]
    assert "processor: Glm53FlashProcessor" in out
    assert os.path.exists(workdir / "glm53flash-notebook" / "glm53flash-tiny" / "config.json")

    assert _number(r"CHAT .*image_placeholders=(\d+)", out) > 0
    assert _number(r"CHAT .*new_tokens=(\d+)", out) > 0

    first = _number(r"LOSS first=([0-9.]+)", out)
    last = _number(r"LOSS first=[0-9.]+ last=([0-9.]+)", out)
    assert _number(r"LOSS .*steps=(\d+)", out) >= 10
    assert last < first - 0.1, (first, last)

    assert _number(r"RELOAD max_abs_logit_diff=([0-9.e+-]+)", out) == 0  # same weights, same code: bit-equal
    assert _number(r"ADAPTER max_abs_logit_diff=([0-9.e+-]+)", out) <= 2e-5
    assert _number(r"BASE max_abs_logit_change=([0-9.e+-]+)", out) > 1e-2
    assert _number(r"GENERATED new_tokens=(\d+)", out) > 0
    merged = workdir / "glm53flash-notebook" / "glm53flash-tiny-merged"
    for name in ("config.json", "processor_config.json", "tokenizer.json", "modeling_glm53flash.py"):
        assert (merged / name).exists(), name
