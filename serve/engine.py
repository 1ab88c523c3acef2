"""The serving engine: a worker thread owns the generator; requests wait in a bounded queue.

Two workers, chosen by the bundle:
* SerialEngine (a batch-1 bundle): one request at a time. A generator's caches are single-threaded state,
  and on a small device one sequence already uses every core (onnxruntime's intra-op threads), so running
  requests one after another loses little throughput and can never corrupt a cache. Conversations are
  resumed from the SnapshotStore: a follow-up turn prefills only what its cache lacks, even when other
  requests ran in between.
* BatchEngine (a bundle exported with --batch B): continuous batching over runtime/batch.py's BatchRunner,
  up to B requests sharing each verify step.
Either way greedy outputs are the outputs of the same requests run one by one.

The HTTP side (app.py) submits one Job per choice (a request's `n`) and reads their events from asyncio
queues; the worker publishes events with call_soon_threadsafe. A job cancelled by its client (a disconnect)
stops at the next round, and one that is still queued never starts: its slot is free at once.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field, replace

from ..errors import SpecedgeError
from ..runtime.generator import Generator, check_gamma, check_proposer
from ..runtime.logprobs import TokenLogprob
from ..runtime.session import SnapshotStore
from ..runtime.stats import Stats
from ..runtime.stop_strings import stop_strings_for
from ..runtime.text_stream import TextStream
from .metrics import Metrics
from .protocol import CompletionRequest, RequestError


@dataclass
class EngineConfig:
    proposer: str = "ngram"  # server defaults; a request may override them (protocol.py)
    gamma: int = 8
    max_tokens: int = 256  # when a request gives none
    max_queue: int = 16  # requests waiting or running; more are refused with 429
    session_bytes: int = 256 << 20  # snapshots of recent conversations kept for prefix reuse
    adaptive: bool = True  # False: every round proposes gamma drafts (serve --fixed-gamma)


@dataclass
class Event:
    kind: str  # "text", "done" or "error"
    text: str = ""
    finish: str | None = None  # done: "stop" or "length"
    stats: Stats | None = None
    status: int = 500  # error
    logprobs: list[dict] | None = None  # text: the logprobs of the tokens whose text it carries (when asked)


@dataclass
class Job:
    request: CompletionRequest
    prompt_ids: list[int]
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def publish(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        self.cancelled.set()


class QueueFull(Exception):
    pass


class Engine:
    """The request side, shared: tokenize and check a request, queue it (bounded). A subclass's worker
    thread runs the jobs."""

    def __init__(self, gen, config: EngineConfig, model_id: str):
        self.gen, self.config, self.model_id = gen, config, model_id
        self.metrics = Metrics()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._pending = 0  # queued + running, bounded by max_queue
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._work, name="specedge-engine", daemon=True)
        self._worker.start()

    # -- request side (event loop thread) --------------------------------------------------------------
    def tokenize(self, req: CompletionRequest) -> list[int]:
        tok = self.gen.tokenizer
        if isinstance(req.prompt, list):
            ids = req.prompt
        elif tok is None:
            raise RequestError("this bundle has no tokenizer: send the prompt as token ids (completions)")
        else:
            try:
                ids = tok.apply_chat_template(req.messages) if req.chat else tok.encode(req.prompt)
            except SpecedgeError as e:
                raise RequestError(str(e)) from None
        dims = self.gen.target.dims
        if len(ids) >= dims.context:
            raise RequestError(f"this model's context holds {dims.context} tokens; the prompt has {len(ids)}",
                               param="messages" if req.chat else "prompt", code="context_length_exceeded")
        bad = [t for t in ids if not 0 <= t < dims.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{dims.vocab_size - 1})",
                               param="prompt")
        return ids

    def submit(self, req: CompletionRequest, loop: asyncio.AbstractEventLoop) -> list[Job]:
        """One job per choice (req.n), queued together or not at all; choice k samples with seed + k."""
        ids = self.tokenize(req)
        room = self.gen.target.dims.context - len(ids)
        self._check_speculation(req)
        vocab = self.gen.target.dims.vocab_size
        if any(t >= vocab for t in req.stop_token_ids):
            raise RequestError(f"stop_token_ids must be token ids below the vocabulary size {vocab}",
                               param="stop_token_ids")
        if req.n > self.config.max_queue:
            raise RequestError(f"n = {req.n} is more than this server queues ({self.config.max_queue}, --max-queue)",
                               param="n")
        jobs = [Job(replace(req, seed=None if req.seed is None else req.seed + k), ids,
                    min(req.max_tokens or self.config.max_tokens, room), loop) for k in range(req.n)]
        with self._lock:
            if self._pending + req.n > self.config.max_queue:
                self.metrics.count_request("rejected")
                raise QueueFull(f"the server is busy ({self._pending} requests queued or running); retry later")
            self._pending += req.n
        for job in jobs:
            self._queue.put(job)
        return jobs

    def stop_ids(self, req: CompletionRequest) -> list[int]:
        """The tokens that end the request's completion: EOS (unless ignore_eos) and its stop_token_ids."""
        return ([] if req.ignore_eos else list(self.gen.eos_ids)) + req.stop_token_ids

    def _check_speculation(self, req: CompletionRequest) -> None:
        proposer = req.proposer or self.config.proposer
        try:
            check_proposer(self.gen.draft is not None, proposer)
        except SpecedgeError as e:
            raise RequestError(str(e), param="proposer") from None
        if proposer != "none":
            try:
                check_gamma(self.gen.manifest, req.gamma or self.config.gamma)
            except SpecedgeError as e:
                raise RequestError(str(e), param="gamma") from None

    @property
    def pending(self) -> int:
        return self._pending

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=30)
        self.gen.close()

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1

    # -- what both workers send a job -----------------------------------------------------------------------
    def _text(self, req: CompletionRequest) -> TextStream:
        tok = self.gen.tokenizer
        # a bundle without a tokenizer answers in token ids, "5 6 7 "
        if tok is None:
            return TextStream(lambda ids: "".join(f"{i} " for i in ids), [])
        return TextStream(tok.decode, req.stop, req.min_tokens)  # the rules the runtime ends the output by

    def _token_text(self, token: int) -> tuple[str, list[int] | None]:
        """A token's text and its bytes (a token holding part of a UTF-8 character has bytes but no text of its
        own: "\ufffd"; None only where the tokenizer cannot tell, runtime/tokenizer.py)."""
        tok = self.gen.tokenizer
        if tok is None:
            return str(token), list(str(token).encode())
        text, data = tok.token_text_and_bytes(token)
        return text, None if data is None else list(data)

    def _logprob_items(self, text: TextStream, entries: list[TokenLogprob]) -> list[dict]:
        """The round's tokens (the last len(entries) of `text`) as protocol.logprobs_body reads them; after a
        stop string only those whose text starts before it."""
        items = []
        for e, start in zip(entries, text.starts(len(entries))):
            if text.stopped and start >= text.sent:
                break
            token, data = self._token_text(e.token)
            items.append({"token": token, "logprob": e.logprob, "bytes": data, "offset": start,
                          "top": [(*self._token_text(t), lp) for t, lp in e.top]})  # (text, bytes, logprob)
        return items

    def _emit(self, job: Job, text: TextStream, new: list[int], entries: list[TokenLogprob] | None = None) -> bool:
        """Publish what a round's tokens add to the text (and their logprobs); True when a stop string ended it.
        A stop token id that ends the round is left out of the text, as EOS is (vLLM's default)."""
        if new and new[-1] in job.request.stop_token_ids:
            new = new[:-1]
            entries = None if entries is None else entries[:len(new)]
        piece = text.push(new)
        items = self._logprob_items(text, entries) if entries is not None else None
        if piece or items:
            job.publish(Event("text", piece, logprobs=items))
        return text.stopped

    def _complete(self, job: Job, text: TextStream, stats: Stats) -> None:
        """The rest of the text, the metrics, and the done event of a job that ran to its end."""
        rest = text.flush()
        if rest:
            job.publish(Event("text", rest))
        finish = "stop" if text.stopped or stats.stop_reason == "stop" else "length"
        self.metrics.record(stats, time.perf_counter() - job.submitted)
        job.publish(Event("done", finish=finish, stats=stats))

    def _work(self) -> None:
        raise NotImplementedError


