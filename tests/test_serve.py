"""specedge serve, tested with the official openai client against a real server on loopback.

The oracle is a separate Generator on the same bundle running plain greedy decode: whatever the server does
(speculation, prefix reuse, concurrency), its greedy text must be that text.
"""
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import uvicorn
from openai import APIStatusError, OpenAI

from specedge.graphs import contract as C
from specedge.serve.app import ServerConfig, create_app, load_engine
from specedge.serve.engine import EngineConfig

MODEL = "tiny"


def free_port(candidates: range | None = None) -> int:
    """A port nothing listens on: any the kernel picks, or one of `candidates`."""
    for port in random.Random().sample(candidates, len(candidates)) if candidates else [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in {candidates}")


class Server:
    """uvicorn in a thread of the test process, on a free loopback port."""

    def __init__(self, bundle: str, history_tokens: int = 0, sampling_defaults: dict | None = None,
                 lazy_row_steps: bool = False, **engine_options):
        self.config = ServerConfig(bundle, threads=1, engine=EngineConfig(**engine_options), model_id=MODEL,
                                   history_tokens=history_tokens, sampling_defaults=sampling_defaults or {},
                                   lazy_row_steps=lazy_row_steps)
        self.engine = load_engine(self.config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(create_app(self.config, self.engine), host="127.0.0.1",
                                                     port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 20
        while not self._server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)

    def client(self, **kw) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}

    def healthy(self) -> bool:
        return httpx.get(self.url + "/health").json() == {"status": "ok"}

    def close(self):
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.engine.close()


@pytest.fixture(scope="module")
def server(tiny_bundle):
    s = Server(tiny_bundle, proposer="ngram", gamma=4, max_tokens=24, max_queue=16)
    yield s
    s.close()


@pytest.fixture(scope="module")
def oracle(gen):
    """The in-process generator the server's answers are compared with."""
    return gen


def words(seed: int, n: int) -> str:
    """A prompt in the tiny word tokenizer's language, half of it repeated (prompt lookup finds drafts)."""
    ids = np.random.default_rng(seed).integers(5, 1000, (n + 1) // 2).tolist()
    return " ".join(f"t{i}" for i in (ids + ids)[:n])


def expected(oracle, ids: list[int], max_tokens: int) -> str:
    out = oracle.generate(ids, max_tokens, proposer="none")
    return oracle.tokenizer.decode(out.tokens)


def chat_ids(oracle, messages) -> list[int]:
    return oracle.tokenizer.apply_chat_template(messages)


def test_chat_and_completions_equal_plain_greedy_decode(server, oracle):
    client = server.client()
    for proposer in ("none", "ngram", "draft"):
        messages = [{"role": "user", "content": words(1, 30)}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                           extra_body={"proposer": proposer})
        assert r.choices[0].message.content == expected(oracle, chat_ids(oracle, messages), 20)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.model_extra["specedge"]["proposer"] == proposer
        prompt = words(2, 25)
        c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"proposer": proposer})
        assert c.choices[0].text == expected(oracle, oracle.tokenizer.encode(prompt), 20)
        assert c.usage.prompt_tokens == 25 and c.usage.completion_tokens <= 20
    stats = r.model_extra["specedge"]
    assert stats["proposed"] > 0 and stats["rounds"] > 0  # the speculative path ran over HTTP


def test_streaming_chat_sends_the_same_text_in_chunks_then_usage(server, oracle):
    client = server.client()
    messages = [{"role": "user", "content": words(3, 40)}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    pieces, finish, use, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage:
            use = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == expected(oracle, chat_ids(oracle, messages), 24)
    assert roles[0] == "assistant" and len([p for p in pieces if p]) > 1
    assert finish in ("stop", "length") and use.completion_tokens > 0
    text = server.client().completions.create(model=MODEL, prompt=words(4, 20), max_tokens=16, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].text for c in text if c.choices) == \
        expected(oracle, oracle.tokenizer.encode(words(4, 20)), 16)


