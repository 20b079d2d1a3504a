"""``scripts/profile_cpu.py`` runs end to end at a tiny length: every family of the wide config shows up in the
forward and (where it has parameters reached by the loss) the backward, the time pieces cover the profiled step and
the shares add up to 100 %."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *args: str) -> tuple[str, list]:
    """``scripts/profile_cpu.py *args --threads 1`` in a child process; its stdout and its JSON results."""
    out_json = tmp_path / "prof.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "profile_cpu.py"), *args, "--threads", "1",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out_json.read_text())


def test_profile_cpu_smoke(tmp_path):
    stdout, (res,) = _run(tmp_path, "--seqlens", "64")
    assert "| family | phase | time (s) | share | op calls | GFLOP | GB moved (est.) | GFLOP/s |" in stdout
    fams = res["families"]
    assert set(fams) == {"forward", "backward"}
    expected = {"KDA", "DSA indexer", "sparse MLA", "mHC", "MoE", "loss", "other"}
    for phase in fams:
        assert set(fams[phase]) == expected
    # every family does work in the forward; all but the indexer (integer top-k output) in the backward
    for family in expected - {"other"}:
        row = fams["forward"][family]
        assert row["calls"] > 0 and row["time_s"] > 0, (family, row)
    for family in expected - {"other", "DSA indexer"}:
        row = fams["backward"][family]
        assert row["calls"] > 0 and row["time_s"] > 0 and row["flops"] > 0, (family, row)
    assert fams["forward"]["KDA"]["flops"] > 0 and fams["forward"]["MoE"]["bytes"] > 0
    attributed = sum(r["time_s"] for p in fams.values() for r in p.values())
    assert 0.8 * res["step_s"] <= attributed <= 1.01 * res["step_s"], (attributed, res["step_s"])
    shares = [float(x.split()[-2]) for x in stdout.split("shares by family (forward + backward): ")[1]
              .splitlines()[0].split(", ")]
    assert abs(sum(shares) - 100.0) < 0.5, shares
    _check_kinds(res, ("forward", "backward"))
    assert "| op kind | forward (s) | backward (s) | step (s) | share |" in stdout


def _check_kinds(res, phases):
    """The op-kind split: every kind present, products and other aten ops timed, the kinds add up to the plain
    profile's step (``outside aten`` is its remainder, so the sum can only miss by the time between the phases)."""
    import profile_cpu

    kinds = res["kinds"]
    assert set(kinds) == set(phases)
    for phase in phases:
        assert set(kinds[phase]) == set(profile_cpu.KINDS)
        assert kinds[phase]["products"] > 0 and kinds[phase]["other aten"] > 0, kinds[phase]
        assert min(kinds[phase].values()) >= 0
    total = sum(t for p in kinds.values() for t in p.values())
    assert 0.9 * res["kinds_step_s"] <= total <= 1.001 * res["kinds_step_s"], (total, res["kinds_step_s"])


def test_op_kinds():
    import profile_cpu

    assert [profile_cpu.op_kind(f"aten::{n}") for n in ("bmm", "linalg_solve_triangular", "index_select", "topk",
                                                         "mul", "copy_")] == [
        "products", "products", "gather / select", "gather / select", "other aten", "other aten"]


def test_profile_cpu_compiled_smoke(tmp_path, monkeypatch):
    """``--compiled``: the compiled step's op kinds (no family table; a traced graph has no module calls to hook)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    stdout, (res,) = _run(tmp_path, "--seqlens", "64", "--compiled")
    assert "S=64: step (compiled)" in stdout and "| family |" not in stdout
    assert res["compiled"] is True and res["families"] is None
    _check_kinds(res, ("forward", "backward"))


def test_profile_cpu_decode_smoke(tmp_path):
    """``--decode``: one cached decode step per context length, every family (the indexer through its cached entry)
    attributed in the ``decode`` phase, nothing in a backward."""
    stdout, (res,) = _run(tmp_path, "--decode", "64")
    assert "decode step after 64 tokens" in stdout
    assert res["decode"] is True and set(res["families"]) == {"decode"}
    rows = res["families"]["decode"]
    for family in ("KDA", "DSA indexer", "sparse MLA", "mHC", "MoE", "loss"):
        assert rows[family]["calls"] > 0 and rows[family]["time_s"] > 0, (family, rows[family])
    attributed = sum(r["time_s"] for r in rows.values())
    assert 0.8 * res["step_s"] <= attributed <= 1.01 * res["step_s"], (attributed, res["step_s"])
    _check_kinds(res, ("decode",))


def test_backward_range_of_a_multi_input_call_closes(monkeypatch):
    """A region's backward range opens at its output marker and closes at its input marker, also when the call has
    several differentiable inputs (``hc_post`` has four): autograd calls the input marker's backward once."""
    import profile_cpu
    import torch

    seen = []
    opened, closed = profile_cpu._Range.open, profile_cpu._Range.close
    monkeypatch.setattr(profile_cpu._Range, "open", lambda self: (seen.append(("open", id(self))), opened(self)))
    monkeypatch.setattr(profile_cpu._Range, "close", lambda self: (seen.append(("close", id(self))), closed(self)))
    region = profile_cpu._Region("mHC")
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    a2, b2 = region.enter((a, b))
    fwd, bwd = region.calls[-1]
    out = region.exit(a2 * b2)
    assert seen == [("open", id(fwd)), ("close", id(fwd))]
    out.sum().backward()
    assert seen[2:] == [("open", id(bwd)), ("close", id(bwd))] and bwd.handle is None
    assert torch.equal(a.grad, b.detach()) and torch.equal(b.grad, a.detach())
