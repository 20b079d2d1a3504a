#!/usr/bin/env python
"""Thin wrapper around ``glm53flash_hf.export.main`` (the ``glm53flash-export`` console command); see ``--help``."""

import sys

from glm53flash_hf.export import main

if __name__ == "__main__":
    sys.exit(main())
