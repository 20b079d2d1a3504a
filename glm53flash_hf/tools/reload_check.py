"""The fresh-process reload check of ``glm53flash-finetune``: load a saved folder offline through the Auto classes
with ``trust_remote_code=True`` in a process that never imports ``glm53flash_hf``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

if __package__:
    from .sft_data import IMAGE_PROMPT, PROBE_PHOTO, greedy_ids, load_photo
else:  # run as a plain file in the fresh process (see run_reload_check)
    from sft_data import IMAGE_PROMPT, PROBE_PHOTO, greedy_ids, load_photo

#: Prefix of the line carrying the fresh process's result (JSON).
RELOAD_MARKER = "GLM53FLASH_RELOAD_RESULT "


def reload_check(out: str, question: str, max_new_tokens: int = 48) -> dict:
    """Load ``out`` as a new user would (offline, Auto classes, CPU, float32) and answer ``question`` (causal LM) and
    the :data:`PROBE_PHOTO` image prompt (VL model); with an MTP layer also with ``generate(use_mtp=True)``.

    Returns:
        ``{"text_class", "vl_class", "processor_class"}`` (qualified class names), ``"text_answer"``,
        ``"image_answer"``, ``"package_imported"`` (must be False), and ``"mtp"``: ``None`` without an MTP layer,
        else ``{"text": {...}, "image": {...}}``, each ``{"equal", "drafted", "accepted", "acceptance_rate",
        "mtp_calls"}`` (``equal``: the MTP tokens equal plain greedy's).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

    def qualname(obj):
        return f"{type(obj).__module__}.{type(obj).__name__}"

    def answer(model, prompt, image, key):
        ids = greedy_ids(model, processor, prompt, image, max_new_tokens)
        text = processor.tokenizer.decode(ids, skip_special_tokens=True).strip()
        if model.config.get_text_config(decoder=True).num_nextn_predict_layers > 0:
            mtp_ids = greedy_ids(model, processor, prompt, image, max_new_tokens, use_mtp=True)
            mtp[key] = dict(model.mtp_stats, equal=mtp_ids == ids)
        return text

    mtp = {}
    processor = AutoProcessor.from_pretrained(out, trust_remote_code=True)
    lm = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    text_answer = answer(lm, question, None, "text")
    text_class = qualname(lm)
    del lm
    vl = AutoModelForImageTextToText.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    image_answer = answer(vl, IMAGE_PROMPT, load_photo(PROBE_PHOTO), "image")
    return dict(text_class=text_class, vl_class=qualname(vl), processor_class=qualname(processor),
                text_answer=text_answer, image_answer=image_answer, mtp=mtp or None,
                package_imported="glm53flash_hf" in sys.modules)


def _reload_child_main(argv) -> int:
    """Entry point of the fresh process: ``OUT QUESTION MAX_NEW_TOKENS``; prints :data:`RELOAD_MARKER` + JSON."""
    out, question, max_new_tokens = argv
    result = reload_check(out, question, int(max_new_tokens))
    print(RELOAD_MARKER + json.dumps(result), flush=True)
    return 0


def run_reload_check(out: str, question: str, max_new_tokens: int = 48, timeout: float = 900) -> dict:
    """Run :func:`reload_check` in a fresh Python process (this file run with ``runpy``, working directory ``out``).

    Raises:
        RuntimeError: the child failed or printed no result (its output is in the message).
    """
    code = ("import os, runpy, sys; sys.path.insert(0, os.path.dirname(sys.argv[1])); "
            "ns = runpy.run_path(sys.argv[1], run_name='glm53flash_reload'); "
            "raise SystemExit(ns['_reload_child_main'](sys.argv[2:]))")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(
        [sys.executable, "-c", code, os.path.abspath(__file__), os.path.abspath(out), question, str(max_new_tokens)],
        cwd=os.path.abspath(out), env=env, capture_output=True, text=True, timeout=timeout,
    )
    for line in proc.stdout.splitlines():
        if line.startswith(RELOAD_MARKER):
            return json.loads(line[len(RELOAD_MARKER):])
    raise RuntimeError(f"the fresh-process reload of {out} failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
