"""`specedge export`: freeze a target (and a draft) into a bundle of static step graphs.

The bundle appears atomically: everything is written into a temporary directory beside the destination and
renamed into place at the end; any error removes the temporary directory, so a failed export leaves
nothing behind.
"""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import onnx

from .. import __version__
from ..graphs import contract as C
from ..graphs import llama
from ..graphs.builder import GraphBuilder
from ..graphs.quant import DEFAULT_SMOOTH, QUANT_IR_VERSION, QUANT_OPSET, QuantSpec, parse_quant
from ..graphs.manifest import (GraphEntry, Manifest, ModelEntry, TokenizerEntry, WeightRef, graph_file,
                               read_index, weights_file, weights_index_file, write_index)
from ..errors import ExportError
from ..progress import Progress
from .sources import Source, open_source
from .weights import write_weights


@dataclass
class ExportOptions:
    context: int = 1024
    gammas: tuple[int, ...] = (1, 2, 4, 8)
    prefill_chunk: int = 64
    batch: int = 1
    dtype: str = "float32"
    context_buckets: tuple[int, ...] | None = None  # past lengths to export graphs for; None: default_buckets
    draft_layers: int | None = None  # cut a draft from the target's first N layers
    prefill_logits: bool = False  # give prefill graphs logits too (parity checks; slows prefill)
    step_mask: bool = False  # add the optional step_mask input to the step graphs (tree verification)
    tree_sizes: tuple[int, ...] = ()  # T of extra step graphs with step_mask: token trees of T-1 nodes
    quant: str = "none"  # weight-only quantization: none | int8 | int4
    quant_block: int | None = None  # input rows per scale (default: graphs/quant.py DEFAULT_BLOCK)
    quant_head: str | None = None  # the LM head's type under --quant: int8 (default) or int4
    quant_scheme: str | None = None  # symmetric (default), offset or rows (graphs/quant.py)
    quant_smooth: float | None = None  # SmoothQuant's alpha (default graphs/quant.py DEFAULT_SMOOTH; 0: none)
    flavour: str = "portable"  # one of FLAVOURS: how the contract is encoded for a target runtime
    # qnn-qdq16 and smoothed quantized bundles: JSONL prompts to calibrate on (default: the prompt suite), how many
    # of them (default export.qdq.DEFAULT_COUNT, export.smooth.DEFAULT_COUNT)
    calibration_prompts: str | None = None
    calibration_count: int | None = None
    jobs: int | None = None  # qnn-qdq16: graphs quantized at once in worker processes (default: qdq.default_jobs)
    extra: dict = field(default_factory=dict)

    def quant_spec(self) -> QuantSpec | None:
        try:
            return parse_quant(self.quant, self.quant_block, self.quant_head, self.quant_scheme, self.quant_smooth)
        except ValueError as e:
            raise ExportError(str(e)) from None

    def smoothed(self) -> bool:
        """Whether the export may calibrate activation ranges to smooth quantized weights (export/smooth.py)."""
        quant = self.quant_spec()
        return quant is not None and quant.smooth > 0

    def validate(self) -> None:
        if self.flavour not in FLAVOURS:
            raise ExportError(f"unknown flavour {self.flavour!r}; choose one of {', '.join(FLAVOURS)}")
        if self.flavour == "qnn-fp16" and (self.dtype != "float16" or self.quant != "none"):
            raise ExportError("--for qnn writes float16 graphs without --quant (the HTP computes float graphs in "
                              f"fp16 and QNN does not run weight-only int blocks); got --dtype {self.dtype} "
                              f"--quant {self.quant}")
        if self.flavour == "qnn-qdq16":
            if self.dtype != "float32" or self.quant != "none":
                raise ExportError("--for qnn-qdq16 quantizes float32 graphs itself (uint16 activations, int8 weights); "
                                  f"it takes neither --dtype float16 nor --quant: got --dtype {self.dtype} --quant {self.quant}")
        elif self.jobs is not None:  # only the qdq16 flavour quantizes graphs; the others write them in seconds
            raise ExportError(f"--jobs applies only to --for qnn-qdq16, which quantizes in worker processes; this "
                              f"export is the {self.flavour} flavour")
        elif (self.calibration_prompts is not None or self.calibration_count is not None) and not self.smoothed():
            raise ExportError("the calibration settings apply only to --for qnn-qdq16 and to smoothed quantized "
                              "bundles (--quant int8/int4, --quant-smooth above 0), the exports that calibrate")
        if self.calibration_count is not None and self.calibration_count < 1:
            raise ExportError(f"the calibration needs at least one prompt, not {self.calibration_count}")
        if self.jobs is not None and self.jobs < 1:
            raise ExportError(f"--jobs must be at least 1, not {self.jobs}")
        if self.dtype not in C.DTYPES:
            raise ExportError(f"--dtype must be one of {', '.join(C.DTYPES)}, not {self.dtype}")
        if self.quant_spec() is not None and self.dtype != "float32":
            raise ExportError(f"--quant {self.quant} needs --dtype float32: onnxruntime's CPU kernel for quantized "
                              "weights (MatMulNBits) runs float32 activations; float16 activations are not supported yet")
        if self.batch < 1:
            raise ExportError(f"--batch must be at least 1, not {self.batch}")
        if self.prefill_chunk < 1:
            raise ExportError(f"--prefill-chunk must be at least 1, not {self.prefill_chunk}")
        if self.context <= self.prefill_chunk:
            raise ExportError(f"--context ({self.context}) must be larger than --prefill-chunk ({self.prefill_chunk})")
        if not self.gammas or min(self.gammas) < 1:
            raise ExportError(f"every --gamma must be at least 1, got {','.join(map(str, self.gammas)) or 'none'}")
        if max(self.gammas) + 1 >= self.context:
            raise ExportError(f"--gamma {max(self.gammas)} needs a context larger than {max(self.gammas) + 1}")
        if any(t < 2 or t + 1 >= self.context for t in self.tree_sizes):
            raise ExportError(f"every --tree size must be at least 2 (the pending token and one node) and at most "
                              f"--context - 2 ({self.context - 2}), got {','.join(map(str, self.tree_sizes))}")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ExportError(f"--draft-layers must be at least 1, not {self.draft_layers}")
        for b in self.context_buckets or ():
            if not self.prefill_chunk <= b <= self.context:
                raise ExportError(f"every --context-buckets value must lie between --prefill-chunk "
                                  f"({self.prefill_chunk}) and --context ({self.context}), got {b}")

    def buckets(self) -> list[int]:
        """Past lengths with graphs: the runtime attends over the smallest one that holds the cache."""
        if self.context_buckets:
            return sorted({*self.context_buckets, self.context})
        return default_buckets(self.context, self.prefill_chunk)

    def prefill_sizes(self) -> list[int]:
        """The prefill chunk, then a half and a quarter of it for a prompt's tail, while they are longer than
        the largest step graph (gamma+1): a prefill run costs nearly as much per padded row as per real one
        (SmolLM2 float32, 2 cores: T=64 83 ms, T=32 46 ms, T=16 28 ms), so a 20-token tail in a 64-row graph
        would waste 50 ms. The runtime plans a prompt over these and the step graphs (runtime/prefill_plan.py)."""
        tails = [self.prefill_chunk // 2, self.prefill_chunk // 4]
        return [self.prefill_chunk] + [t for t in tails if t > max(self.gammas) + 1]

    def target_steps(self) -> list[int]:
        return sorted({1, *(g + 1 for g in self.gammas)})

    @staticmethod
    def draft_steps() -> list[int]:
        return [1, 2]  # T=2: after a fully accepted round the draft catches up on two tokens


# Graph flavours. "qnn-fp16": the portable graphs in float16 for Qualcomm's HTP (onnxruntime's QNN EP): the HTP has
# no float32 datapath (a float32 graph is computed in fp16 there anyway), and float16 halves the weights file and
# the host-side cache. Its RMSNorms divide by the row's max |x| before squaring: SmolLM2's residual stream reaches
# |x| ~ 2.5e4, whose square overflows fp16 (the plain graph then gives 0/16 top-1 agreement on the HTP emulator).
# Every node of these graphs is placed on the HTP (tests/test_qnn.py).
# "qnn-qdq16": the float32 graphs (opset 21, a mask of export.qdq.MASK_VALUE) calibrated on real prompts and
# quantized to QDQ, uint16 activations and int8 per-channel weights, float32 I/O (export/qdq.py,
# tests/test_qnn_qdq.py).
FLAVOURS = ("portable", "qnn-fp16", "qnn-qdq16")


def flavour_record(opts: ExportOptions, calibration: dict | None = None,
                   logits_scale: dict[str, float] | None = None) -> dict | None:
    """What the manifest says about a runtime-specific flavour (export.qnn); None for the portable one.
    `calibration`: what export.qdq.quantize_bundle reports, `logits_scale`: export.qdq.logits_scales (qnn-qdq16)."""
    if opts.flavour == "qnn-qdq16":
        from .qdq import ACTIVATIONS, MASK_VALUE, WEIGHTS

        return {"precision": "qdq16", "activations": ACTIVATIONS, "weights": f"{WEIGHTS} symmetric, per output "
                "channel (MatMul); per tensor elsewhere", "io": "float32 (QDQ inside the graph)",
                "calibration": calibration, "soc_model": None, "backend": "htp", "mask_value": MASK_VALUE,
                "float": "residual adds and RMSNorm statistics (fp16 on the HTP)",
                "tool": "onnxruntime.quantization (get_qnn_qdq_config, MinMax)", "logits_scale": logits_scale}
    if opts.flavour != "qnn-fp16":
        return None
    # soc_model None: the graphs are not tied to one SoC; the runtime compiles them for the HTP it finds (the
    # x86 emulator needs one named: SPECEDGE_QNN_SOC_MODEL, default 60) and caches the binary per SoC.
    return {"precision": "fp16", "activations": "float16", "weights": "float16", "calibration": None,
            "soc_model": None, "backend": "htp", "rms_norm": "scaled by the row's max |x| (fp16 range)"}


def default_buckets(context: int, prefill_chunk: int) -> list[int]:
    """Past lengths to export graphs for: every 128 slots up to 512, then every quarter of the context (1024:
    128, 256, 384, 512, 768, 1024). A step attends over its whole bucket, padding included, and with int4 weights
    that padding is a visible part of a short-context step (SmolLM2 int4 T=1, 2 threads, cache 100: 8.1 ms over
    128 slots, 8.8 over 256, 10.1 over 512; ORT GenAI int4 7.4 ms), so short caches get finer buckets."""
    fine = max(128, prefill_chunk)
    coarse = max(fine, -(-context // 4))
    buckets = set(range(fine, min(4 * fine, context) + 1, fine)) | set(range(coarse, context, coarse))
    return sorted(b for b in buckets if b < context) + [context]


def check_vocab(target: Source, draft: Source) -> dict:
    """A draft must tokenize like the target: the same token for every id both know."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    tt, dt = target.vocab_tokens(), draft.vocab_tokens()
    if tt is None or dt is None:
        raise ExportError("cannot compare draft and target vocabularies: a tokenizer is missing from "
                          f"{target.path if tt is None else draft.path}")
    for i in range(min(len(tt), len(dt))):
        if tt[i] != dt[i]:
            raise ExportError(f"draft and target vocabularies differ at id {i} ({dt[i]!r} vs {tt[i]!r}); "
                              "a draft must share the target's tokenizer")
    if len(dt) > tv:
        raise ExportError(f"the draft's tokenizer has {len(dt)} tokens, more than the target's LM head ({tv})")
    return {"target": tv, "draft": dv, "tokens_compared": min(len(tt), len(dt)), "match": "token strings"}


def _write_graph(bundle: str, model: str, cfg: llama.LlamaConfig, dims: C.ModelDims, role: str, tokens: int,
                 context: int, refs: dict[str, WeightRef], weights: str, step_mask: bool,
                 quant: QuantSpec | None, scaled_norm: bool = False, qdq: bool = False,
                 rows: int | None = None) -> GraphEntry:
    """rows: 1 for a row graph of a batch model (prefill or step of one row at a time)."""
    if rows is not None:
        dims = replace(dims, batch=rows)
    # qdq: the float graph that export.qdq quantizes (opset 21: standard-domain uint16 QuantizeLinear)
    opset, ir = (QUANT_OPSET, QUANT_IR_VERSION) if quant or qdq else (C.OPSET, 8)
    g = GraphBuilder(f"{model}_{role}{tokens}_s{context}", refs, weights, opset=opset, ir_version=ir)
    mask_value = None
    if qdq:
        from .qdq import MASK_VALUE as mask_value
    llama.build_step_graph(cfg, dims, tokens, role, g, step_mask=step_mask and role == C.STEP, context=context,
                           quant=quant, scaled_norm=scaled_norm, mask_value=mask_value,
                           same_ops=qdq or scaled_norm,  # both QNN flavours: the HTP rounds other ops differently
                           matmul_head=qdq)
    mask = step_mask and role == C.STEP
    entry = GraphEntry(tokens=tokens, role=role, file=graph_file(model, role, tokens, context, mask, rows),
                       context=context, step_mask=mask, batch=rows)
    onnx.save(g.build(), os.path.join(bundle, entry.file))
    return entry


def _row_steps(opts: ExportOptions) -> list[int]:
    """T of a batch target's row step graphs: its chain step graphs (with --prefill-logits, those that are not
    prefill graphs too)."""
    prefills = set(opts.prefill_sizes()) if opts.prefill_logits else set()
    return [t for t in opts.target_steps() if t not in prefills]


def _export_model(bundle: str, name: str, src: Source, opts: ExportOptions, steps: list[int],
                  progress: Progress, shared: tuple[str, dict[str, WeightRef]] | None = None,
                  num_layers: int | None = None, calibration: Callable[[], tuple[list[list[int]], dict]] | None = None
                  ) -> ModelEntry:
    """`calibration()`: (windows of token ids, their record) to smooth the model with (export/smooth.py)."""
    cfg = src.config
    dims = cfg.dims(opts.context, opts.batch, opts.dtype, num_layers)
    quant = opts.quant_spec()
    # By default a bundle keeps the source's own 4-bit blocks (GGUF Q4_0) where it can store them as they are,
    # and smooths every other product (llama.keeps_source_blocks); --quant-smooth smooths (and requantizes) all.
    keep_native = bool(quant and quant.smooth and opts.quant_smooth is None)
    if keep_native and llama.keeps_every_product(cfg, quant, src.blocks):
        if opts.calibration_prompts is not None or opts.calibration_count is not None:
            raise ExportError(f"{os.path.basename(src.path)}'s quantized blocks are copied as they are stored, "
                              "unsmoothed, so the calibration settings would go unused: add --quant-smooth "
                              f"{DEFAULT_SMOOTH} to smooth (and requantize) them, or leave those settings out")
        quant = replace(quant, smooth=0.0)
    quant_record = None
    if shared is None:
        weights = weights_file(name)
        report = llama.QuantReport()
        matmul_head = opts.flavour == "qnn-qdq16"  # the QDQ flavour's head is a MatMul weight of its own
        ranges = None
        if quant and quant.smooth:
            from .smooth import activation_ranges
            ranges = activation_ranges(cfg, src.tensor, calibration()[0])
        refs = write_weights(os.path.join(bundle, weights),
                             llama.graph_weights(cfg, opts.context, opts.dtype, src.tensor, quant=quant,
                                                 native=src.blocks, report=report, matmul_head=matmul_head,
                                                 act_ranges=ranges, keep_native=keep_native),
                             on_tensor=progress.update)
        if not (quant or matmul_head):  # the float Gemm head reads its table in parts
            refs.update(llama.head_parts(cfg, refs))
        write_index(os.path.join(bundle, weights_index_file(weights)), refs)
        if quant:
            quant_record = {**quant.to_json(), "source": report.to_json()}
            if quant.smooth:
                quant_record["smoothing"] = calibration()[1]
    else:
        weights, refs, quant_record = shared
    prefill_role = C.STEP if opts.prefill_logits else C.PREFILL
    prefills = opts.prefill_sizes()
    plan = [(prefill_role, t, False) for t in prefills]
    # The target verifies trees (a draft never does). A tree size that is also a chain size gets one graph,
    # with the mask (chains run in it with a causal mask): (role, T, context) names one graph per model.
    trees = set(opts.tree_sizes) if name == "target" else set()
    plan += [(C.STEP, t, opts.step_mask or t in trees) for t in steps if not (prefill_role == C.STEP and t in prefills)]
    plan += [(C.STEP, t, True) for t in sorted(trees - set(steps))]
    # A batch model also prefills one row at a time (manifest version 3): a batch prefill chunk computes every
    # row, so a prompt arriving alone would pay for B.
    row_plan = [(C.PREFILL, t) for t in prefills] if opts.batch > 1 and prefill_role == C.PREFILL and shared is None else []
    # And the target decodes and verifies one row alone when no other row runs (version 4): a batch step
    # computes every row, so a lone request would pay for B. Chains only: batches verify no trees.
    if opts.batch > 1 and name == "target":
        row_plan += [(C.STEP, t) for t in _row_steps(opts)]
    graphs = []
    for context in opts.buckets():
        for role, tokens, mask in plan:
            graphs.append(_write_graph(bundle, name, cfg, dims, role, tokens, context, refs, weights, mask, quant,
                                       scaled_norm=opts.flavour in ("qnn-fp16", "qnn-qdq16"), qdq=opts.flavour == "qnn-qdq16"))
            progress.update(graphs[-1].file)
        for role, tokens in row_plan:
            graphs.append(_write_graph(bundle, name, cfg, dims, role, tokens, context, refs, weights, False, quant,
                                       scaled_norm=opts.flavour in ("qnn-fp16", "qnn-qdq16"), qdq=opts.flavour == "qnn-qdq16",
                                       rows=1))
            progress.update(graphs[-1].file)
    return ModelEntry(dims=dims, family=cfg.family, weights=weights, graphs=graphs,
                      source=os.path.basename(os.path.normpath(src.path)),
                      layers_of="target" if shared is not None else None, quant=quant_record)


def _smoothing_calibration(tmp: str, tokenizer, opts: ExportOptions) -> tuple[list[list[int]], dict]:
    """The token windows a quantized bundle's smoothing calibrates on (export/smooth.py), from the calibration
    prompts read with the tokenizer just written to `tmp`, and the manifest's record of them."""
    from ..runtime.tokenizer import Tokenizer
    from .qdq import DEFAULT_PROMPTS, load_prompt_ids
    from .smooth import DEFAULT_COUNT, WINDOW, calibration_windows

    path = os.path.join(tmp, "tokenizer", "tokenizer.json")
    reader = Tokenizer(path, tokenizer.bos_id, tokenizer.chat_template) if os.path.isfile(path) else None
    prompts_file = opts.calibration_prompts or DEFAULT_PROMPTS
    prompts = load_prompt_ids(prompts_file, reader, opts.calibration_count or DEFAULT_COUNT)
    windows = calibration_windows(prompts, min(WINDOW, opts.context))
    return windows, {"alpha": opts.quant_spec().smooth, "prompts": os.path.basename(prompts_file),
                     "prompt_count": len(prompts), "tokens": sum(map(len, windows))}


def _read_sources(target_path: str, draft_path: str | None, opts: ExportOptions):
    """Open the target (and draft) and check them against the options before anything is written:
    -> (target, draft or None, the manifest's vocab record, the target's tokenizer)."""
    target = open_source(target_path)
    try:
        target.config.check(opts.context)
    except llama.UnsupportedModel as e:
        raise ExportError(f"{target_path}: {e}") from None
    target.check_shapes()
    draft = None
    vocab = {"target": target.config.vocab_size}
    if draft_path:
        draft = open_source(draft_path)
        try:
            draft.config.check(opts.context)
        except llama.UnsupportedModel as e:
            raise ExportError(f"draft {draft_path}: {e}") from None
        draft.check_shapes()
        vocab = check_vocab(target, draft)
    if opts.draft_layers is not None:
        if opts.draft_layers >= target.config.num_layers:
            raise ExportError(f"--draft-layers {opts.draft_layers} must be below the target's {target.config.num_layers} layers")
        vocab = {"target": target.config.vocab_size, "draft": target.config.vocab_size, "match": "same model"}
    tokenizer = target.tokenizer()
    return target, draft, vocab, tokenizer


def export_bundle(target_path: str, out: str, opts: ExportOptions, draft_path: str | None = None,
                  force: bool = False, progress: bool = True) -> Manifest:
    opts.validate()
    if draft_path and opts.draft_layers:
        raise ExportError("give either --draft or --draft-layers, not both")
    out = os.path.abspath(out)
    if os.path.exists(out) and not force:
        raise ExportError(f"output {out} exists (use --force to replace it)")
    try:
        target, draft, vocab, tokenizer = _read_sources(target_path, draft_path, opts)
    except OSError as e:  # a model file that cannot be read (permissions, an I/O error): one line, not a traceback
        raise ExportError(f"cannot read {e.filename or target_path}: {e.strerror or e}") from None

    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    except OSError as e:
        raise ExportError(f"cannot write a bundle at {out}: {e.strerror or e}") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the bundle should look like any directory
    quant = opts.quant_spec()
    head = opts.flavour == "qnn-qdq16"
    n_weights = len(llama.weight_names(target.config, quant, head)) + (len(llama.weight_names(draft.config, quant, head))
                                                                       if draft else 0)
    n_prefill = len(opts.prefill_sizes())
    trees = set(opts.tree_sizes) - set(opts.target_steps())
    rows = n_prefill if opts.batch > 1 and not opts.prefill_logits else 0  # row prefill graphs per own-cache model
    row_steps = len(_row_steps(opts)) if opts.batch > 1 else 0
    n_graphs = len(opts.buckets()) * (n_prefill + len(opts.target_steps()) + len(trees) + rows + row_steps
                                      + ((n_prefill + len(opts.draft_steps())) if (draft or opts.draft_layers) else 0)
                                      + (rows if draft else 0))
    qdq = opts.flavour == "qnn-qdq16"
    bar = Progress(n_weights + n_graphs * (3 if qdq else 1), "export", "step", progress)  # qdq: calibrate, quantize
    started = time.time()
    try:
        tok_files = []
        if tokenizer.files:
            os.makedirs(os.path.join(tmp, "tokenizer"))
            for fname, content in tokenizer.files.items():
                with open(os.path.join(tmp, "tokenizer", fname), "wb") as f:
                    f.write(content)
                tok_files.append(f"tokenizer/{fname}")
        calibration = functools.cache(lambda: _smoothing_calibration(tmp, tokenizer, opts))  # read when needed
        models = {"target": _export_model(tmp, "target", target, opts, opts.target_steps(), bar,
                                          calibration=calibration)}
        if draft is not None:
            models["draft"] = _export_model(tmp, "draft", draft, opts, opts.draft_steps(), bar,
                                            calibration=calibration)
        elif opts.draft_layers is not None:
            t = models["target"]
            shared = (t.weights, read_index(os.path.join(tmp, weights_index_file(t.weights))), t.quant)
            models["draft"] = _export_model(tmp, "draft", target, opts, opts.draft_steps(), bar,
                                            shared=shared, num_layers=opts.draft_layers)
        manifest = Manifest(
            models=models,
            tokenizer=TokenizerEntry(files=tok_files, bos_id=tokenizer.bos_id, eos_ids=tokenizer.eos_ids,
                                     chat_template=tokenizer.chat_template),
            vocab=vocab,
            opset=QUANT_OPSET if quant or qdq else C.OPSET,
            export={"specedge": __version__, "context": opts.context, "gammas": list(opts.gammas),
                    "prefill_chunk": opts.prefill_chunk, "context_buckets": opts.buckets(), "batch": opts.batch,
                    "dtype": opts.dtype, "quant": opts.quant, "quant_block": quant.block if quant else None,
                    "quant_head": f"int{quant.head_bits}" if quant else None,
                    "quant_scheme": quant.scheme if quant else None,
                    "draft_layers": opts.draft_layers, "prefill_logits": opts.prefill_logits,
                    "step_mask": opts.step_mask, "tree_sizes": sorted(set(opts.tree_sizes)), "flavour": opts.flavour, "qnn": flavour_record(opts),
                    "target": os.path.basename(os.path.normpath(target_path)),
                    "draft": os.path.basename(os.path.normpath(draft_path)) if draft_path else None,
                    "seconds": None},
        )
        if qdq:  # calibrate on the float32 graphs just written, then replace them with their QDQ graphs
            from .qdq import Calibration, logits_scales, quantize_bundle

            manifest.save(tmp)
            calibration = Calibration(**{k: v for k, v in (("prompts", opts.calibration_prompts),
                                                           ("count", opts.calibration_count)) if v is not None})
            record = quantize_bundle(tmp, manifest, calibration, bar, opts.jobs)
            manifest.export["qnn"] = flavour_record(opts, record, logits_scales(tmp, manifest))
        manifest.export["seconds"] = round(time.time() - started, 1)
        manifest.save(tmp)
        bar.close()
        if os.path.exists(out):
            _replace(tmp, out, parent)
        else:
            os.rename(tmp, out)
        return manifest
    except BaseException as e:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, a quota, a source file gone: one line, not a traceback
            where = f" ({e.filename})" if e.filename else ""
            raise ExportError(f"export to {out} failed: {e.strerror or e}{where}") from None
        raise


def _replace(tmp: str, out: str, parent: str) -> None:
    """--force: move the old bundle aside, the new one in, then delete the old one. If a rename fails, the old
    bundle stays at `out` (put back if it had moved) and the folder it was moved into goes."""
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
    kept = os.path.join(old, "bundle")
    try:
        os.rename(out, kept)
    except OSError as e:
        os.rmdir(old)
        raise ExportError(f"cannot replace {out}: {e.strerror or e}") from None
    try:
        os.rename(tmp, out)
    except OSError as e:
        try:
            os.rename(kept, out)
            os.rmdir(old)
        except OSError:  # neither bundle can go to `out`: say where the old one is rather than delete it
            raise ExportError(f"cannot replace {out}: {e.strerror or e}; the old bundle is now {kept}") from None
        raise ExportError(f"cannot replace {out}: {e.strerror or e}") from None
    shutil.rmtree(old, ignore_errors=True)
