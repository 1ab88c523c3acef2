"""`specedge loadtest`: drive any OpenAI-compatible server (ours, vLLM, llama.cpp's server) with concurrent
streaming requests and report throughput, TTFT, latency and errors.

It speaks plain HTTP + server-sent events through httpx rather than the openai client, so that it measures
what a client sees on the wire (the first content byte, the end of the stream) and so that a server that
breaks the protocol is counted as an error instead of being papered over by a client library's retries.

Every request sent ends as exactly one result, succeeded or failed with a kind ("http 500", "timeout",
"connect", "truncated", ...); `lost` (sent minus results) is reported anyway because a load tester that can
drop requests silently cannot be trusted to say a server dropped none.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from specedge.errors import GenerationError
from specedge.tools import writable_folder_of

DEFAULT_TIMEOUT_S = 300.0


def _httpx():
    """httpx, imported only when a load test runs (so `specedge --help` needs no HTTP client); some
    environments ship its API-compatible fork `httpx2` instead."""
    try:
        import httpx
    except ImportError:
        try:
            import httpx2 as httpx
        except ImportError:
            raise GenerationError("specedge loadtest needs httpx: pip install httpx") from None
    return httpx


# --- prompts ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    """One request body's varying part: chat messages go to /v1/chat/completions, text to /v1/completions."""
    messages: list | None = None
    text: str | None = None

    @property
    def chat(self) -> bool:
        return self.messages is not None


def _parse_prompt(item: Any, where: str) -> Prompt:
    if not isinstance(item, dict):
        raise GenerationError(f"{where} is not a JSON object")
    if "messages" in item:
        messages = item["messages"]
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise GenerationError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return Prompt(messages=messages)
    if "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise GenerationError(f"{where}: 'prompt' must be a string")
        return Prompt(text=item["prompt"])
    raise GenerationError(f"{where} needs a 'messages' or 'prompt' field (token ids are not sent to a server)")


def load_prompts(source: str | os.PathLike | Iterable[dict]) -> list[Prompt]:
    """Read prompts in the format of `specedge generate --prompts` (one JSON object per line with "messages"
    or "prompt"; other fields such as id or kind are ignored), or take already-parsed objects. Checked before
    any request goes out, so a typo in line 40 does not surface as 40 failed requests."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            with open(path) as f:
                lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise GenerationError(f"cannot read --prompts {path}: {getattr(e, 'strerror', None) or e}") from None
        items = []
        for i, line in lines:
            try:
                items.append((f"{path}:{i}", json.loads(line)))
            except ValueError:
                raise GenerationError(f"{path}:{i} is not a JSON object") from None
        if not items:
            raise GenerationError(f"--prompts {path} holds no prompts")
    else:
        items = [(f"prompt {i}", item) for i, item in enumerate(source)]
        if not items:
            raise GenerationError("no prompts given")
    return [_parse_prompt(item, where) for where, item in items]


# --- one request -------------------------------------------------------------------------------------------

@dataclass
class RequestResult:
    """What one request did, timed from just before it was sent. Times are seconds; None where the request
    never got that far (no TTFT for a stream that carried no text)."""
    index: int
    ok: bool = False
    status: int | None = None
    error_kind: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    last_content_s: float | None = None
    completion_tokens: int = 0
    tokens_estimated: bool = False
    content_chunks: int = 0

    def fail(self, kind: str, message: str) -> "RequestResult":
        self.ok, self.error_kind, self.error = False, kind, message
        return self

    @property
    def itl_s(self) -> float | None:
        """Mean time between tokens after the first, from the first and last content chunks: a server that
        commits several tokens per chunk (speculative decoding does) is measured per token, not per chunk."""
        if self.ttft_s is None or self.last_content_s is None or self.completion_tokens < 2:
            return None
        return (self.last_content_s - self.ttft_s) / (self.completion_tokens - 1)


def normalize_url(url: str) -> str:
    """The server's root, so that both http://host:8000 and http://host:8000/v1 (what openai's base_url
    wants) work."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise GenerationError(f"URL must start with http:// or https://, got {url!r}")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _request_body(prompt: Prompt, model: str, max_tokens: int, temperature: float, min_tokens: int = 0) -> dict:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if min_tokens:  # vLLM's extension of the OpenAI API, which specedge serve takes too: stop ids held back
        body["min_tokens"] = min_tokens
    if prompt.chat:
        body["messages"] = prompt.messages
    else:
        body["prompt"] = prompt.text
    return body


