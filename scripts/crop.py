#!/usr/bin/env python
"""Thin wrapper for ``glm53flash-crop`` (see :mod:`glm53flash_hf.crop`): ``python scripts/crop.py SRC OUT --layers N``."""

import sys

from glm53flash_hf.crop import main

if __name__ == "__main__":
    sys.exit(main())
