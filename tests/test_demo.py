"""The README's main job (``glm53flash-demo``) runs on the embedded default and reports sane numbers; a ``--model``
that is not a checkpoint is refused in one error line, and no checkpoint is created there."""

from __future__ import annotations

import os
import re

import pytest
from shared_fixtures import cli_error as _cli_error

from glm53flash_hf.tools import demo
from glm53flash_hf.tools.demo import main


def test_demo_runs_on_embedded_default(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --model ./glm53flash-tiny is made here
    assert main(["--length", "40"]) == 0
    assert (tmp_path / "glm53flash-tiny" / "config.json").is_file()
    out = capsys.readouterr().out
    diff = float(re.search(r"max \|Δlogit\| = ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-5
    assert "next-token logits finite: True" in out
    assert re.search(r"\((\d+) image placeholders\)", out).group(1) != "0"


@pytest.mark.parametrize("make", [False, True])
def test_demo_does_not_create_a_checkpoint_where_there_is_none(tmp_path, capsys, make):
    path = tmp_path / "not-a-checkpoint"
    if make:
        path.mkdir()
    err = _cli_error(demo.main, ["--model", str(path)], capsys)
    assert ("holds no config.json" if make else "does not exist") in err
    assert (not path.exists()) if not make else os.listdir(path) == []

