"""The command-line tools: ``glm53flash-finetune`` (:mod:`.finetune`, with its SFT data :mod:`.sft_data` and
fresh-process check :mod:`.reload_check`), ``glm53flash-make-tiny`` (:mod:`.make_tiny`, the embedded tiny
checkpoint; its config is ``tiny_config.json`` here), ``glm53flash-crop``, ``glm53flash-export`` and
``glm53flash-demo``; FP8 block quantization helpers in :mod:`.fp8`.

Not part of the remote code a checkpoint carries; these modules import the flat modules, never the reverse.
"""

import argparse as _argparse
import re as _re


def docstring_parser(prog: str, doc: str) -> _argparse.ArgumentParser:
    """An ``ArgumentParser`` for the tool ``prog`` whose description is the first paragraph of the module docstring
    ``doc`` and whose epilog is the rest, with reST roles and literals turned into plain text."""

    def plain(text: str) -> str:
        return _re.sub(r":(?:meth|func|data|class|mod):`~?\.?([^`]*)`", r"\1", text).replace("``", "")

    return _argparse.ArgumentParser(
        prog=prog,
        description=plain(doc.split("\n\n")[0]),
        epilog=plain(doc.split("\n\n", 1)[1]),
        formatter_class=_argparse.RawDescriptionHelpFormatter,
    )
