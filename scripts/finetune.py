#!/usr/bin/env python
"""Thin wrapper around ``glm53flash_hf.finetune.main`` (the ``glm53flash-finetune`` console command); see ``--help``.

Runs from a checkout without installing the package too: the repository root is put on ``sys.path``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm53flash_hf.finetune import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