def test_n_choices_are_the_samples_of_their_seeds(server, batch_server, oracle):
    """n choices: choice k is the run with seed + k (batch rows side by side, or one after another), plain and
    streamed, chat and completions; usage counts the prompt once and every choice's tokens."""
    messages = [{"role": "user", "content": words(8, 20)}]
    ids = chat_ids(oracle, messages)
    sampling = dict(temperature=1.0, top_p=0.9)
    want = [oracle.tokenizer.decode(oracle.generate(ids, 16, proposer="ngram", gamma=4, seed=40 + k,
                                                    **sampling).tokens) for k in range(3)]
    assert len(set(want)) == 3
    prompt = words(9, 20)
    want_c = [oracle.tokenizer.decode(oracle.generate(oracle.tokenizer.encode(prompt), 16, proposer="ngram",
                                                      gamma=4, seed=7 + k, **sampling).tokens) for k in range(2)]
    for s in (server, batch_server):
        client = s.client()
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, n=3, seed=40, **sampling)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert [c.message.content for c in r.choices] == want
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == sum(
            len(oracle.generate(ids, 16, proposer="ngram", gamma=4, seed=40 + k, **sampling).tokens) for k in range(3))
        texts, finishes = ["", "", ""], [None] * 3
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, n=3, seed=40,
                                                    stream=True, **sampling):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finishes[c.index] = c.finish_reason or finishes[c.index]
        assert texts == want and all(finishes)
        c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, n=2, seed=7, **sampling)
        assert [x.text for x in c.choices] == want_c
        texts = ["", ""]
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, n=2, seed=7, stream=True,
                                               **sampling):
            for x in chunk.choices:
                texts[x.index] += x.text
        assert texts == want_c


def test_stop_strings_cut_the_text_before_them(server, batch_server, oracle):
    """Both engines: the text before the string, and the usage plain decode has. The serial one drafts with the
    layer draft, whose rounds here go on past the string, which the runtime cuts (runtime/stop_strings.py;
    prompt lookup rarely gets there: what it drafts repeats text that held the string before)."""
    prompt = words(6, 20)
    ids = oracle.tokenizer.encode(prompt)
    full = expected(oracle, ids, 24)
    ends = np.cumsum([len(r) for r in oracle.stream(ids, 24, proposer="draft", gamma=8)])  # the serial server's rounds
    for k in range(3, 20):  # two words from the output, inside a round that goes on past them
        stop = " ".join(full.split(" ")[k:k + 2])
        plain = oracle.generate(ids, 24, proposer="none", stop=[stop])
        if len(plain.tokens) not in ends:
            break
    assert len(plain.tokens) not in ends and plain.text == full[: full.index(stop)]
    for srv, proposer in ((server, "draft"), (batch_server, "ngram")):
        kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"proposer": proposer,
                                                                                        "gamma": 8})
        r = srv.client().completions.create(stop=[stop], **kw)
        assert r.choices[0].text == plain.text and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == len(plain.tokens)
        s = srv.client().completions.create(stop=stop, stream=True, **kw)
        assert "".join(c.choices[0].text for c in s if c.choices) == plain.text


def test_logprobs_are_plain_decodes_in_openai_form(server, batch_server, oracle):
    """Chat (logprobs + top_logprobs, plain and streamed) and completions (logprobs N, with text_offset), with
    prompt lookup, through both engines: the tokens and logprobs plain decode reports (runtime/logprobs.py)."""
    tok = oracle.tokenizer
    messages = [{"role": "user", "content": words(6, 30)}]
    ids = chat_ids(oracle, messages)
    want = oracle.generate(ids, 20, proposer="none", logprobs=3)
    prompt = words(7, 24)
    want_c = oracle.generate(tok.encode(prompt), 20, proposer="none", logprobs=2)
    for s in (server, batch_server):
        client = s.client()
        kw = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body={"proposer": "ngram"})
        r = client.chat.completions.create(**kw)
        content = r.choices[0].logprobs.content
        assert [c.token for c in content] == [tok.decode([t]) for t in want.tokens]
        np.testing.assert_allclose([c.logprob for c in content], [e.logprob for e in want.logprobs], atol=1e-5)
        for c, e in zip(content, want.logprobs):
            assert [t.token for t in c.top_logprobs] == [tok.decode([i]) for i, _ in e.top]
            assert c.bytes == list(c.token.encode())
        streamed = [c for chunk in client.chat.completions.create(stream=True, **kw) for choice in chunk.choices
                    if choice.logprobs for c in choice.logprobs.content]
        assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
        c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=2,
                                      extra_body={"proposer": "ngram"}).choices[0]
        n = len(want_c.tokens)
        assert c.logprobs.tokens == [tok.decode([t]) for t in want_c.tokens]
        np.testing.assert_allclose(c.logprobs.token_logprobs, [e.logprob for e in want_c.logprobs], atol=1e-5)
        assert [len(d) for d in c.logprobs.top_logprobs] == [2] * n
        assert c.logprobs.text_offset == [len(tok.decode(want_c.tokens[:i])) for i in range(n)]
        assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=4).choices[0].logprobs is None


