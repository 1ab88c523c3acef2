"""What one generation did and how long each part took.

Counts follow the output: a round cut short by a stop token or max_new_tokens counts only the drafts that
reached the output, so `new_tokens == accepted + rounds` always holds (every round emits its accepted
drafts plus one token from the target).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    proposer: str = "none"
    gamma: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose K/V a session's cache already held (not prefilled again)
    tree: int = 0  # the tree graph's T (0: chains only)
    tree_rounds: int = 0  # rounds that verified a token tree
    tree_nodes: int = 0  # nodes those trees offered (also counted in proposed)
    off_chain_accepted: int = 0  # tree rounds whose accepted path ended in a leaf off the first chain
    new_tokens: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    spare_proposed: int = 0  # guesses in a verify graph's padding rows (ModelRunner.padding_rows); in proposed too
    spare_accepted: int = 0  # and accepted (in accepted too)
    proposed_by_position: list[int] = field(default_factory=list)  # drafts offered at position j (0-based)
    accepted_by_position: list[int] = field(default_factory=list)  # and accepted there
    prefill_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    commit_ms: float = 0.0
    graph_ms: float = 0.0  # inside graph runs (target and draft), prefill included
    decode_graph_ms: float = 0.0  # inside graph runs after the prefill
    total_ms: float = 0.0
    ttft_ms: float = 0.0
    itl_ms: float = 0.0  # mean time between consecutive output tokens after the first
    stop_reason: str = ""
    _token_times: list[float] = field(default_factory=list, repr=False)
    _started: float = field(default=0.0, repr=False)

    def start(self) -> None:
        self._started = time.perf_counter()

    def ms_since_start(self) -> float:
        return (time.perf_counter() - self._started) * 1e3

    def record_round(self, proposed: int, accepted: int, positions: int | None = None) -> None:
        """A round offered `proposed` drafts reaching `positions` positions (a chain: as many; a tree: its
        depth) and emitted `accepted` of them."""
        positions = proposed if positions is None else positions
        grow = max(0, positions - len(self.proposed_by_position))
        self.proposed_by_position += [0] * grow
        self.accepted_by_position += [0] * grow
        for j in range(positions):
            self.proposed_by_position[j] += 1
        for j in range(accepted):
            self.accepted_by_position[j] += 1
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted

    def record_tokens(self, n: int) -> None:
        now = self.ms_since_start()
        if not self._token_times:
            self.ttft_ms = now
        self._token_times += [now] * n
        self.new_tokens += n

    def finish(self, reason: str) -> None:
        self.stop_reason = reason
        self.total_ms = self.ms_since_start()
        t = self._token_times
        self.itl_ms = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0

    # -- derived -------------------------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position)]

    @property
    def tokens_per_round(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        """End to end: prefill included."""
        return self.new_tokens / (self.total_ms / 1e3) if self.total_ms else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.total_ms - self.ttft_ms
        return (self.new_tokens - 1) / (decode / 1e3) if self.new_tokens > 1 and decode > 0 else 0.0

    @property
    def host_ms(self) -> float:
        """Everything outside graph runs: Python, acceptance, sampling, cache bookkeeping."""
        return max(0.0, self.total_ms - self.graph_ms)

    @property
    def host_share(self) -> float:
        """The part of the decode rounds (prefill excluded) spent outside graph runs."""
        decode = self.total_ms - self.prefill_ms
        return max(0.0, 1 - self.decode_graph_ms / decode) if decode > 0 else 0.0

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d.update(acceptance_rate=self.acceptance_rate, acceptance_by_position=self.acceptance_by_position,
                 tokens_per_round=self.tokens_per_round, tokens_per_s=self.tokens_per_s,
                 decode_tokens_per_s=self.decode_tokens_per_s, host_ms=self.host_ms, host_share=self.host_share)
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}

    def summary(self) -> str:
        spec = (f", {self.tokens_per_round:.2f} tokens/round, acceptance {self.acceptance_rate:.0%}"
                if self.proposer != "none" else "")
        reused = f", {self.reused_tokens}/{self.prompt_tokens} prompt tokens reused" if self.reused_tokens else ""
        return (f"{self.new_tokens} tokens in {self.total_ms / 1e3:.2f} s: {self.tokens_per_s:.1f} tokens/s, "
                f"TTFT {self.ttft_ms:.0f} ms{reused}, ITL {self.itl_ms:.1f} ms{spec} [{self.proposer}, stop: "
                f"{self.stop_reason}]")