class SerialEngine(Engine):
    """Batch-1 bundles: one request at a time on one Generator, conversations resumed from snapshots."""

    def __init__(self, gen: Generator, config: EngineConfig, model_id: str):
        self.store = SnapshotStore(gen, max_bytes=config.session_bytes)
        super().__init__(gen, config, model_id)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if job.cancelled.is_set():
                    self.metrics.count_request("cancelled")
                    continue
                self.metrics.running = 1
                self._run(job)
            except SpecedgeError as e:  # a request the generator refuses: the client's fault
                self.metrics.count_request("error")
                job.publish(Event("error", text=str(e), status=400))
            except Exception as e:  # a bug: this request fails, the server keeps serving
                self.metrics.count_request("error")
                job.publish(Event("error", text=f"internal error: {type(e).__name__}: {e}", status=500))
            finally:
                self.metrics.running = 0
                self._done()

    def _run(self, job: Job) -> None:
        req, cfg = job.request, self.config
        self.store.prepare(job.prompt_ids)
        stats = Stats()
        text = self._text(req)
        entries = [] if req.logprobs is not None else None
        rounds = self.gen.stream(job.prompt_ids, max_new_tokens=job.max_tokens, proposer=req.proposer or cfg.proposer,
                                 gamma=req.gamma or cfg.gamma, temperature=req.temperature, top_k=req.top_k,
                                 top_p=req.top_p, seed=req.seed, stop_ids=self.stop_ids(req), stats=stats, reuse=True,
                                 min_new_tokens=req.min_tokens, logprobs=req.logprobs, logprobs_out=entries,
                                 stop=req.stop if self.gen.tokenizer else None, adaptive=cfg.adaptive,
                                 **req.extra_sampling())
        try:
            for new in rounds:
                if self._emit(job, text, new, None if entries is None else entries[-len(new):]) \
                        or job.cancelled.is_set():
                    break
        finally:
            rounds.close()  # ends the generation cleanly: its cache stays reusable
        if job.cancelled.is_set():
            self.metrics.count_request("cancelled")
            return
        self._complete(job, text, stats)