def test_logprobs_stop_with_the_text_at_a_stop_string(server, oracle):
    """Tokens whose text starts after a stop string are not reported; the one that starts the stop string's
    text is cut with it too."""
    tok = oracle.tokenizer
    prompt = words(5, 20)
    full = oracle.generate(tok.encode(prompt), 24, proposer="none")
    stop = " ".join(tok.decode(full.tokens).split(" ")[3:5])
    for stream in (False, True):
        r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                               stop=[stop], logprobs=0, stream=stream)
        choices = [c for chunk in r for c in chunk.choices] if stream else r.choices
        text = "".join(c.text for c in choices)
        offsets = [o for c in choices if c.logprobs for o in c.logprobs.text_offset]
        assert text == tok.decode(full.tokens)[: tok.decode(full.tokens).index(stop)]
        assert offsets and all(o < len(text) for o in offsets)
        assert len(offsets) == sum(len(tok.decode(full.tokens[:i])) < len(text) for i in range(len(full.tokens)))


def test_eight_concurrent_greedy_requests_equal_their_sequential_outputs(server, oracle):
    prompts = [[{"role": "user", "content": words(10 + i, 20 + 7 * i)}] for i in range(8)]
    want = [expected(oracle, chat_ids(oracle, m), 24) for m in prompts]

    def ask(i):
        client = server.client()
        kw = dict(model=MODEL, messages=prompts[i], max_tokens=24, temperature=0,
                  extra_body={"proposer": ("none", "ngram", "draft")[i % 3]})
        if i % 2:
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        return client.chat.completions.create(**kw).choices[0].message.content

    before = server.metrics()['specedge_requests_total{status="ok"}']
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == want
    assert server.metrics()['specedge_requests_total{status="ok"}'] == before + 8


def test_a_follow_up_turn_reuses_the_conversation_prefix(server, oracle):
    client = server.client()
    history = [{"role": "user", "content": words(20, 60)}]
    r1 = client.chat.completions.create(model=MODEL, messages=history, max_tokens=20, temperature=0)
    # Another conversation runs in between: the first one's cache is stashed, then restored.
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words(21, 50)}],
                                   max_tokens=10, temperature=0)
    history += [{"role": "assistant", "content": r1.choices[0].message.content},
                {"role": "user", "content": words(22, 10)}]
    r2 = client.chat.completions.create(model=MODEL, messages=history, max_tokens=20, temperature=0)
    ids = chat_ids(oracle, history)
    assert r2.choices[0].message.content == expected(oracle, ids, 20)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # Turn 1's prompt ended with the generation prompt, which the next rendering replaces by the assistant
    # turn: everything before it is reused.
    assert cached >= len(chat_ids(oracle, history[:1])) - 1 and cached < len(ids)
    assert r2.model_extra["specedge"]["reused_prompt_tokens"] == cached


@pytest.mark.parametrize("body,status,fragment", [
    ({"messages": [{"role": "user", "content": "t5"}]}, 400, "model parameter"),
    ({"model": "other", "messages": [{"role": "user", "content": "t5"}]}, 404, "does not exist"),
    ({"model": MODEL}, 400, "messages must be a non-empty list"),
    ({"model": MODEL, "messages": "hello"}, 400, "messages must be a non-empty list"),
    ({"model": MODEL, "messages": [{"content": "t5"}]}, 400, "with a role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": words(0, 200)}]}, 400, "context holds 128"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "n": 0}, 400, "n must be an integer in 1..16"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "ignore_eos": 1}, 400, "ignore_eos"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "stop_token_ids": [-1]}, 400,
     "stop_token_ids must be a list of token ids"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "stop_token_ids": [100000]}, 400,
     "stop_token_ids must be token ids below the vocabulary size"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "n": "2"}, 400, "n must be an integer"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "n": 17}, 400, "n must be an integer"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "seed": "x"}, 400, "seed"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "gamma": 3}, 400, "gamma 3"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "proposer": "medusa"}, 400, "proposer"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "logprobs": "yes"}, 400,
     "logprobs must be a boolean"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "top_logprobs": 3}, 400,
     "top_logprobs needs logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs must be an integer in 0..20"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "tools": [{"type": "function"}]}, 400,
     "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "stop": [1]}, 400, "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "stop": ["x"] * 17}, 400,
     "at most 16 stop strings"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "min_tokens": -1}, 400, "min_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "presence_penalty": 2.5}, 400,
     "presence_penalty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "frequency_penalty": "1"}, 400,
     "frequency_penalty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "min_p": 1.5}, 400, "min_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "logit_bias": {"x5": 1}}, 400,
     "logit_bias keys must be token ids"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "logit_bias": {"5": 101}}, 400,
     "logit_bias values must be numbers between -100 and 100"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "logit_bias": [5]}, 400,
     "logit_bias must be an object"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "logit_bias": {"100000": 1}}, 400,
     "logit_bias token 100000 is outside the vocabulary"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, fragment):
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"]
    assert server.healthy()
    ok = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t5 t6"}],
                                                  max_tokens=3, temperature=0)
    assert ok.choices[0].message.content


