"""The OpenAI request and response shapes the server speaks, validated without a schema library.

Requests are parsed into one `CompletionRequest` for both routes; anything we cannot honour exactly is a
`RequestError` (an OpenAI-style error body and a 4xx status) rather than being silently ignored.

Extensions (documented in the README): `proposer` ("none", "ngram" or "draft"), `gamma` (drafts per
round; needs a verify graph in the bundle) and `top_k`. The `openai` client sends them with
`extra_body={"proposer": "ngram", "gamma": 8}`.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from ..errors import GenerationError
from ..runtime.logprobs import MAX_TOP as MAX_TOP_LOGPROBS
from ..runtime.penalties import MAX_LOGIT_BIAS
from ..runtime.sampling import is_int
from ..runtime.stop_strings import check_stop
from ..runtime.tokenizer import Tokenizer

MAX_CHOICES = 16  # n: each choice is a sequence of its own (a batch row, or a run after the others)


class RequestError(Exception):
    """A request the server refuses: `status`, and the OpenAI error fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class CompletionRequest:
    chat: bool
    messages: list[dict] | None  # chat
    prompt: str | list[int] | None  # completions: text or token ids
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    proposer: str | None
    gamma: int | None
    min_tokens: int = 0  # vLLM's extension: EOS is held back until this many tokens are out
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension (HF's definition)
    min_p: float = 0.0  # vLLM's extension
    logprobs: int | None = None  # alternatives reported per token (chat: top_logprobs); None: no logprobs
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    n: int = 1  # choices; choice k samples with seed + k when a seed is given
    ignore_eos: bool = False  # vLLM's: EOS does not end the completion
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: these end it too (their text is left out)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def extra_sampling(self) -> dict:
        """The runtime's keyword arguments for the logit bias, penalties and min_p."""
        return dict(repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, min_p=self.min_p, logit_bias=self.logit_bias)


# The sampling fields a server may give defaults of its own (`specedge serve --temperature 0.2 ...`, as vLLM takes
# a model's generation_config); a request that leaves one out (or sends null) gets the server's, else OpenAI's.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")


def check_sampling_defaults(defaults: dict) -> dict:
    """The server's defaults, checked as a request's fields are; RequestError names the first bad one."""
    unknown = set(defaults) - set(SAMPLING_FIELDS)
    if unknown:
        raise RequestError(f"no server default for {', '.join(sorted(unknown))}; there are defaults for "
                           f"{', '.join(SAMPLING_FIELDS)}")
    parse_request({"model": "m", "prompt": "x", **defaults}, False, "m")
    return dict(defaults)


def parse_request(body, chat: bool, model_id: str, defaults: dict | None = None) -> CompletionRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise RequestError("you must provide a model parameter", param="model")
    if model != model_id:
        raise RequestError(f"the model {model!r} does not exist; this server serves {model_id!r}", status=404,
                           param="model", code="model_not_found")
    if defaults:
        body = {**defaults, **{k: v for k, v in body.items() if not (k in defaults and v is None)}}
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise RequestError(f"n must be an integer in 1..{MAX_CHOICES}", param="n")
    for name in ("tools", "functions", "response_format", "suffix", "echo"):
        if body.get(name) not in (None, False, {}, []):
            raise RequestError(f"{name} is not supported by this server", param=name, code="unsupported")
    if body.get("best_of", 1) != 1:
        raise RequestError("best_of > 1 is not supported", param="best_of", code="unsupported")

    messages = prompt = None
    if chat:
        messages = _messages(body.get("messages"))
    else:
        prompt = _prompt(body.get("prompt"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise RequestError("max_tokens must be a positive integer", param="max_tokens")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise RequestError("top_p must be in (0, 1]", param="top_p")
    top_k = _or_default(body, "top_k", 0)
    if not is_int(top_k) or top_k < 0:
        raise RequestError("top_k must be a non-negative integer (0 = no limit)", param="top_k")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or seed < 0):
        raise RequestError("seed must be a non-negative integer", param="seed")
    try:  # the runtime's rule (OpenAI allows 4 strings, vLLM any number; the runtime takes up to 16)
        stop = check_stop(body.get("stop"))
    except GenerationError as e:
        raise RequestError(str(e), param="stop") from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    proposer = body.get("proposer")
    if proposer is not None and proposer not in ("none", "ngram", "draft"):
        raise RequestError("proposer must be 'none', 'ngram' or 'draft'", param="proposer")
    gamma = body.get("gamma")
    if gamma is not None and (not is_int(gamma) or gamma < 1):
        raise RequestError("gamma must be a positive integer", param="gamma")
    min_tokens = body.get("min_tokens", 0)
    if not is_int(min_tokens) or min_tokens < 0:
        raise RequestError("min_tokens must be a non-negative integer", param="min_tokens")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError("ignore_eos must be a boolean", param="ignore_eos")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(is_int(t) and t >= 0 for t in stop_ids):
        raise RequestError("stop_token_ids must be a list of token ids", param="stop_token_ids")
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition = _or_default(body, "repetition_penalty", 1.0)
    if isinstance(repetition, bool) or not isinstance(repetition, (int, float)) or not 0 < repetition < math.inf:
        raise RequestError("repetition_penalty must be a number > 0 (1 = off)", param="repetition_penalty")
    return CompletionRequest(chat, messages, prompt, max_tokens, temperature, top_p, top_k, seed, stop, stream,
                             bool(options.get("include_usage")), proposer, gamma, min_tokens, presence, frequency,
                             float(repetition), _number(body, "min_p", 0.0, 0.0, 1.0), _logprobs(body, chat),
                             _logit_bias(body.get("logit_bias")), int(n), ignore_eos, stop_ids)


def _logit_bias(bias) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object from token ids (as strings, JSON's keys) to numbers in [-100, 100]. Ids past
    the vocabulary are refused by the runtime (a 400 too)."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must be an object from token ids to numbers", param="logit_bias")
    out = {}
    for token, x in bias.items():
        if not (isinstance(token, str) and token.isascii() and token.isdigit()):
            raise RequestError(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not -MAX_LOGIT_BIAS <= x <= MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias values must be numbers between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, "
                               f"got {x!r} for token {token}", param="logit_bias")
        out[int(token)] = float(x)
    return out


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: logprobs (bool) and top_logprobs (0..20); completions: logprobs (0..20 alternatives, or null)."""
    if chat:
        wanted, top = body.get("logprobs"), body.get("top_logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise RequestError("logprobs must be a boolean", param="logprobs")
        if top is not None and (not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise RequestError(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}", param="top_logprobs")
        if top is not None and not wanted:
            raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        return (top or 0) if wanted else None
    n = body.get("logprobs")
    if n is not None and (not is_int(n) or not 0 <= n <= MAX_TOP_LOGPROBS):
        raise RequestError(f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS} or null", param="logprobs")
    return n


def _or_default(body: dict, name: str, default):
    """A field's value, or `default` where the request leaves it out or sends null (as for every sampling field)."""
    x = body.get(name)
    return default if x is None else x


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    x = body.get(name)
    if x is None:
        return default
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi:
        raise RequestError(f"{name} must be a number between {lo:g} and {hi:g}", param=name)
    return float(x)


def _messages(messages) -> list[dict]:
    try:
        return Tokenizer.check_messages(messages)
    except GenerationError as e:  # the message starts with the field it is about
        raise RequestError(str(e), param=str(e).split(" ", 1)[0].rstrip(":")) from None


def _prompt(prompt) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return prompt
    raise RequestError("prompt must be a non-empty string or a list of token ids (one prompt per request)",
                       param="prompt")


# -- responses ------------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def logprobs_body(req: CompletionRequest, items: list[dict] | None) -> dict | None:
    """OpenAI's logprobs object for the tokens `items` (engine.Engine._logprob_items) describe."""
    if req.logprobs is None:
        return None
    items = items or []
    if req.chat:
        return {"content": [{"token": i["token"], "logprob": i["logprob"], "bytes": i["bytes"],
                             "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in i["top"]]}
                            for i in items]}
    return {"tokens": [i["token"] for i in items], "token_logprobs": [i["logprob"] for i in items],
            "top_logprobs": [{t: lp for t, _, lp in i["top"]} for i in items],
            "text_offset": [i["offset"] for i in items]}


@dataclass
class Choice:
    text: str
    finish: str
    logprobs: list[dict] | None = None  # engine.Engine._logprob_items of its tokens


def completion_body(req: CompletionRequest, model: str, choices: list[Choice], use: dict, extra: dict) -> dict:
    kind, prefix = ("chat.completion", "chatcmpl-") if req.chat else ("text_completion", "cmpl-")
    out = []
    for index, c in enumerate(choices):
        body = {"message": {"role": "assistant", "content": c.text}} if req.chat else {"text": c.text}
        out.append({"index": index, **body, "finish_reason": c.finish, "logprobs": logprobs_body(req, c.logprobs)})
    return {"id": prefix + req.id, "object": kind, "created": req.created, "model": model, "choices": out,
            "usage": use, "specedge": extra}


def chunk_body(req: CompletionRequest, model: str, text: str | None, finish: str | None, first: bool = False,
               logprobs: list[dict] | None = None, index: int = 0) -> dict:
    lp = logprobs_body(req, logprobs) if logprobs else None
    if req.chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}
        kind, prefix = "chat.completion.chunk", "chatcmpl-"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": lp}
        kind, prefix = "text_completion", "cmpl-"
    return {"id": prefix + req.id, "object": kind, "created": req.created, "model": model, "choices": [choice]}


def usage_chunk(req: CompletionRequest, model: str, use: dict) -> dict:
    kind, prefix = ("chat.completion.chunk", "chatcmpl-") if req.chat else ("text_completion", "cmpl-")
    return {"id": prefix + req.id, "object": kind, "created": req.created, "model": model, "choices": [],
            "usage": use}
