"""Peer systems for `specedge bench --compare`: the same model, prompts and threads, run in our process.

A speed ratio against a peer is only meaningful when both numbers come from one run: same machine load,
same thermal state, same prompts, same thread count. So the peers live here, behind one small interface,
and the bench calls them right next to its own runs:

    peer = load_peer("ort-genai", gguf_path, threads=2, cache_dir=cache)  # or ort-genai-int4, transformers, llama.cpp
    for config in peer.configs:
        result = peer.generate(prompt_ids, max_new_tokens=128, config=config)

The `transformers` and `ort-genai` peers run the *same* float32 model as our float32 bundles: the Q4_1
GGUF dequantized by transformers. The transformers peer uses that model directly; the ORT GenAI peer gets an
ONNX export of it made by ORT GenAI's own model builder from a Hugging Face directory we write out of the
dequantized weights.

`ort-genai-int4` is ORT GenAI's int4 CPU model of that same float32 model, built by the same builder with
`-p int4` and its default quantization (round-to-nearest, symmetric, blocks of 32, accuracy level 4). It is
the peer for our int4 bundles (`specedge export --quant int4`), not for the float32 ones. Its tokens differ
from the float32 model's, and from our int4 bundles' too: the two int4 models quantize the same weights
with different choices (our embedding and LM head are int8 by default, ORT GenAI's int4 RTN quantizes every
MatMul and the tied embedding/LM head to int4, with the full -8..7 range), so the bench's "identical output"
column, which compares every system with our own plain decode, holds for this peer only where the two
happen to agree (top-1 agreement between the two int4 models is about 60% per position on
benchmarks/quality/text.txt). Compare its speed with our int4 bundles, and quality with
`python -m specedge.tools.quality` (benchmarks/quality/README.md).

`llama.cpp` runs the GGUF file itself through llama-cpp-python (for the embedded SmolLM2: Q4_1, llama.cpp's
own kernels), another peer for our int4 bundles, whose quality is that of our `--quant-scheme offset` copy
of the same file.

Every run is greedy and produces exactly `max_new_tokens` tokens: EOS is suppressed until then
(`min_new_tokens` / `min_length`), because a peer that stops early on EOS would report a rate over a
different amount of work. Times are end to end from the prompt ids to the last token (prefill included,
model loading excluded).

Nothing heavy is imported at module import: torch, transformers and onnxruntime_genai are imported inside
the loaders, so `import specedge.tools.peers` is free and a missing package surfaces as `PeerUnavailable`
only when that peer is asked for.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ..errors import BackendError, GenerationError
from ..runtime.backends.digests import file_digest

# What to tell a user who lacks a peer's packages. Both peers need torch + transformers: the ORT GenAI
# peer uses them (once) to dequantize the GGUF and write the directory its model builder reads.
_TORCH_HINT = "pip install 'specedge[peers]'  (or: pip install torch transformers accelerate)"
_ORT_GENAI_HINT = ("pip install 'specedge[peers]' onnx-ir  (or: pip install onnxruntime-genai onnx-ir torch "
                   "transformers accelerate); its model builder imports onnx_ir")

# The ORT GenAI n-gram setting we compare against: match the last 2 tokens (n=3), propose up to 8,
# chained lookup on, fixed width (min_adaptive_k=0: ORT GenAI's docs recommend a fixed K for controlled
# benchmarking, and an adaptive K would make the peer's work depend on timing noise).
ORT_NGRAM_OPTIONS = {"ngram_size": 3, "max_draft_tokens": 8, "ngram_chained_lookup": True, "min_adaptive_k": 0}

# transformers' prompt-lookup decoding: propose up to 10 tokens copied from the context
# (it matches n-grams of up to `max_matching_ngram_size`, default 2).
HF_PROMPT_LOOKUP_TOKENS = 10


class PeerUnavailable(BackendError):
    """A peer whose packages are not installed; the message says what to install."""


@dataclass
class PeerResult:
    tokens: list[int]        # exactly max_new_tokens greedy tokens, prompt excluded
    total_s: float           # prompt ids in -> last token out, prefill included
    ttft_s: float | None     # prompt ids in -> first new token available; None if the peer cannot tell

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else float("inf")


class Peer:
    """One peer system, loaded and ready; `generate` is the only timed call."""

    name: str = ""
    configs: list[str] = []

    def generate(self, prompt_ids: list[int], max_new_tokens: int, config: str = "plain") -> PeerResult:
        raise NotImplementedError

    def close(self) -> None:
        """Drop the model so a bench can free memory before loading the next peer."""

    def _check_args(self, prompt_ids, max_new_tokens: int, config: str) -> list[int]:
        if config not in self.configs:
            raise GenerationError(f"peer {self.name!r} has no config {config!r}; it has {', '.join(self.configs)}")
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise GenerationError("the prompt is empty")
        return ids

    def _check_result(self, tokens: list[int], max_new_tokens: int, config: str) -> list[int]:
        # A short result would silently inflate tokens/s; make it loud instead.
        if len(tokens) != max_new_tokens:
            raise BackendError(
                f"peer {self.name!r} ({config}) produced {len(tokens)} tokens, asked for exactly {max_new_tokens}"
            )
        return tokens


# --------------------------------------------------------------------------------------------------
# The float32 model, from the GGUF, through transformers (shared by both peers)
# --------------------------------------------------------------------------------------------------

def _import_torch_transformers():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise PeerUnavailable(f"this peer needs torch and transformers ({e.name} is missing): {_TORCH_HINT}") from e
    if importlib.util.find_spec("accelerate") is None:  # transformers' GGUF loading goes through it
        raise PeerUnavailable(f"this peer needs accelerate: {_TORCH_HINT}")
    return torch, transformers


def _load_hf_fp32(gguf_path: str):
    """The GGUF's model as a plain float32 transformers model, plus its tokenizer."""
    torch, transformers = _import_torch_transformers()
    if not os.path.isfile(gguf_path):
        raise BackendError(f"no GGUF file at {gguf_path}")
    folder, name = os.path.split(os.path.abspath(gguf_path))
    kwargs = {"gguf_file": name, "dtype": torch.float32}
    # transformers >= 5 can keep GGUF weights packed and run them through GGUF matmul kernels when the
    # `kernels` package is installed: that would be a different model (and different speed) from ours.
    # Ask for plain dequantized weights explicitly wherever the option exists.
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.eval()
    odd = sorted({str(p.dtype) for p in model.parameters()} - {"torch.float32"})
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if odd or packed:
        raise BackendError(f"the GGUF did not load as a plain float32 model (dtypes {odd}, modules {packed})")
    return model, tokenizer