def _error_message(body: bytes) -> str:
    """The server's own words from an error response: OpenAI's {"error": {"message"}}, FastAPI's
    {"detail"}, or the start of the raw body."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:200] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("error", "detail", "message"):
            if data.get(key):
                return str(data[key])
    return text[:200]


async def _sse_data(response):
    """Yield the data of each server-sent event: consecutive "data:" lines joined by newlines, dispatched at
    a blank line (or at the end of the stream); comments and other fields are skipped."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _chunk_text(chunk: dict, chat: bool) -> str:
    parts = []
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if isinstance(text, str):
            parts.append(text)
    return "".join(parts)


async def _read_stream(response, result: RequestResult, chat: bool, start: float) -> RequestResult:
    """Consume one streamed completion, stamping TTFT at the first chunk that carries text. Succeeds only on
    "data: [DONE]": a stream that just stops is a server that died or cut the answer."""
    usage_tokens = None
    async for data in _sse_data(response):
        if data.strip() == "[DONE]":
            result.ok = True
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            return result.fail("bad event", f"event is not JSON: {data[:100]!r}")
        if not isinstance(chunk, dict):
            return result.fail("bad event", f"event is not a JSON object: {data[:100]!r}")
        if chunk.get("error"):
            return result.fail("stream error", _error_message(json.dumps(chunk).encode()))
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            usage_tokens = usage["completion_tokens"]
        if _chunk_text(chunk, chat):
            now = time.perf_counter() - start
            if result.ttft_s is None:
                result.ttft_s = now
            result.last_content_s = now
            result.content_chunks += 1
    if not result.ok:
        return result.fail("truncated", f"stream ended without data: [DONE] after {result.content_chunks} "
                           "content chunks")
    if usage_tokens is None:
        result.completion_tokens, result.tokens_estimated = result.content_chunks, True
    else:
        result.completion_tokens = usage_tokens
    return result


async def _send(client, url: str, body: dict, result: RequestResult, chat: bool, start: float):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", url + path, json=body) as response:
        result.status = response.status_code
        if not 200 <= response.status_code < 300:
            message = _error_message(await response.aread())
            return result.fail(f"http {response.status_code}", message)
        return await _read_stream(response, result, chat, start)