def test_a_gamma_without_a_verify_graph_names_the_gamma_parameter(server):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "gamma": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "gamma", r.json()


def test_min_tokens_holds_eos_back_as_the_runtime_does(server, batch_server, oracle):
    """A prompt whose plain output ends early on EOS: with min_tokens it runs on, as min_new_tokens does."""
    prompt = next(words(seed, 12) for seed in range(400)
                  if len(oracle.generate(oracle.tokenizer.encode(words(seed, 12)), 24, proposer="none").tokens) < 20)
    ids = oracle.tokenizer.encode(prompt)
    want = oracle.tokenizer.decode(oracle.generate(ids, 24, proposer="none", min_new_tokens=24).tokens)
    assert want != expected(oracle, ids, 24)
    for s in (server, batch_server):
        r = s.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"min_tokens": 24, "proposer": "ngram"})
        assert r.choices[0].text == want and r.usage.completion_tokens == 24


def test_ignore_eos_and_stop_token_ids(server, batch_server, oracle):
    """vLLM's ignore_eos runs past EOS to max_tokens (the runtime with no stop ids); stop_token_ids end the
    completion at the first of them, whose text is left out as EOS's is; both engines, streamed or not."""
    prompt = next(words(seed, 12) for seed in range(400)
                  if len(oracle.generate(oracle.tokenizer.encode(words(seed, 12)), 24, proposer="none").tokens) < 20)
    ids = oracle.tokenizer.encode(prompt)
    past_eos = oracle.generate(ids, 24, proposer="none", stop_ids=[]).tokens
    assert len(past_eos) == 24 and set(past_eos) & set(oracle.eos_ids)
    other = words(2, 25)
    full = oracle.generate(oracle.tokenizer.encode(other), 24, proposer="none").tokens
    at = next(i for i in range(2, len(full)) if full[i] not in full[:i] and full[i] not in oracle.eos_ids)
    for s in (server, batch_server):
        client = s.client()
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True, "proposer": "ngram"})
        assert r.choices[0].text == oracle.tokenizer.decode(past_eos) and r.usage.completion_tokens == 24
        assert r.choices[0].finish_reason == "length"
        for stream in (False, True):
            r = client.completions.create(model=MODEL, prompt=other, max_tokens=24, temperature=0, stream=stream,
                                          logprobs=0 if not stream else None,
                                          extra_body={"stop_token_ids": [full[at]], "proposer": "ngram"})
            choices = [c for chunk in r for c in chunk.choices] if stream else r.choices
            assert "".join(c.text for c in choices) == oracle.tokenizer.decode(full[:at])
            assert [c.finish_reason for c in choices if c.finish_reason] == ["stop"]
            if not stream:
                assert r.usage.completion_tokens == at + 1 and len(r.choices[0].logprobs.tokens) == at


def test_penalties_reach_the_runtime(server, batch_server, oracle):
    """OpenAI's presence/frequency penalties and logit_bias, and vLLM's repetition_penalty, give what the runtime's
    plain decode with them gives, through both engines and with prompt lookup."""
    prompt = words(3, 16)
    ids = oracle.tokenizer.encode(prompt)
    free = oracle.generate(ids, 24, proposer="none", min_new_tokens=24).tokens
    bias = {free[0]: -100.0, free[-1]: 2.0}
    penalties = dict(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.05, logit_bias=bias)
    want = oracle.tokenizer.decode(oracle.generate(ids, 24, proposer="none", min_new_tokens=24, **penalties).tokens)
    without_bias = dict(penalties, logit_bias=None)
    assert want != oracle.tokenizer.decode(oracle.generate(ids, 24, proposer="none", min_new_tokens=24,
                                                           **without_bias).tokens)
    assert want != oracle.tokenizer.decode(free)
    for s in (server, batch_server):
        r = s.client().completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                          presence_penalty=0.8, frequency_penalty=0.5,
                                          logit_bias={str(t): b for t, b in bias.items()},
                                          extra_body={"repetition_penalty": 1.05, "min_tokens": 24,
                                                      "proposer": "ngram"})
        assert r.choices[0].text == want


def test_malformed_json_and_bad_prompts_are_400s(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [5, 100000]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    with pytest.raises(APIStatusError) as e:  # the openai client raises its own typed errors
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t5"}],
                                                top_p=0)
    assert e.value.status_code == 400
    assert server.metrics()['specedge_requests_total{status="invalid"}'] >= 3


