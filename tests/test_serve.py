"""``transformers serve`` on a folder the package writes, as a user runs it: the ``transformers`` command on loopback
with ``--trust-remote-code``, the ``openai`` client with its defaults, a chat completion plain and streaming, then the
server stopped by its pid. The answers equal ``generate`` on the same folder through the Auto classes (greedy for
``temperature=0``); a request's temperature is honoured (the folder's generation_config samples by default)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
import transformers
from packaging.version import Version

# transformers 5.23's serve picks the modality by the loaded class's name among its built-in classes, so it answers
# every remote-code model with "Unknown modality for: <class>" (HTTP 500); 5.25 picks it by the config's model type.
pytestmark = pytest.mark.skipif(Version(transformers.__version__) < Version("5.25"),
                                reason="transformers serve before 5.25 refuses remote-code classes (Unknown modality)")

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from transformers import AutoModelForMultimodalLM, AutoProcessor  # noqa: E402

from glm53flash_hf.tools.make_tiny import make_tiny  # noqa: E402

MESSAGES = [{"role": "user", "content": "Name three rivers in Europe."}]
MAX_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc, port: int, log_path: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"transformers serve exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"transformers serve not ready after {timeout} s:\n{open(log_path).read()[-4000:]}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(str(tmp_path_factory.mktemp("serve") / "tiny"), seed=0, show_progress=False)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    port = _free_port()
    log_path = str(tmp_path_factory.mktemp("serve_log") / "serve.log")
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [cli, "serve", tiny, "--trust-remote-code", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
             "--dtype", "float32"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        _wait_ready(proc, port, log_path)
        yield {"port": port, "proc": proc, "log": log_path}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="unused")


@pytest.fixture(scope="module")
def greedy(tiny):
    """The answer ``generate`` gives on the same folder, loaded as serve loads it, greedy."""
    processor = AutoProcessor.from_pretrained(tiny, trust_remote_code=True)
    model = AutoModelForMultimodalLM.from_pretrained(tiny, trust_remote_code=True, dtype=torch.float32)
    inputs = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_chat_completion_equals_generate(client, tiny, greedy):
    reply = client.chat.completions.create(model=tiny, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].message.content == greedy and greedy
    assert reply.usage.completion_tokens == MAX_TOKENS


def test_streaming_chat_completion_equals_generate(client, tiny, greedy):
    stream = client.chat.completions.create(model=tiny, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == greedy


def test_request_temperature_is_honoured(client, tiny, greedy):
    # generation_config.json samples by default, so a request's temperature samples (seeded: the same twice); with
    # do_sample off it would be ignored and the answer would be the greedy one.
    sampled = [client.chat.completions.create(model=tiny, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.5,
                                              seed=1234).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1] != greedy


def test_server_stops_by_pid(server, client):
    # after the other tests (module order): the server is up until it is stopped by its pid, then its port is closed
    proc = server["proc"]
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/health", timeout=5)