# --------------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------------

class TransformersPeer(Peer):
    """`model.generate` on the dequantized float32 model, eager PyTorch on CPU.

    TTFT comes from a `BaseStreamer` that timestamps the first new token. generate() calls the streamer
    once with the prompt and then once per step with a tensor already on the CPU, so the streamer costs
    a Python call per token and no device synchronization; it is attached to every run (timed or not)
    so all configs pay the same.
    """

    name = "transformers"

    def __init__(self, gguf_path: str, threads: int):
        torch, transformers = _import_torch_transformers()
        # Process-wide, like our own thread setting: torch's intra-op pool is separate from ORT's, so
        # this does not disturb the other systems in the bench. 0 keeps torch's own default.
        if threads:
            torch.set_num_threads(threads)
        self._torch = torch
        self._streamer_base = transformers.generation.streamers.BaseStreamer
        self.model, self.tokenizer = _load_hf_fp32(gguf_path)
        gc = self.model.generation_config
        self._eos = gc.eos_token_id if gc.eos_token_id is not None else self.model.config.eos_token_id
        self._pad = gc.pad_token_id if gc.pad_token_id is not None else self._eos
        self.configs = ["plain", "prompt-lookup"]
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__}

    def _clock(self):
        base = self._streamer_base

        class FirstTokenClock(base):
            def __init__(self):
                self.puts = 0
                self.first = None

            def put(self, value):
                self.puts += 1
                if self.puts == 2 and self.first is None:  # put #1 is the prompt itself
                    self.first = time.perf_counter()

            def end(self):
                pass

        return FirstTokenClock()

    def generate(self, prompt_ids, max_new_tokens: int, config: str = "plain") -> PeerResult:
        ids = self._check_args(prompt_ids, max_new_tokens, config)
        torch = self._torch
        extra = {"prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS} if config == "prompt-lookup" else {}
        clock = self._clock()
        with torch.inference_mode():
            t0 = time.perf_counter()
            input_ids = torch.tensor([ids], dtype=torch.long)
            out = self.model.generate(
                input_ids,
                # All ones, always: SmolLM2's pad id is <|im_end|>, which every chat prompt contains, and
                # without an explicit mask transformers would infer one that masks those positions out.
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                eos_token_id=self._eos,
                pad_token_id=self._pad,
                streamer=clock,
                **extra,
            )
            total = time.perf_counter() - t0
        tokens = out[0, len(ids):].tolist()
        ttft = clock.first - t0 if clock.first is not None else None
        return PeerResult(self._check_result(tokens, max_new_tokens, config), total, ttft)

    def close(self) -> None:
        self.model = None


# --------------------------------------------------------------------------------------------------
# ONNX Runtime GenAI
# --------------------------------------------------------------------------------------------------

def _import_og():
    try:
        import onnxruntime_genai as og
    except ImportError as e:
        raise PeerUnavailable(f"the ort-genai peer needs onnxruntime-genai: {_ORT_GENAI_HINT}") from e
    return og


# The builder precisions a peer can ask for. int4 is the builder's own default int4 CPU recipe (`-p int4 -e cpu`
# and no extra options: its default RTN quantizer, symmetric, block 32, accuracy level 4).
ORT_GENAI_PRECISIONS = ("fp32", "int4")


def build_ort_genai_model(gguf_path: str, cache_dir: str, log=None, precision: str = "fp32") -> str:
    """The ORT GenAI CPU model folder (`precision` fp32 or int4) for this GGUF, built once and cached under
    `cache_dir`.

    The folder name carries the GGUF's digest, the precision and the onnxruntime-genai version (a newer
    builder may export differently), so a changed input gets a fresh build instead of a stale one. The build
    happens in a scratch folder that is renamed into place only when complete, so an interrupted build is never
    mistaken for a finished one.
    """
    if precision not in ORT_GENAI_PRECISIONS:
        raise GenerationError(f"ORT GenAI precision must be one of {', '.join(ORT_GENAI_PRECISIONS)}, "
                              f"not {precision!r}")
    og = _import_og()
    if not os.path.isfile(gguf_path):
        raise BackendError(f"no GGUF file at {gguf_path}")
    digest = file_digest(gguf_path)
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    out_dir = os.path.join(cache_dir, "ort-genai", f"{stem}-{digest[:16]}-{precision}-cpu-ogenai{og.__version__}")
    marker = os.path.join(out_dir, "specedge-peer.json")
    if os.path.isfile(marker):
        return out_dir
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    say = log or (lambda msg: print(msg, file=sys.stderr))
    say(f"ort-genai: building its {precision} CPU model once, into {out_dir}")
    work = tempfile.mkdtemp(prefix=".build-", dir=os.path.dirname(out_dir))
    try:
        # 1. A Hugging Face folder holding the dequantized float32 weights: the builder's input format.
        #    transformers refuses save_pretrained on a model loaded through its GGUF quantizer, though the
        #    weights are plain float32 by now; detach the quantizer so it writes them out as they are.
        hf_dir = os.path.join(work, "hf")
        model, tokenizer = _load_hf_fp32(gguf_path)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(hf_dir)
        tokenizer.save_pretrained(hf_dir)
        del model

        # 2. ORT GenAI's model builder, as its documented command line, in a child process so its imports
        #    and memory stay out of the bench. Default options: no prune_lm_head (n-gram decoding needs
        #    logits for every position, and the plain runs should use the same model file).
        built = os.path.join(work, "model")
        builder_args = ["-p", precision, "-e", "cpu"]
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder",
               "-i", hf_dir, "-o", built, *builder_args, "-c", os.path.join(work, "builder-cache")]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = proc.stdout[-3000:]
            if "No module named" in tail:
                raise PeerUnavailable(f"onnxruntime-genai's model builder is missing a package:\n{tail}\n{_ORT_GENAI_HINT}")
            raise BackendError(f"onnxruntime-genai's model builder failed ({proc.returncode}):\n{tail}")
        with open(os.path.join(built, "specedge-peer.json"), "w") as f:
            json.dump({"gguf": os.path.basename(gguf_path), "gguf_sha256": digest,
                       "onnxruntime_genai": og.__version__, "precision": precision,
                       "builder_args": builder_args}, f, indent=1)
        try:
            os.replace(built, out_dir)
        except OSError:
            if not os.path.isfile(marker):  # not a concurrent builder that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out_dir


