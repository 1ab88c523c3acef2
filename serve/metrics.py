"""Counters for /metrics, in the Prometheus text exposition format (version 0.0.4).

Written by the engine's worker thread, read by the event loop: plain ints and floats, whose reads and
writes are atomic under the GIL, so a scrape may see one request half-counted but never a broken number.
"""
from __future__ import annotations

import time
from collections import deque

from ..runtime.stats import Stats

WINDOW_S = 60.0  # tokens/s is reported over the last minute


class Metrics:
    def __init__(self):
        self.requests: dict[str, int] = {"ok": 0, "error": 0, "rejected": 0, "cancelled": 0, "invalid": 0}
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self.completion_tokens = 0
        self.proposed = 0
        self.accepted = 0
        self.rounds = 0
        self.ttft_sum = 0.0
        self.latency_sum = 0.0
        self.running = 0
        self._recent: deque[tuple[float, int]] = deque()  # (finish time, completion tokens)

    def count_request(self, status: str) -> None:
        self.requests[status] += 1

    def record(self, stats: Stats, latency_s: float) -> None:
        self.count_request("ok")
        self.prompt_tokens += stats.prompt_tokens
        self.reused_tokens += stats.reused_tokens
        self.completion_tokens += stats.new_tokens
        self.proposed += stats.proposed
        self.accepted += stats.accepted
        self.rounds += stats.rounds
        self.ttft_sum += stats.ttft_ms / 1e3
        self.latency_sum += latency_s
        self._recent.append((time.monotonic(), stats.new_tokens))

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / WINDOW_S

    def exposition(self, queue_depth: int) -> str:
        done = self.requests["ok"]
        lines = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP specedge_{name} {help_}")
            lines.append(f"# TYPE specedge_{name} {kind}")
            lines.extend(f"specedge_{name}{labels} {value:g}" for labels, value in samples)

        metric("requests_total", "counter", "Requests by outcome: ok, error and cancelled count sequences (each of a "
               "request's n choices), invalid and rejected count HTTP requests (refused before any sequence ran).",
               [(f'{{status="{k}"}}', v) for k, v in self.requests.items()])
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", self.prompt_tokens)])
        metric("reused_prompt_tokens_total", "counter", "Prompt tokens served from a cached prefix.",
               [("", self.reused_tokens)])
        metric("completion_tokens_total", "counter", "Generated tokens.", [("", self.completion_tokens)])
        metric("draft_tokens_proposed_total", "counter", "Draft tokens proposed.", [("", self.proposed)])
        metric("draft_tokens_accepted_total", "counter", "Draft tokens accepted.", [("", self.accepted)])
        metric("rounds_total", "counter", "Verify rounds (each emits accepted drafts plus one token).",
               [("", self.rounds)])
        metric("acceptance_ratio", "gauge", "Accepted over proposed draft tokens since start.",
               [("", self.accepted / self.proposed if self.proposed else 0.0)])
        metric("tokens_per_second", "gauge", f"Generated tokens per second over the last {WINDOW_S:g} s.",
               [("", self.tokens_per_s())])
        metric("time_to_first_token_seconds_sum", "counter", "Sum of TTFT (from the start of the run).",
               [("", self.ttft_sum)])
        metric("request_latency_seconds_sum", "counter", "Sum of request latency (from submission).",
               [("", self.latency_sum)])
        metric("requests_finished", "counter", "Sequences that finished (the _sum metrics' count).", [("", done)])
        metric("queue_depth", "gauge", "Sequences waiting to run.", [("", max(0, queue_depth - self.running))])
        metric("requests_running", "gauge", "Sequences running now.", [("", self.running)])
        return "\n".join(lines) + "\n"
