#!/usr/bin/env python
"""Fetch transformers' common model tests for the installed transformers version (used by tests/test_hf_common.py).

Downloads the source distribution of exactly the installed version from the package registry
(``pip download --no-deps --no-binary :all: transformers==<version>``), extracts its ``tests/`` folder into
``<cache>/transformers-<version>/transformers_tests`` (a package of that name, so it never shadows a project's own
``tests``) and prints that folder. ``<cache>`` is ``$GLM53FLASH_HF_CACHE`` or
``~/.cache/glm53flash-hf``. A folder already there is reused (nothing is downloaded).

The sdist ships ``tests/test_modeling_common.py`` (``ModelTesterMixin``) but not the two modules it imports
relatively, ``tests/generation/test_utils.py`` (``GenerationTesterMixin``) and ``tests/exporters/test_export.py``
(``ExportTesterMixin``). For those the script writes placeholder modules holding an empty mixin class of that name,
so ``ModelTesterMixin`` imports; the generation and export suites themselves are not available from the registry.

Usage::

    python scripts/fetch_transformers_tests.py          # prints the tests folder
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

PLACEHOLDERS = {
    "generation/test_utils.py": "GenerationTesterMixin",
    "exporters/test_export.py": "ExportTesterMixin",
}


def cache_root() -> str:
    return os.environ.get("GLM53FLASH_HF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "glm53flash-hf")


def tests_folder(version: str | None = None) -> str:
    """Where the tests of ``version`` (default: the installed transformers) are or will be."""
    if version is None:
        import transformers

        version = transformers.__version__
    return os.path.join(cache_root(), f"transformers-{version}", "transformers_tests")


def fetch(version: str | None = None) -> str:
    """Download and extract the tests of ``version`` unless already cached; return the tests folder.

    Raises:
        RuntimeError: pip could not download the sdist, or it holds no ``tests/test_modeling_common.py``.
    """
    import transformers

    version = version or transformers.__version__
    target = tests_folder(version)
    if os.path.isfile(os.path.join(target, "test_modeling_common.py")):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"transformers=={version}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archives = [f for f in os.listdir(tmp) if f.endswith(".tar.gz")]
        if proc.returncode != 0 or not archives:
            raise RuntimeError(f"could not download the transformers=={version} sdist: {proc.stderr[-2000:]}")
        prefix = f"transformers-{version}/tests/"
        staging = os.path.join(tmp, "tests")
        with tarfile.open(os.path.join(tmp, archives[0])) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.startswith(prefix):
                    member.name = member.name[len(prefix):]
                    tar.extract(member, staging, filter="data")
        if not os.path.isfile(os.path.join(staging, "test_modeling_common.py")):
            raise RuntimeError(f"the transformers=={version} sdist has no tests/test_modeling_common.py")
        for rel, cls in PLACEHOLDERS.items():
            path = os.path.join(staging, rel)
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                for pkg in (staging, os.path.dirname(path)):
                    open(os.path.join(pkg, "__init__.py"), "a").close()
                with open(path, "w") as f:
                    f.write(f'"""Placeholder: not shipped in the transformers sdist."""\n\n\nclass {cls}:\n    pass\n')
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp_target = target + ".partial"
        shutil.rmtree(tmp_target, ignore_errors=True)
        shutil.copytree(staging, tmp_target)
        os.replace(tmp_target, target)
    return target


if __name__ == "__main__":
    print(fetch())
