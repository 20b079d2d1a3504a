"""The README's main job (``glm53flash-demo``) runs on the embedded default and reports sane numbers."""

from __future__ import annotations

import re

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