def test_models_health_and_metrics(server):
    """The counters move by what a request reports (usage and its specedge stats), whatever ran before."""
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.healthy()
    before = server.metrics()
    for name in ("specedge_completion_tokens_total", "specedge_draft_tokens_proposed_total", "specedge_queue_depth",
                 "specedge_tokens_per_second", "specedge_acceptance_ratio", "specedge_reused_prompt_tokens_total"):
        assert name in before
    r = server.client().completions.create(model=MODEL, prompt=words(3, 6) * 4, max_tokens=16, temperature=0,
                                           extra_body={"proposer": "ngram", "min_tokens": 16})
    stats = r.model_extra["specedge"]
    assert stats["proposed"] > 0  # a repeated prompt gives prompt lookup something to draft
    after = server.metrics()

    def moved(name):
        return after[name] - before[name]
    assert moved("specedge_completion_tokens_total") == r.usage.completion_tokens == 16
    assert moved("specedge_prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("specedge_draft_tokens_proposed_total") == stats["proposed"]
    assert moved("specedge_draft_tokens_accepted_total") == stats["accepted"]
    assert moved("specedge_rounds_total") == stats["rounds"]
    assert moved('specedge_requests_total{status="ok"}') == moved("specedge_requests_finished") == 1
    assert after["specedge_tokens_per_second"] > 0 and after["specedge_queue_depth"] == 0


# -- a slow device: rounds that take time, so that disconnects and full queues can be observed -----------------
@pytest.fixture
def slow_server(tiny_bundle):
    s = Server(tiny_bundle, proposer="none", gamma=4, max_tokens=100, max_queue=2)
    gen = s.engine.gen
    real = gen.stream

    def slow_stream(*args, **kwargs):
        for new in real(*args, **kwargs):
            time.sleep(0.05)
            yield new

    gen.stream = slow_stream
    yield s
    s.close()


def test_n_beyond_the_queue_is_refused_at_once(slow_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 2, "n": 3}
    r = httpx.post(slow_server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and "n = 3 is more than this server queues (2, --max-queue)" in r.json()["error"]["message"]
    r = httpx.post(slow_server.url + "/v1/chat/completions", json=dict(body, n=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_a_client_that_disconnects_mid_stream_frees_its_slot(slow_server, oracle):
    body = {"model": MODEL, "messages": [{"role": "user", "content": words(30, 20)}], "max_tokens": 100,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", slow_server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]  # a few chunks, then the client goes away
    assert any(line.startswith("data: ") for line in got)
    began = time.time()
    r = slow_server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t5 t6"}],
                                                     max_tokens=2, temperature=0)
    # The abandoned request had ~95 rounds of 50 ms left; its slot was freed within a round or two.
    assert time.time() - began < 2.0 and r.choices[0].message.content
    assert slow_server.metrics()['specedge_requests_total{status="cancelled"}'] == 1


def test_a_full_queue_answers_429_and_the_rest_complete(slow_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": words(31, 10)}], "max_tokens": 20,
            "temperature": 0}

    def post(_):
        return httpx.post(slow_server.url + "/v1/chat/completions", json=body, timeout=60)

    with ThreadPoolExecutor(5) as pool:
        statuses = sorted(r.status_code for r in pool.map(post, range(5)))
    assert statuses.count(200) >= 2 and set(statuses) <= {200, 429} and 429 in statuses
    assert slow_server.healthy()
    assert slow_server.metrics()['specedge_requests_total{status="rejected"}'] == statuses.count(429)


def test_an_internal_error_fails_only_its_request(server):
    gen = server.engine.gen
    real = gen.stream

    def broken(*args, **kwargs):
        gen.stream = real
        raise RuntimeError("simulated fault")
        yield

    gen.stream = broken
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "max_tokens": 3})
    assert r.status_code == 500 and "simulated fault" in r.json()["error"]["message"]
    assert server.healthy()
    ok = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t7"}],
                                                  max_tokens=3, temperature=0)
    assert ok.choices[0].message.content


def test_serve_refuses_a_bad_bundle_before_listening(tmp_path):
    from specedge.cli import main

    assert main(["serve", str(tmp_path / "missing")]) == 2


def test_a_server_with_an_output_history_drafts_from_earlier_completions(tiny_bundle, oracle):
    """--history-tokens: a second client asking what a first was answered gets the same greedy text, and
    prompt lookup drafted it from the first's completion (the prompt alone has little to find)."""
    from specedge.cli import main

    messages = [{"role": "user", "content": " ".join(f"t{i}" for i in range(200, 230))}]
    want = expected(oracle, chat_ids(oracle, messages), 24)
    accepted = {}
    for tokens in (0, 4096):
        # a fixed draft length: the adaptive one follows measured step times, and so would the accepted counts
        s = Server(tiny_bundle, history_tokens=tokens, proposer="ngram", gamma=8, max_tokens=24, max_queue=4,
                   adaptive=False)
        try:
            for _ in range(2):
                got = s.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
                assert got.choices[0].message.content == want
            accepted[tokens] = s.metrics()["specedge_draft_tokens_accepted_total"]
            history = s.engine.gen.output_history
            assert history is None if not tokens else len(history) == 2 * 24
        finally:
            s.close()
    assert accepted[4096] >= accepted[0] + 8, accepted  # measured 24 against 12
    assert main(["serve", tiny_bundle, "--history-tokens", "-1"]) == 2


@pytest.mark.parametrize("fixed", [False, True])
def test_serve_fixed_gamma_turns_adaptation_off(tiny_bundle, batch_server, monkeypatch, fixed):
    """`specedge serve --fixed-gamma` reaches the engine's config, and the engine hands it to both loops: the
    generator's (a batch-1 bundle) and the batch runner's (each admitted row)."""
    from specedge.cli import main
    from specedge.runtime.batch import BatchRunner
    from specedge.runtime.generator import Generator
    from specedge.serve import app

    configs = []
    monkeypatch.setattr(app, "serve_forever", lambda config, *a, **k: configs.append(config) or 0)
    assert main(["serve", tiny_bundle] + (["--fixed-gamma"] if fixed else [])) == 0
    assert [c.engine.adaptive for c in configs] == [not fixed]
    seen = []
    for cls, name in ((Generator, "stream"), (BatchRunner, "admit")):
        original = getattr(cls, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            seen.append((_name, kwargs["adaptive"]))
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, spy)
    messages = [{"role": "user", "content": "t1 t2 t1 t2 t1"}]
    s = Server(tiny_bundle, proposer="ngram", gamma=2, max_tokens=6, max_queue=4, adaptive=not fixed)
    try:
        s.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    finally:
        s.close()
    batch = Server(batch_server.config.bundle, proposer="ngram", gamma=4, max_tokens=6, max_queue=4,
                   adaptive=not fixed)
    try:
        batch.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    finally:
        batch.close()
    assert {n for n, _ in seen} == {"stream", "admit"} and all(adaptive is not fixed for _, adaptive in seen), seen


def test_serve_command_listens_where_it_says_and_stops_on_interrupt(tiny_bundle):
    """`specedge serve --port 0` takes a free port and announces it, listening already: a client that connects
    at once is served even when uvicorn's loop starts late (here 2 s after the announcement; in CI under load a
    client was refused when the socket was only bound). An interrupt (Ctrl-C) shuts it down: uvicorn finishes,
    then raises the signal again, which the CLI turns into its usual "interrupted" and status 130 (128 +
    SIGINT), not a traceback."""
    import signal

    late_start = ("import sys, time, uvicorn\nrun = uvicorn.Server.run\n"
                  "uvicorn.Server.run = lambda *a, **k: time.sleep(2) or run(*a, **k)\n"
                  "from specedge.cli import main\n"
                  f"sys.exit(main(['serve', {tiny_bundle!r}, '--port', '0', '--model-id', {MODEL!r},"
                  " '--threads', '1']))")
    # A child inherits an ignored SIGINT (a test process started in the background ignores it: then uvicorn's
    # re-raised signal is ignored too and the server exits 0): start it with the default, as a terminal would.
    proc = subprocess.Popen([sys.executable, "-c", late_start], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        url = re.search(r"on (http://127\.0\.0\.1:\d+)/v1 ", line)
        assert url and not url.group(1).endswith(":0"), line
        body = {"model": MODEL, "prompt": "t1 t2", "max_tokens": 3, "temperature": 0}
        r = httpx.post(url.group(1) + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        assert proc.stderr.read().strip() == "interrupted"
    finally:
        proc.kill()
        proc.wait()


def test_sampling_defaults_apply_to_requests_that_leave_the_field_out(tiny_bundle, oracle):
    """A server started greedy (temperature 0) with a repetition penalty answers a request without them (or with
    null) as the runtime does with them; a request's own values win."""
    srv = Server(tiny_bundle, sampling_defaults={"temperature": 0.0, "repetition_penalty": 1.3})
    try:
        client = srv.client()
        prompt = words(9, 24)
        ids = oracle.tokenizer.encode(prompt)
        want = oracle.tokenizer.decode(oracle.generate(ids, 16, proposer="none", repetition_penalty=1.3).tokens)
        assert want != expected(oracle, ids, 16)  # the penalty changes this output
        for extra in ({}, {"temperature": None, "repetition_penalty": None}):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, extra_body=extra)
            assert r.choices[0].text == want
        sampled = oracle.generate(ids, 16, proposer="none", temperature=1.0, seed=4, repetition_penalty=1.0).tokens
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=4,
                                      extra_body={"repetition_penalty": 1.0, "proposer": "none"})
        assert r.choices[0].text == oracle.tokenizer.decode(sampled) != want
    finally:
        srv.close()


def test_null_sampling_fields_take_the_defaults():
    """Each sampling field sent as null is read as left out (OpenAI's clients send null for "not given"): the
    server's default where it has one, else OpenAI's; not a 400."""
    from specedge.serve.protocol import SAMPLING_FIELDS, parse_request

    base = {"model": "m", "prompt": "x"}
    plain = parse_request(base, False, "m")
    nulls = parse_request({**base, **{name: None for name in SAMPLING_FIELDS}}, False, "m")
    for name in SAMPLING_FIELDS:
        assert getattr(nulls, name) == getattr(plain, name), name
    served = parse_request({**base, "top_k": None}, False, "m", defaults={"top_k": 7, "repetition_penalty": 1.2})
    assert (served.top_k, served.repetition_penalty) == (7, 1.2)


@pytest.mark.parametrize("flag, value, fragment", [("--temperature", "2.5", "--temperature: temperature must be"),
                                                   ("--top-p", "0", "--top-p: top_p must be in (0, 1]"),
                                                   ("--top-k", "-1", "--top-k: top_k must be a non-negative"),
                                                   ("--presence-penalty", "3", "--presence-penalty: presence_penalty"),
                                                   ("--replicas", "2", "--replicas 2 needs --ray")])
def test_serve_refuses_bad_defaults_and_options(tiny_bundle, flag, value, fragment):
    """Before loading anything (a server that took the value would listen until the timeout)."""
    r = subprocess.run([sys.executable, "-m", "specedge", "serve", tiny_bundle, "--port", "0", flag, value],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("port, ray, fragment", [(99999, False, "--port must be in 0..65535, not 99999"),
                                                 (None, False, "Address already in use"),
                                                 (0, True, "--port must be in 1..65535 with --ray, not 0"),
                                                 (None, True, "Address already in use")])
def test_serve_refuses_an_address_it_cannot_listen_on(tiny_bundle, capsys, port, ray, fragment):
    """One line and status 2, before anything announces that the server is serving (uvicorn itself logged the
    error after our "serving" line, and never returned for a port out of range), and with --ray before Ray
    starts (its proxy only logs an address it cannot take)."""
    import ray as ray_module

    from specedge.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = ["serve", tiny_bundle, "--port", str(taken.getsockname()[1] if port is None else port)]
        assert main(args + ["--ray"] * ray) == 2
    out, err = capsys.readouterr()
    assert fragment in err and "serving" not in out, (out, err)
    assert not ray_module.is_initialized()


@pytest.mark.slow  # starts a local Ray cluster (~20 s)
def test_ray_serve_with_two_replicas_on_loopback(tiny_bundle, oracle):
    from ray import serve

    from specedge.serve import ray_serve

    import ray

    # Ray first, then the port: its processes take ephemeral ports as they start, and once took the one a
    # free_port() had just chosen ("Failed to bind to address" in CI). The port also comes from below Linux's
    # ephemeral range and above Ray's worker ports (10002-19999), where none of its processes binds.
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port(range(20000, 32000))
    config = ServerConfig(tiny_bundle, threads=1, engine=EngineConfig(proposer="ngram", gamma=4, max_tokens=16),
                          model_id=MODEL)
    ray_serve.start(config, "127.0.0.1", port, replicas=2)
    try:
        status = serve.status().applications["specedge"].deployments["specedge"]
        assert status.replica_states.get("RUNNING") == 2
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        prompts = [[{"role": "user", "content": words(40 + i, 15 + i)}] for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda m: client.chat.completions.create(model=MODEL, messages=m, max_tokens=16,
                                                                         temperature=0).choices[0].message.content,
                                prompts))
        assert got == [expected(oracle, chat_ids(oracle, m), 16) for m in prompts]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "other", "messages": []})
        assert r.status_code == 404
        assert json.loads(httpx.get(f"http://127.0.0.1:{port}/health").text) == {"status": "ok"}
    finally:
        ray_serve.stop()