class OrtGenaiPeer(Peer):
    """onnxruntime-genai's Generator loop (append_tokens, generate_next_token) on its CPU export, fp32
    (peer `ort-genai`) or the builder's default int4 (peer `ort-genai-int4`).

    TTFT is the time to the end of the first generate_next_token(): append_tokens() runs the prefill and
    the first call picks the token from its logits. With n-gram decoding ORT GenAI verifies several
    tokens per model run but still hands them out one per generate_next_token() call.
    """

    name = "ort-genai"

    def __init__(self, gguf_path: str, threads: int, cache_dir: str, precision: str = "fp32"):
        og = _import_og()
        self._og = og
        self._np = __import__("numpy")
        self.precision = precision
        self.name = "ort-genai" if precision == "fp32" else f"ort-genai-{precision}"
        self.model_dir = build_ort_genai_model(gguf_path, cache_dir, precision=precision)
        config = og.Config(self.model_dir)
        config.clear_providers()  # CPU
        if threads and not hasattr(config, "overlay"):
            raise PeerUnavailable(f"onnxruntime-genai {og.__version__} is too old (no Config.overlay): {_ORT_GENAI_HINT}")
        # Threads go into the session options at load time; the cached genai_config.json stays untouched
        # so one build serves every thread count. 0 keeps onnxruntime's own default.
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": int(threads)}}}}))
        self.model = og.Model(config)
        self.configs = ["plain"]
        if self._supports_ngram():
            self.configs.append("ngram")
        self.versions = {"onnxruntime-genai": og.__version__}
        try:
            import onnxruntime
            self.versions["onnxruntime"] = onnxruntime.__version__
        except ImportError:
            pass

    def _supports_ngram(self) -> bool:
        # n-gram speculative decoding is recent in onnxruntime-genai (set_speculative_options, ngram_size);
        # ask the installed version what it knows rather than guess from its version number.
        params = self._og.GeneratorParams(self.model)
        if not hasattr(params, "set_speculative_options"):
            return False
        try:
            return "ngram_size" in params.get_speculative_options()
        except Exception:
            return False

    def generate(self, prompt_ids, max_new_tokens: int, config: str = "plain") -> PeerResult:
        ids = self._check_args(prompt_ids, max_new_tokens, config)
        og, np = self._og, self._np
        total_len = len(ids) + max_new_tokens
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        # min_length == max_length: EOS cannot end the run early, so every run is exactly N tokens.
        params.set_search_options(max_length=total_len, min_length=total_len, do_sample=False)
        if config == "ngram":
            params.set_speculative_options(**ORT_NGRAM_OPTIONS)
        generator = og.Generator(self.model, params)
        generator.append_tokens(np.asarray(ids, dtype=np.int32))
        first = None
        while not generator.is_done():
            generator.generate_next_token()
            if first is None:
                first = time.perf_counter()
        sequence = generator.get_sequence(0)
        total = time.perf_counter() - t0
        self.last_stats = generator.get_speculative_stats() if config == "ngram" else None
        tokens = [int(t) for t in sequence[len(ids):]]
        return PeerResult(self._check_result(tokens, max_new_tokens, config), total, first - t0 if first else None)

    def close(self) -> None:
        self.model = None