class BatchEngine(Engine):
    """Bundles exported with --batch B: up to B requests generate together, one verify step per round for
    all of them (continuous batching: a request joins a free row while the others keep going, and leaves
    when it ends). Each iteration runs one prefill chunk for the rows that joined, then one decode step.
    A free row keeps its last conversation's cache; a follow-up turn goes to the row holding the longest
    prefix of it. Greedy outputs equal the requests run one by one (runtime/batch.py)."""

    def _work(self) -> None:
        runner = self.gen.runner
        jobs: dict[int, tuple[Job, TextStream]] = {}
        while True:
            if not self._admit(runner, jobs):
                return
            try:
                self._cancel(runner, jobs)
                runner.prefill_step()
                for b, new in runner.decode_step().items():
                    row = runner.rows[b]
                    if self._emit(*jobs[b], new, row.token_logprobs[-len(new):] if row.logprobs is not None else None):
                        runner.finish(b, "stop_string")
                for b in [b for b, row in enumerate(runner.rows) if row is not None and row.reason]:
                    job, text = jobs.pop(b)
                    self._complete(job, text, runner.release(b).stats)
                    self._done()
            except Exception as e:  # a bug: the rows in flight fail, the server keeps serving
                for b, (job, _) in jobs.items():
                    self.metrics.count_request("error")
                    job.publish(Event("error", text=f"internal error: {type(e).__name__}: {e}", status=500))
                    runner.rows[b] = None
                    self._done()
                jobs.clear()
                runner.history = [[] for _ in runner.rows]
                self.gen.target.reset()
            self.metrics.running = len(jobs)

    def _admit(self, runner, jobs) -> bool:
        """Move queued jobs into free rows (waiting for one when nothing runs). False: shut down."""
        while len(jobs) < len(runner.rows):
            try:
                job = self._queue.get(block=not jobs)
            except queue.Empty:
                return True
            if job is None:
                return False
            if job.cancelled.is_set():
                self.metrics.count_request("cancelled")
                self._done()
                continue
            req, cfg = job.request, self.config
            b = runner.free_row(job.prompt_ids)
            try:
                runner.admit(b, job.prompt_ids, job.max_tokens, req.proposer or cfg.proposer, req.gamma or cfg.gamma,
                             req.temperature, req.top_k, req.top_p, req.seed, self.stop_ids(req),
                             min_new_tokens=req.min_tokens, logprobs=req.logprobs, adaptive=cfg.adaptive,
                             **req.extra_sampling(),
                             stop_strings=stop_strings_for(self.gen.tokenizer, req.stop, req.min_tokens)
                             if self.gen.tokenizer else None)
            except SpecedgeError as e:
                self.metrics.count_request("error")
                job.publish(Event("error", text=str(e), status=400))
                self._done()
                continue
            jobs[b] = (job, self._text(req))
        return True

    def _cancel(self, runner, jobs) -> None:
        for b, (job, _) in list(jobs.items()):
            if job.cancelled.is_set():
                runner.finish(b, "cancelled")
                runner.release(b)
                del jobs[b]
                self.metrics.count_request("cancelled")
                self._done()