def test_loadtest_against_the_server_loses_nothing(server, tmp_path):
    from specedge.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(item) for item in (
        {"messages": [{"role": "user", "content": words(50, 30)}]}, {"prompt": words(51, 20)})) + "\n")
    out = tmp_path / "report.json"
    assert main(["loadtest", server.url, "--concurrency", "4", "--requests", "10", "--prompts", str(prompts),
                 "--max-tokens", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["succeeded"] == 10 and report["failed"] == 0 and report["lost"] == 0
    assert not report["tokens_estimated"] and report["completion_tokens"] > 0
    assert report["ttft_ms"]["p50"] <= report["latency_ms"]["p50"]


# -- a batch bundle: continuous batching ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def batch_server(tiny_models, tmp_path_factory):
    from conftest import CHUNK

    from specedge.export.bundle import ExportOptions, export_bundle

    bundle = str(tmp_path_factory.mktemp("serve_batch") / "tiny-b4")
    export_bundle(tiny_models["llama"][0], bundle, ExportOptions(context=128, prefill_chunk=CHUNK, batch=4,
                                                                 gammas=(4, 8)), progress=False)
    s = Server(bundle, proposer="ngram", gamma=4, max_tokens=24, max_queue=16)
    yield s
    s.close()


def test_batch_server_runs_concurrent_requests_together_and_exactly(batch_server, oracle):
    """8 concurrent requests on a batch-4 bundle: up to 4 share each verify step, rows join as others
    leave, and every greedy output equals plain batch-1 decode of the same model."""
    from specedge.serve.engine import BatchEngine

    assert isinstance(batch_server.engine, BatchEngine)
    prompts = [[{"role": "user", "content": words(60 + i, 15 + 9 * i)}] for i in range(8)]
    want = [expected(oracle, chat_ids(oracle, m), 24) for m in prompts]
    runner = batch_server.engine.gen.runner
    busiest = []
    real = runner.decode_step

    def counting_step():
        busiest.append(len([b for b in runner.active if not runner.rows[b].prefill]))
        return real()

    runner.decode_step = counting_step
    try:
        def ask(i):
            kw = dict(model=MODEL, messages=prompts[i], max_tokens=24, temperature=0,
                      extra_body={"proposer": ("none", "ngram")[i % 2]})
            client = batch_server.client()
            if i % 3 == 0:
                return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                               if c.choices)
            return client.chat.completions.create(**kw).choices[0].message.content

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, range(8)))
    finally:
        del runner.decode_step
    assert got == want
    assert max(busiest) > 1  # rows really shared verify steps