# --------------------------------------------------------------------------------------------------
# llama.cpp
# --------------------------------------------------------------------------------------------------

_LLAMA_CPP_HINT = ("pip install 'specedge[llamacpp]'  (or: pip install llama-cpp-python; it compiles llama.cpp "
                   "on install and needs a C/C++ compiler and cmake)")

# llama-cpp-python's prompt lookup (LlamaPromptLookupDecoding): match up to 2 tokens, propose up to 10, as
# transformers' prompt lookup does with our HF_PROMPT_LOOKUP_TOKENS.
LLAMA_CPP_LOOKUP = {"max_ngram_size": 2, "num_pred_tokens": HF_PROMPT_LOOKUP_TOKENS}


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise PeerUnavailable(f"the llama.cpp peer needs llama-cpp-python: {_LLAMA_CPP_HINT}") from e
    return llama_cpp


# Text for the kernel self-check below: any ordinary prose works.
_CHECK_TEXT = ("The quick brown fox jumps over the lazy dog. A speculative decoder drafts a few tokens, verifies "
               "them in one step, and keeps the longest prefix that the target model agrees with. ") * 2
_KERNELS_CHECKED: set[str] = set()  # GGUF paths whose batched kernels this process has checked


def load_llama_cpp(gguf_path: str, threads: int, n_ctx: int = 2048, **kwargs):
    """llama.cpp's model of the GGUF itself (its own quantized kernels), CPU only, quiet; refused when the
    build's batched kernels disagree with its one-token ones (check_llama_cpp_kernels)."""
    llama_cpp = import_llama_cpp()
    if not os.path.isfile(gguf_path):
        raise BackendError(f"no GGUF file at {gguf_path}")

    def load(**more):
        return llama_cpp.Llama(model_path=gguf_path, n_threads=threads or None, n_threads_batch=threads or None,
                               n_gpu_layers=0, verbose=False, **more)

    if gguf_path not in _KERNELS_CHECKED:  # once per file and process: the peer loads it twice, quality once
        check_llama_cpp_kernels(load)
        _KERNELS_CHECKED.add(gguf_path)
    return load(n_ctx=n_ctx, **kwargs)


