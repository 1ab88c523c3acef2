"""Serving numbers for a bundle: `specedge loadtest` at several concurrencies, and the TTFT of a follow-up
chat turn with its prefix reused against the same request with nothing to reuse.

    python benchmarks/serve_load.py BUNDLE [--batch-bundle BUNDLE_B4 [--lazy-row-steps]] [--concurrency 1,4,8]
                                    [--requests 16] [--max-tokens 64] [--out DIR]

Two servers run as subprocesses on loopback: A (default: conversations cached) and B (`--session-mb 0`: no
stored conversation). The loadtests hit B, so a suite prompt seen before is not served from a stored
conversation (only the chat template's shared system prompt is reused between consecutive requests). The TTFT comparison interleaves A and B per repetition: each
sends turn 1 of a 500+ token conversation, B then serves an unrelated request (so its cache holds nothing
of the conversation), and both serve the identical turn 2, streamed; the TTFT is the client's.
With `--lazy-row-steps` the batch bundle is also loadtested by a server started with that flag, after the
default one (whose start has filled the optimized-graph cache for both).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

from specedge.tools.loadtest import run_loadtest_sync

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE = os.path.join(HERE, "..", "tools", "prompts", "suite.jsonl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bundle: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specedge", "serve", bundle, "--port", str(port), "--threads", "2",
                             "--model-id", "m", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not start: try `specedge serve {bundle}` by hand")


def stream_ttft(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """Client-side TTFT (ms) of a streamed chat request, its text, and its usage."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    began, ttft, text, usage = time.perf_counter(), None, [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else (time.perf_counter() - began) * 1e3
                    text.append(piece)
    return ttft, "".join(text), usage


def follow_up_ttft(url_reuse: str, url_fresh: str, repeats: int) -> dict:
    prompts = [json.loads(line) for line in open(SUITE)]
    long = max(prompts, key=lambda p: len(p["messages"][0]["content"]))  # the longest grounded prompt
    unrelated = [{"role": "user", "content": "Name three primary colours."}]
    rows = []
    for i in range(repeats):
        turn1 = [{"role": "user", "content": long["messages"][0]["content"] + f"\n(Request {i}.)"}]
        results = {}
        for name, url in (("reuse", url_reuse), ("fresh", url_fresh)):
            _, answer, _ = stream_ttft(url, turn1, 64)
            if name == "fresh":
                stream_ttft(url, unrelated, 8)  # the conversation's cache is gone, and nothing is stored
            turn2 = turn1 + [{"role": "assistant", "content": answer},
                             {"role": "user", "content": "Now also add a docstring line saying what changed."}]
            ttft, text, usage = stream_ttft(url, turn2, 32)
            results[name] = (ttft, text, usage)
        assert results["reuse"][1] == results["fresh"][1], "turn 2 differs with and without reuse"
        rows.append({"prompt_tokens": results["reuse"][2]["prompt_tokens"],
                     "cached_tokens": results["reuse"][2]["prompt_tokens_details"]["cached_tokens"],
                     "ttft_reuse_ms": results["reuse"][0], "ttft_fresh_ms": results["fresh"][0]})
    med = {k: statistics.median(r[k] for r in rows) for k in ("ttft_reuse_ms", "ttft_fresh_ms")}
    return {"prompt": long["id"], "rows": rows, **med, "ratio": med["ttft_reuse_ms"] / med["ttft_fresh_ms"]}


def loadtests(url: str, a) -> dict:
    out = {}
    for c in (int(x) for x in a.concurrency.split(",")):
        report = run_loadtest_sync(url, SUITE, concurrency=c, requests=a.requests, max_tokens=a.max_tokens, model="m")
        print(report.summary(), "\n", flush=True)
        out[c] = report.to_json(per_request=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-bundle", help="also loadtest this bundle (exported with --batch B: continuous batching)")
    ap.add_argument("--lazy-row-steps", action="store_true",
                    help="also loadtest the batch bundle with a server that makes its row step sessions lazily")
    ap.add_argument("--proposer", default="ngram", help="the servers' default proposer (default ngram)")
    ap.add_argument("--gamma", default="8", help="the servers' default gamma (default 8)")
    ap.add_argument("--out", default=os.path.join(HERE, "serve"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    spec = ("--proposer", a.proposer, "--gamma", a.gamma)
    server_a, url_a = start_server(a.bundle, *spec)
    server_b, url_b = start_server(a.bundle, *spec, "--session-mb", "0")
    try:
        loads = {"serial": loadtests(url_b, a)}
        batch_servers = [("batch", ())] + [("batch-lazy", ("--lazy-row-steps",))] * a.lazy_row_steps
        for name, extra in batch_servers if a.batch_bundle else ():
            server_c, url_c = start_server(a.batch_bundle, *spec, "--session-mb", "0", *extra)
            try:
                loads[name] = loadtests(url_c, a)
            finally:
                server_c.terminate()
                server_c.wait(timeout=30)
        ttft = follow_up_ttft(url_a, url_b, a.repeats)
        print(f"follow-up turn ({ttft['rows'][0]['prompt_tokens']} prompt tokens, "
              f"{ttft['rows'][0]['cached_tokens']} cached): TTFT {ttft['ttft_reuse_ms']:.0f} ms with reuse, "
              f"{ttft['ttft_fresh_ms']:.0f} ms without ({ttft['ratio']:.2f}x)")
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump({"bundle": a.bundle, "batch_bundle": a.batch_bundle, "proposer": a.proposer, "gamma": a.gamma, "loadtest": loads,
                       "follow_up": ttft}, f, indent=1)
    finally:
        for proc in (server_a, server_b):
            proc.terminate()
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