def test_batch_server_follow_up_reuses_its_row_and_stays_exact(batch_server, oracle):
    client = batch_server.client()
    history = [{"role": "user", "content": words(70, 50)}]
    r1 = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16, temperature=0)
    history += [{"role": "assistant", "content": r1.choices[0].message.content},
                {"role": "user", "content": words(71, 8)}]
    r2 = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16, temperature=0)
    assert r2.choices[0].message.content == expected(oracle, chat_ids(oracle, history), 16)
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(chat_ids(oracle, history[:1])) - 1
    r = httpx.post(batch_server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": "t5"}], "proposer": "draft"})
    assert r.status_code == 400 and "needs a bundle with a draft model" in r.json()["error"]["message"]


def test_batch_server_disconnect_frees_the_row(batch_server):
    runner = batch_server.engine.gen.runner
    real = runner.decode_step

    def slow_step():
        time.sleep(0.03)
        return real()

    runner.decode_step = slow_step
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": words(80, 20)}], "max_tokens": 100,
                "temperature": 0, "stream": True, "proposer": "none"}
        before = batch_server.metrics()['specedge_requests_total{status="cancelled"}']
        with httpx.stream("POST", batch_server.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            [next(lines) for _ in range(3)]
        deadline = time.time() + 5
        while batch_server.metrics()['specedge_requests_total{status="cancelled"}'] == before:
            assert time.time() < deadline, "the abandoned request kept its row"
            time.sleep(0.05)
        assert all(row is None for row in runner.rows) or len(runner.active) == 0
    finally:
        del runner.decode_step


def row_step_sessions(runner) -> set[tuple[int, int]]:
    return {(tokens, context) for role, tokens, context in runner.target._row_steps if role == C.STEP}


def test_batch_server_makes_lone_row_sessions_at_start_unless_lazy(batch_server, oracle):
    """A request alone on a batch bundle decodes through the batch-1 row step graphs (bundle format 4). A server
    makes their sessions at start, so no request waits while one is made; with lazy_row_steps the first request
    to need each one makes it."""
    runner = batch_server.engine.gen.runner
    every = {(t, c) for t in runner.target.row_step_sizes for c in runner.target.entry.buckets()}
    assert {1, 5} <= set(runner.target.row_step_sizes)  # and 9 once a request has asked for gamma 8
    assert row_step_sessions(runner) == every
    lazy = Server(batch_server.config.bundle, proposer="ngram", gamma=4, max_tokens=24, lazy_row_steps=True)
    try:
        assert row_step_sessions(lazy.engine.gen.runner) == set()
        messages = [{"role": "user", "content": words(90, 30)}]
        want = expected(oracle, chat_ids(oracle, messages), 24)
        for s in (batch_server, lazy):
            made = s.engine.gen.target.sessions
            r = s.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
            assert r.choices[0].message.content == want
            if s is batch_server:
                assert s.engine.gen.target.sessions == made  # nothing made in the request
            else:
                assert row_step_sessions(s.engine.gen.runner)  # the lone request made the ones it used
    finally:
        lazy.close()