def check_llama_cpp_kernels(load) -> None:
    """A prompt evaluated in one batch must predict what it predicts one token at a time. llama.cpp's AMX
    kernels (built by default on CPUs that have AMX, such as recent Xeons) computed Q4_0/Q4_1 batches wrongly
    until llama.cpp PR 19925 (2026-02): here llama-cpp-python 0.3.16's build agreed with our float32 SmolLM2 on
    22% of a 200-token text's next tokens evaluated as one batch, 95% evaluated one token at a time, 97% as one
    batch with AMX left out. Such a peer would be measured on garbage."""
    np = __import__("numpy")
    batched, single = load(n_ctx=256, logits_all=True), load(n_ctx=256, logits_all=True, n_batch=1, n_ubatch=1)
    ids = batched.tokenize(_CHECK_TEXT.encode(), add_bos=False)[:64]
    tops = []
    for llm in (batched, single):
        llm.reset()
        llm.eval(ids)
        tops.append(np.argmax(np.asarray(llm.scores[:len(ids)]), axis=-1))
    agree = float((tops[0] == tops[1]).mean())
    if agree < 0.9:
        raise PeerUnavailable(
            f"this llama-cpp-python build computes a batched prompt unlike one token at a time (next-token agreement "
            f"{agree:.0%}): llama.cpp's AMX kernels before PR 19925 do that with Q4_0/Q4_1; rebuild without them: "
            "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
            "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF' pip install --force-reinstall --no-cache-dir llama-cpp-python")


