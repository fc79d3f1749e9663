"""`pinfer serve`, started as a real process on a free loopback port, driven by the official
`openai` client and by raw HTTP (httpx) for the cases a client library would not send."""

import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from fixtures import make_tiny_llama_gguf

KEY = "test-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(pinf, *args):
    """(process, base URL) of `pinfer serve pinf *args` on a free loopback port, once /health is ok."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pinfer", "serve", str(pinf), "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"server did not come up: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    src = make_tiny_llama_gguf(d / "tiny.gguf", qtype="Q8_0")
    subprocess.run([sys.executable, "-m", "pinfer", "convert", str(src), "-o", str(d / "tiny.pinf"), "--sparsity", "none"],
                   check=True, capture_output=True)
    proc, base = start_server(d / "tiny.pinf", "--api-key", KEY, "-t", "1", "-c", "256", "--max-tokens-limit", "200")
    yield base
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_chat_non_streaming_with_usage_and_seed(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=12, seed=7, temperature=0.9)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.object == "chat.completion" and a.choices[0].message.role == "assistant"
    assert a.choices[0].message.content == b.choices[0].message.content   # same seed, same reply
    assert a.choices[0].finish_reason in ("stop", "length")
    assert a.usage.prompt_tokens > 0 and 0 < a.usage.completion_tokens <= 12
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens


def test_chat_streaming_framing_and_usage(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=10, temperature=0)
    assert streamed == whole.choices[0].message.content


def test_completions_both_ways_and_stop_sequences(client):
    full = client.completions.create(model="tiny", prompt="the cat", max_tokens=30, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and full.usage.completion_tokens >= 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="the cat", max_tokens=30, temperature=0, stream=True))
    assert streamed == text
    assert len(text) > 6
    stop = text[3:6]
    cut = client.completions.create(model="tiny", prompt="the cat", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_bad_api_key(server):
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"model": "tiny", "prompt": "x", "n": 3}', 400, "n"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 100000}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "unknown_field": 1, "max_tokens": 1}', 200, ""),
    (b'{"model": "tiny", "prompt": "' + b"x" * (2 << 20) + b'"}', 413, "limit"),
    (b'{"model": "tiny", "prompt": "' + b"the cat " * 400 + b'"}', 400, "context"),
])
def test_bad_requests_get_clear_4xx(server, body, status, words):
    r = httpx.post(server + "/v1/completions", content=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    if status != 200:
        assert words in r.json()["error"]["message"]


def test_disconnect_mid_stream_frees_the_model(server, client):
    with httpx.stream("POST", server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": "the", "max_tokens": 200, "stream": True,
                            "temperature": 1.0}, timeout=60) as r:
        for i, line in enumerate(r.iter_lines()):
            if i > 3:
                break  # leave mid-stream
    # the model is free again: the next request is served. The client's timeout (60 s) is the hang
    # guard: a generation the disconnect left holding the model would keep this one waiting for it
    out = client.completions.create(model="tiny", prompt="the", max_tokens=2)
    assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("length", "stop")
