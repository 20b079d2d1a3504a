"""``glm53flash-export`` (and ``glm53flash-crop``) refuse an output folder that is, lies inside or links into their
input: a same path, a subfolder and hard links to the input's files each get an error naming the conflict."""

from __future__ import annotations

import os

import pytest
import shared_fixtures
from shared_fixtures import cli_error as _cli_error

from glm53flash_hf.tools import crop, export

tiny_checkpoint = shared_fixtures.tiny_checkpoint  # fixture


def test_export_and_crop_refuse_their_input(tiny_checkpoint, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"OUT=.* is the input .*OUT must differ from SRC"):
        export.export(tiny_checkpoint, tiny_checkpoint, show_progress=False)
    with pytest.raises(ValueError, match=r"OUT=.* lies inside the input"):
        export.export(tiny_checkpoint, os.path.join(tiny_checkpoint, "exported"), show_progress=False)
    os.mkdir(tmp_path / "hard")
    for name in os.listdir(tiny_checkpoint):
        if name.endswith(".safetensors"):
            os.link(os.path.join(tiny_checkpoint, name), tmp_path / "hard" / name)
    with pytest.raises(ValueError, match=r"links into the input .* is a hard link to one of its files"):
        export.export(tiny_checkpoint, str(tmp_path / "hard"), overwrite=False, show_progress=False)
    err = _cli_error(crop.main, [tiny_checkpoint, tiny_checkpoint, "--layers", "2", "--no-progress"], capsys)
    assert "is the input" in err

