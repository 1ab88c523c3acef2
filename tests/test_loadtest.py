"""specedge loadtest against a fake OpenAI-compatible server on a real loopback socket.

The fake server's behaviour is chosen by the prompt itself (a JSON "plan" in the user message or prompt
text), so one server serves every test: how many tokens, the delay before the first and between the
others, whether to send usage, and failures (an HTTP status, a stream that stops before [DONE], a
connection dropped mid-stream). It records the most requests it ever had in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from specedge.errors import GenerationError, exit_status  # noqa: E402
from specedge.tools import loadtest  # noqa: E402
from specedge.tools.loadtest import load_prompts, run_loadtest_sync  # noqa: E402

MODEL = "fake-model"


class Recorder:
    """What the fake server saw; reset by each test."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.models_calls = 0


def _plan(body: dict) -> dict:
    text = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
    return json.loads(text)


def _event(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(rec: Recorder) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        rec.models_calls += 1
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}, {"id": "other", "object": "model"}]}

    async def completion(request: Request, chat: bool):
        body = await request.json()
        rec.bodies.append(body)
        rec.paths.append(request.url.path)
        plan = _plan(body)
        if "status" in plan:
            return JSONResponse({"error": {"message": plan["message"], "type": "x", "code": plan["status"]}},
                                status_code=plan["status"])
        rec.in_flight += 1
        rec.max_in_flight = max(rec.max_in_flight, rec.in_flight)

        per_chunk = plan.get("per_chunk", 1)  # several tokens per chunk, as a speculative server commits them

        def piece(i: int) -> dict:
            text = "".join(f"t{i}.{k} " for k in range(per_chunk))
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            return {"id": "x", "model": body["model"], "choices": [choice]}

        async def stream():
            try:
                yield _event({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant"}}]} if chat
                             else {"id": "x", "choices": [{"index": 0, "text": ""}]})  # no text: not the TTFT
                await asyncio.sleep(plan.get("first_delay", 0.0))
                for i in range(plan["tokens"] // per_chunk):
                    if i:
                        await asyncio.sleep(plan.get("gap", 0.0))
                    if plan.get("abort_after") == i:
                        raise RuntimeError("fake server drops the connection")
                    yield _event(piece(i))
                if plan.get("cut"):
                    return
                if plan.get("usage", True):
                    yield _event({"id": "x", "choices": [], "usage": {"prompt_tokens": 3,
                                  "completion_tokens": plan["tokens"], "total_tokens": 3 + plan["tokens"]}})
            finally:
                rec.in_flight -= 1  # before [DONE]: the client may start its next request right after it
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await completion(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    return app


@pytest.fixture(scope="module")
def server():
    """(url, recorder): uvicorn in a background thread on a loopback port chosen by the OS."""
    rec = Recorder()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(rec), log_level="critical", timeout_graceful_shutdown=1)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", rec
    srv.should_exit = True
    thread.join(5)
    sock.close()


@pytest.fixture
def fake(server):
    url, rec = server
    rec.reset()
    return url, rec


def chat_line(**plan) -> dict:
    return {"id": "p", "kind": "test", "messages": [{"role": "user", "content": json.dumps(plan)}]}


def write_jsonl(path, items) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return str(path)


def test_timing_tokens_and_bounded_concurrency(fake, tmp_path):
    url, rec = fake
    first, gap, tokens = 0.08, 0.01, 6  # 3 chunks of 2 tokens: usage, not chunks, counts tokens
    prompts = write_jsonl(tmp_path / "p.jsonl", [chat_line(tokens=tokens, first_delay=first, gap=gap, per_chunk=2)])
    report = run_loadtest_sync(url, prompts, concurrency=3, requests=9, max_tokens=tokens)
    assert (report.requests, report.succeeded, report.failed, report.lost) == (9, 9, 0, 0), report.summary()
    assert report.failures == {}
    assert rec.max_in_flight == 3
    assert rec.models_calls == 1 and report.model == MODEL
    assert all(b["model"] == MODEL and b["stream"] and b["stream_options"] == {"include_usage": True}
               and b["max_tokens"] == tokens and b["temperature"] == 0.0 and "min_tokens" not in b for b in rec.bodies)
    assert len(rec.bodies) == 9 and set(rec.paths) == {"/v1/chat/completions"}
    for r in report.results:
        assert r.ok and r.status == 200
        assert r.completion_tokens == tokens and not r.tokens_estimated
        assert first <= r.ttft_s < first + 2.0
        assert first + 2 * gap <= r.latency_s < first + 3.0
        assert r.ttft_s < r.latency_s and r.content_chunks == 3
        # per token after the first: content time over 5 tokens. The fake sleeps 2 gaps of 10 ms between the
        # chunks, but a late first chunk on a busy machine shortens the span (3.5 ms per token measured once,
        # against 4 ms): the bound allows half of it.
        assert r.itl_s == pytest.approx((r.last_content_s - r.ttft_s) / (tokens - 1))
        assert gap / (tokens - 1) <= r.itl_s < 1.0
    assert report.completion_tokens == 9 * tokens
    assert report.tokens_per_s == pytest.approx(report.completion_tokens / report.wall_s)
    # 9 requests of >= 0.1 s each, 3 at a time: at least 3 rounds
    assert report.wall_s >= 3 * (first + 2 * gap)
    assert first * 1000 <= report.ttft_ms["p50"] <= report.ttft_ms["p90"] <= report.ttft_ms["p99"]
    assert report.latency_ms["p50"] >= report.ttft_ms["p50"]
    text = report.summary()
    assert "9 succeeded, 0 failed, 0 lost" in text and "TTFT ms" in text


def test_concurrency_above_requests_and_explicit_model(fake, tmp_path):
    url, rec = fake
    prompts = write_jsonl(tmp_path / "p.jsonl", [chat_line(tokens=2, first_delay=0.05)])
    report = run_loadtest_sync(url + "/v1/", prompts, concurrency=8, requests=4, model="mine", max_tokens=2,
                               min_tokens=2)
    assert (report.succeeded, report.lost) == (4, 0)
    assert rec.max_in_flight == 4 and rec.models_calls == 0
    assert {b["model"] for b in rec.bodies} == {"mine"} and {b["min_tokens"] for b in rec.bodies} == {2}


def test_completions_endpoint_prompts_cycle_and_estimated_tokens(fake, tmp_path):
    url, rec = fake
    items = [{"prompt": json.dumps({"tokens": 4, "usage": False})}, chat_line(tokens=3)]
    prompts = write_jsonl(tmp_path / "p.jsonl", items)
    report = run_loadtest_sync(url, prompts, concurrency=1, requests=5, temperature=0.7)
    assert (report.succeeded, report.failed, report.lost) == (5, 0, 0)
    assert rec.paths == ["/v1/completions", "/v1/chat/completions"] * 2 + ["/v1/completions"]
    assert rec.bodies[0]["prompt"] == items[0]["prompt"] and rec.bodies[0]["temperature"] == 0.7
    by_index = {r.index: r for r in report.results}
    assert by_index[0].completion_tokens == 4 and by_index[0].tokens_estimated  # counted from content chunks
    assert by_index[1].completion_tokens == 3 and not by_index[1].tokens_estimated
    assert report.tokens_estimated and "estimated" in report.summary()
    assert report.completion_tokens == 3 * 4 + 2 * 3


def test_errors_are_counted_by_kind_and_none_lost(fake, tmp_path):
    url, _ = fake
    items = [chat_line(tokens=3),
             chat_line(status=500, message="internal boom"),
             chat_line(status=429, message="queue full"),
             chat_line(tokens=5, cut=True),           # stream ends cleanly, but without [DONE]
             chat_line(tokens=5, abort_after=2)]      # connection dropped mid-stream
    prompts = write_jsonl(tmp_path / "p.jsonl", items)
    report = run_loadtest_sync(url, prompts, concurrency=4, requests=10, model=MODEL)
    assert (report.requests, report.succeeded, report.failed, report.lost) == (10, 2, 8, 0), report.summary()
    assert report.failures == {"http 500": 2, "http 429": 2, "truncated": 4}
    assert report.failure_examples["http 500"] == "internal boom"
    assert report.failure_examples["http 429"] == "queue full"
    by_index = {r.index: r for r in report.results}
    assert by_index[1].status == 500 and by_index[2].status == 429 and not by_index[1].ok
    assert "[DONE]" in by_index[3].error and by_index[3].error_kind == "truncated"
    assert by_index[4].error_kind == "truncated"
    assert report.completion_tokens == 2 * 3  # failed requests add no tokens
    text = report.summary()
    assert "http 500 x2: internal boom" in text and "truncated x4" in text


def test_timeout_and_connection_refused(fake, tmp_path):
    url, _ = fake
    prompts = write_jsonl(tmp_path / "p.jsonl", [chat_line(tokens=2, first_delay=5.0)])
    t0 = time.perf_counter()
    report = run_loadtest_sync(url, prompts, concurrency=2, requests=2, model=MODEL, timeout=0.3)
    assert time.perf_counter() - t0 < 3.0
    assert report.failures == {"timeout": 2} and report.lost == 0

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        report = run_loadtest_sync(dead, prompts, concurrency=2, requests=3, model=MODEL, timeout=5)
        assert report.failures == {"connect": 3} and report.lost == 0 and report.succeeded == 0
        with pytest.raises(GenerationError, match="/v1/models"):
            run_loadtest_sync(dead, prompts, concurrency=1, requests=1)


@pytest.mark.parametrize("content, match", [
    (None, "cannot read --prompts"),
    ("", "holds no prompts"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n', r"p\.jsonl:2 is not a JSON object"),
    ('[1, 2]\n', r"p\.jsonl:1 is not a JSON object"),
    ('{"prompt_ids": [1, 2, 3]}\n', r"p\.jsonl:1 needs a 'messages' or 'prompt' field"),
    ('{"messages": "hi"}\n', "'messages' must be a non-empty list"),
    ('{"prompt": 5}\n', "'prompt' must be a string"),
])
def test_bad_prompts_file_is_one_clear_error(tmp_path, content, match):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(GenerationError, match=match):
        load_prompts(str(path))
    # and before any request: the URL is never contacted
    with pytest.raises(GenerationError, match=match):
        run_loadtest_sync("http://127.0.0.1:9", str(path), concurrency=1, requests=1, model="m")


def test_prompt_file_fields_and_bad_arguments(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "kind": "k", "messages": [{"role": "user", "content": "x"}],
                                               "prompt": "ignored"}, {"prompt": "y", "extra": 1}])
    a, b = load_prompts(path)
    assert a.chat and a.messages[0]["content"] == "x" and not b.chat and b.text == "y"
    for kwargs, match in [(dict(concurrency=0, requests=1), "concurrency"),
                          (dict(concurrency=1, requests=0), "requests"),
                          (dict(concurrency=1, requests=1, max_tokens=0), "max_tokens"),
                          (dict(concurrency=1, requests=1, max_tokens=4, min_tokens=5), "min_tokens"),
                          (dict(concurrency=1, requests=1, min_tokens=-1), "min_tokens"),
                          (dict(concurrency=1, requests=1, min_tokens=2.5), "min_tokens"),
                          (dict(concurrency=1, requests=1, timeout=0), "timeout")]:
        with pytest.raises(GenerationError, match=match):
            run_loadtest_sync("http://127.0.0.1:9", path, model="m", **kwargs)
    with pytest.raises(GenerationError, match="http://"):
        run_loadtest_sync("127.0.0.1:9", path, concurrency=1, requests=1, model="m")


def test_lost_is_sent_minus_results():
    from specedge.tools.loadtest import LoadReport, RequestResult

    done = RequestResult(index=0, ok=True, status=200, ttft_s=0.01, latency_s=0.02, completion_tokens=1)
    failed = RequestResult(index=1, latency_s=0.5).fail("timeout", "slow")
    report = LoadReport.build("u", "m", 2, 8, sent=3, results=[failed, done], wall_s=1.0)
    assert (report.requests, report.succeeded, report.failed, report.lost) == (3, 1, 1, 1)
    assert [r.index for r in report.results] == [0, 1] and report.failures == {"timeout": 1}
    assert report.ttft_ms["p50"] == pytest.approx(10.0) and report.itl_ms_mean is None


def _cli(argv):
    parser = argparse.ArgumentParser(prog="specedge")
    loadtest.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return exit_status(args.command, lambda: loadtest.run(args))


def test_cli_prints_summary_writes_json_and_exit_status(fake, tmp_path, capsys):
    url, rec = fake
    good = write_jsonl(tmp_path / "good.jsonl", [chat_line(tokens=3)])
    out = tmp_path / "report.json"
    assert _cli(["loadtest", url, "--concurrency", "2", "--requests", "4", "--prompts", good,
                 "--max-tokens", "3", "--min-tokens", "3", "--json", str(out)]) == 0
    assert [b["min_tokens"] for b in rec.bodies] == [3] * 4
    assert "4 succeeded, 0 failed, 0 lost" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["succeeded"] == 4 and data["lost"] == 0 and data["completion_tokens"] == 12
    assert len(data["results"]) == 4 and data["results"][0]["ttft_s"] > 0 and data["model"] == MODEL

    bad = write_jsonl(tmp_path / "bad.jsonl", [chat_line(status=503, message="busy")])
    assert _cli(["loadtest", url, "--concurrency", "1", "--requests", "2", "--prompts", bad]) == 1
    assert "http 503 x2: busy" in capsys.readouterr().out

    assert _cli(["loadtest", url, "--concurrency", "1", "--requests", "1", "--prompts",
                 str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specedge loadtest: error: cannot read --prompts") and len(err.strip().splitlines()) == 1

    served = len(rec.bodies)
    assert _cli(["loadtest", url, "--concurrency", "1", "--requests", "2", "--prompts", good,
                 "--json", str(tmp_path / "missing" / "r.json")]) == 2
    assert "missing is missing or not writable" in capsys.readouterr().err
    assert len(rec.bodies) == served  # refused before any request, not after the run