class LlamaCppPeer(Peer):
    """llama.cpp (through llama-cpp-python) on the GGUF file itself: for the embedded SmolLM2 that is its Q4_1
    weights run by llama.cpp's own kernels, the peer to compare our int4 bundles with. Greedy (temperature 0,
    no penalties), EOS held back by a logits processor until max_new_tokens. `prompt-lookup` is
    llama-cpp-python's prompt lookup decoding (a second context of the same file, since a draft model makes it
    keep every position's logits). TTFT is the time to the first token generate() yields."""

    name = "llama.cpp"

    def __init__(self, gguf_path: str, threads: int):
        llama_cpp = import_llama_cpp()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self._np = __import__("numpy")
        self.models = {"plain": load_llama_cpp(gguf_path, threads),
                       "prompt-lookup": load_llama_cpp(gguf_path, threads,
                                                       draft_model=LlamaPromptLookupDecoding(**LLAMA_CPP_LOOKUP))}
        self._eos = self.models["plain"].token_eos()
        self._processors = llama_cpp.LogitsProcessorList
        self.configs = list(self.models)
        self.versions = {"llama-cpp-python": llama_cpp.__version__}

    def generate(self, prompt_ids, max_new_tokens: int, config: str = "plain") -> PeerResult:
        ids = self._check_args(prompt_ids, max_new_tokens, config)
        model, np, eos = self.models[config], self._np, self._eos
        made: list[int] = []

        def hold_eos(_input_ids, scores):
            if len(made) < max_new_tokens:
                scores[eos] = -np.inf
            return scores

        first = None
        t0 = time.perf_counter()
        for token in model.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                    reset=True, logits_processor=self._processors([hold_eos])):
            if first is None:
                first = time.perf_counter()
            made.append(int(token))
            if len(made) == max_new_tokens:
                break
        total = time.perf_counter() - t0
        return PeerResult(self._check_result(made, max_new_tokens, config), total, first - t0 if first else None)

    def close(self) -> None:
        self.models = {}


# --------------------------------------------------------------------------------------------------

PEERS = {
    "transformers": lambda gguf_path, threads, cache_dir: TransformersPeer(gguf_path, threads),
    "ort-genai": lambda gguf_path, threads, cache_dir: OrtGenaiPeer(gguf_path, threads, cache_dir),
    "ort-genai-int4": lambda gguf_path, threads, cache_dir: OrtGenaiPeer(gguf_path, threads, cache_dir, "int4"),
    "llama.cpp": lambda gguf_path, threads, cache_dir: LlamaCppPeer(gguf_path, threads),
}


def load_peer(name: str, gguf_path: str, threads: int, cache_dir: str) -> Peer:
    """Load a peer on the GGUF's float32 model (int4-quantized by ORT GenAI's builder for `ort-genai-int4`);
    raises PeerUnavailable if its packages are missing.

    `threads` is the intra-op thread count, as for our own runs; 0 leaves the peer's library default.

    Loading (and, for ort-genai, the first-time build) is not timed; `generate` is. The bench should warm
    each peer config up the same way it warms up its own runs.
    """
    if name not in PEERS:
        raise GenerationError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    if threads < 0:
        raise GenerationError(f"threads must be 0 (library default) or more, got {threads}")
    return PEERS[name](gguf_path, threads, cache_dir)