async def _one_request(client, url: str, index: int, prompt: Prompt, model: str, max_tokens: int,
                       temperature: float, timeout: float, min_tokens: int = 0) -> RequestResult:
    """Send one request and classify whatever happens into a result: this never raises (except on
    cancellation), which is what keeps `lost` at zero."""
    httpx = _httpx()
    result = RequestResult(index=index)
    body = _request_body(prompt, model, max_tokens, temperature, min_tokens)
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_send(client, url, body, result, prompt.chat, start), timeout)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        result.fail("timeout", f"no complete answer within {timeout:g} s")
    except httpx.ConnectError as e:
        result.fail("connect", str(e) or type(e).__name__)
    except httpx.RemoteProtocolError as e:
        result.fail("truncated", f"connection closed mid-response: {e}")
    except httpx.HTTPError as e:
        result.fail("transport", f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001 -- counted and shown, never silently lost
        result.fail("client", f"{type(e).__name__}: {e}")
    result.latency_s = time.perf_counter() - start
    return result


# --- the run -----------------------------------------------------------------------------------------------

def _percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99/mean with linear interpolation between order statistics (numpy's default), in ms."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    xs = sorted(v * scale for v in values)

    def q(p: float) -> float:
        pos = (len(xs) - 1) * p
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": sum(xs) / len(xs)}


@dataclass
class LoadReport:
    """A finished load test. Throughput and timing figures cover succeeded requests only; failures are
    counted by kind with one example message each."""
    url: str
    model: str
    concurrency: int
    max_tokens: int
    requests: int
    succeeded: int
    failed: int
    lost: int
    wall_s: float
    completion_tokens: int
    tokens_estimated: bool
    tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict
    latency_ms: dict
    itl_ms_mean: float | None
    failures: dict = field(default_factory=dict)
    failure_examples: dict = field(default_factory=dict)
    results: list = field(default_factory=list, repr=False)

    @classmethod
    def build(cls, url: str, model: str, concurrency: int, max_tokens: int, sent: int,
              results: list[RequestResult], wall_s: float) -> "LoadReport":
        good = [r for r in results if r.ok]
        bad = [r for r in results if not r.ok]
        failures: dict[str, int] = {}
        examples: dict[str, str] = {}
        for r in bad:
            failures[r.error_kind] = failures.get(r.error_kind, 0) + 1
            examples.setdefault(r.error_kind, r.error)
        tokens = sum(r.completion_tokens for r in good)
        itls = [r.itl_s for r in good if r.itl_s is not None]
        return cls(url=url, model=model, concurrency=concurrency, max_tokens=max_tokens, requests=sent,
                   succeeded=len(good), failed=len(bad), lost=sent - len(results), wall_s=wall_s,
                   completion_tokens=tokens, tokens_estimated=any(r.tokens_estimated for r in good),
                   tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
                   requests_per_s=len(good) / wall_s if wall_s > 0 else 0.0,
                   ttft_ms=_percentiles([r.ttft_s for r in good if r.ttft_s is not None]),
                   latency_ms=_percentiles([r.latency_s for r in good]),
                   itl_ms_mean=sum(itls) / len(itls) * 1000 if itls else None,
                   failures=failures, failure_examples=examples, results=sorted(results, key=lambda r: r.index))

    def to_json(self, per_request: bool = True) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "results"}
        if per_request:
            out["results"] = [dict(asdict(r), itl_s=r.itl_s) for r in self.results]
        return out

    def summary(self) -> str:
        est = " (estimated from content chunks: the server sent no usage)" if self.tokens_estimated else ""
        lines = [
            f"{self.url}  model {self.model}  concurrency {self.concurrency}  max_tokens {self.max_tokens}",
            f"requests {self.requests}: {self.succeeded} succeeded, {self.failed} failed, {self.lost} lost "
            f"in {self.wall_s:.2f} s",
            f"throughput {self.tokens_per_s:.1f} completion tokens/s ({self.completion_tokens} tokens{est}), "
            f"{self.requests_per_s:.2f} requests/s",
            f"{'':12}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}",
        ]
        for name, stats in (("TTFT ms", self.ttft_ms), ("latency ms", self.latency_ms)):
            lines.append(f"{name:12}" + "".join(_ms(stats[k]) for k in ("p50", "p90", "p99", "mean")))
        itl = "-" if self.itl_ms_mean is None else f"{self.itl_ms_mean:.2f}"
        lines.append(f"inter-token latency {itl} ms (per token after the first, mean over requests)")
        for kind, count in sorted(self.failures.items()):
            lines.append(f"failed: {kind} x{count}: {self.failure_examples[kind]}")
        return "\n".join(lines)


def _ms(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value:10.1f}"


async def discover_model(client, url: str) -> str:
    """The id a request names when the user gave none: the first that GET /v1/models lists (the only one
    for our server and llama.cpp's)."""
    httpx = _httpx()
    try:
        response = await client.get(url + "/v1/models")
    except httpx.HTTPError as e:
        raise GenerationError(f"cannot reach {url}/v1/models: {type(e).__name__}: {e}") from None
    if response.status_code != 200:
        raise GenerationError(f"{url}/v1/models answered {response.status_code}: "
                              f"{_error_message(response.content)}; pass --model")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise GenerationError(f"{url}/v1/models lists no model id; pass --model") from None


def _check_args(concurrency: int, requests: int, max_tokens: int, timeout: float, min_tokens: int = 0) -> None:
    for name, value in (("concurrency", concurrency), ("requests", requests), ("max_tokens", max_tokens)):
        if not isinstance(value, int) or value < 1:
            raise GenerationError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or not 0 <= min_tokens <= max_tokens:
        raise GenerationError(f"min_tokens must be an integer in 0..max_tokens ({max_tokens}), got {min_tokens!r}")
    if not timeout > 0:
        raise GenerationError(f"timeout must be positive, got {timeout!r}")


async def run_loadtest(url: str, prompts, concurrency: int, requests: int, max_tokens: int = 128,
                       model: str | None = None, temperature: float = 0.0,
                       timeout: float = DEFAULT_TIMEOUT_S, min_tokens: int = 0) -> LoadReport:
    """Send exactly `requests` streaming requests, cycling through `prompts` (a JSONL path or parsed
    objects), with at most `concurrency` in flight: C workers each take the next index until none is left,
    so the server sees a closed loop of C clients (no pile-up beyond C even when it is slow). `timeout` is a
    per-request deadline on the whole answer, not on each read. `min_tokens` > 0 asks the server to hold EOS
    back until that many tokens (vLLM's and specedge serve's `min_tokens`): with min_tokens = max_tokens every
    request is exactly max_tokens long, so runs of different servers do the same work."""
    _check_args(concurrency, requests, max_tokens, timeout, min_tokens)
    prompt_list = load_prompts(prompts)
    url = normalize_url(url)
    httpx = _httpx()
    workers = min(concurrency, requests)
    limits = httpx.Limits(max_connections=workers + 1, max_keepalive_connections=workers + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        if model is None:
            model = await discover_model(client, url)
        next_index = iter(range(requests))
        results: list[RequestResult] = []
        sent = 0

        async def worker() -> None:
            nonlocal sent
            for i in next_index:
                sent += 1
                results.append(await _one_request(client, url, i, prompt_list[i % len(prompt_list)], model,
                                                  max_tokens, temperature, timeout, min_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workers)))
        wall = time.perf_counter() - start
    return LoadReport.build(url, model, concurrency, max_tokens, sent, results, wall)


def run_loadtest_sync(*args, **kwargs) -> LoadReport:
    """run_loadtest for callers without an event loop (scripts, notebooks without one running)."""
    return asyncio.run(run_loadtest(*args, **kwargs))


# --- command line ------------------------------------------------------------------------------------------

def add_parser(sub) -> None:
    """Register `specedge loadtest` on an argparse subparsers object."""
    p = sub.add_parser(
        "loadtest", help="load-test an OpenAI-compatible server: throughput, TTFT/latency percentiles, errors",
        description="Send N streaming requests to an OpenAI-compatible server (specedge serve, vLLM, llama.cpp's "
        "server, ...) with at most C in flight, cycling through the prompts of a JSONL file, and report "
        "aggregate completion tokens/s, requests/s, TTFT and latency p50/p90/p99/mean, the mean inter-token "
        "latency and every failure by kind (HTTP status, timeout, connection, stream cut before [DONE]). "
        "Exit 0 only when every request succeeded.")
    p.add_argument("url", metavar="URL", help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--concurrency", type=int, required=True, metavar="C", help="requests in flight at once")
    p.add_argument("--requests", type=int, required=True, metavar="N", help="requests to send in all")
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl",
                   help="one JSON object per line, as for `specedge generate --prompts`: {\"messages\": [...]} "
                   "goes to /v1/chat/completions, {\"prompt\": text} to /v1/completions; other fields are "
                   "ignored (the repo's suite: tools/prompts/suite.jsonl)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="ask the server to hold EOS back until N tokens (the min_tokens field of vLLM and specedge "
                   "serve; default 0: not sent)")
    p.add_argument("--model", metavar="ID", help="model id to request (default: the first of GET /v1/models)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds one request may take from send to the end of its stream before it counts as "
                   f"failed (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--json", metavar="OUT", help="also write the report and every request's result as JSON")


def run(args) -> int:
    """`specedge loadtest`: print the summary, write --json; exit 1 when any request failed or was lost."""
    folder = writable_folder_of(args.json) if args.json else None
    if folder:  # before the run, not after it
        raise GenerationError(f"cannot write --json {args.json}: {folder} is missing or not writable")
    report = run_loadtest_sync(args.url, args.prompts, args.concurrency, args.requests, max_tokens=args.max_tokens,
                               model=args.model, temperature=args.temperature, timeout=args.timeout,
                               min_tokens=args.min_tokens)
    print(report.summary())
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(report.to_json(), f, indent=1)
        except OSError as e:
            raise GenerationError(f"cannot write --json {args.json}: {e.strerror}") from None
    return 0 if report.failed == 0 and report.lost == 0 else 1
