"""vLLM's OpenAI-compatible server with the plugin, as a client uses it: started through make
(`make vllm-serve`, which avoids the `vllm` command's trap), text in and text out with the
`openai` client, the same answers as LLM.generate and LLM.chat, then bad requests, each a 4xx,
and the server still serving after each."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.vllm import engine, kimi_tiny

ROOT = Path(__file__).resolve().parents[2]
START_SECONDS = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return kimi_tiny.write(tmp_path_factory.mktemp("kimi") / "model")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """The server on 127.0.0.1, healthy; stopped (its whole process group) afterwards."""
    port = free_port()
    log = (tmp_path_factory.mktemp("server") / "server.log").open("w")
    args = f"--host 127.0.0.1 --port {port} --dtype bfloat16 --max-model-len 256 --seed 0"
    process = subprocess.Popen(["make", "-s", "vllm-serve", f"MODEL={model}",
                                f"VLLM_ARGS={args}"], cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_SECONDS
    while get(f"{base}/health") != 200:
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"the server did not start: {Path(log.name).read_text()[-4000:]}")
        time.sleep(2)
    yield base
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def offline(model, tmp_path_factory):
    """LLM.generate's and LLM.chat's greedy answers, from an engine of its own, compiled as
    the server is (vLLM's compiled bf16 layers need not give eager's bits)."""
    out = tmp_path_factory.mktemp("offline")
    done = engine.run(model, out, "--text", "--compile")
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def test_completions_are_llm_generates_answers(client, model, offline):
    got = [client.completions.create(model=str(model), prompt=p, max_tokens=engine.NEW_TOKENS,
                                     temperature=0).choices[0].text for p in engine.TEXT]
    assert got == offline["completions"]
    assert all(t.strip() for t in got)


def test_chat_is_llm_chats_answer(client, model, offline):
    answer = client.chat.completions.create(model=str(model), messages=engine.CHAT,
                                            max_tokens=engine.NEW_TOKENS, temperature=0)
    assert answer.choices[0].message.content == offline["chat"]


def post(server: str, path: str, body: bytes) -> int:
    request = urllib.request.Request(f"{server}{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


BAD = {
    "a token id past the vocabulary": {"prompt": [1, 99999], "max_tokens": 2},
    "max_tokens past the model's length": {"prompt": "w1 w2", "max_tokens": 100000},
    "a malformed body": None,
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_request_gets_a_4xx_and_the_server_serves_on(server, client, model, case):
    body = b'{"model": "x", "prompt": ' if BAD[case] is None else json.dumps(
        {"model": str(model), **BAD[case]}).encode()
    status = post(server, "/v1/completions", body)
    assert 400 <= status < 500, status
    assert get(f"{server}/health") == 200
    answer = client.completions.create(model=str(model), prompt=engine.TEXT[0],
                                       max_tokens=engine.NEW_TOKENS, temperature=0)
    assert answer.choices[0].text.strip()
