"""The bundle's manifest.json and weights index: one definition, read by the runtime and the checker,
written by the exporter. Needs nothing but the standard library (the runtime imports it).

A bundle is a flat directory:

  manifest.json                 this file's schema (FORMAT, VERSION)
  target.weights.bin            raw tensors of the target, shared by all its graphs (external data)
  target.weights.json           {name: {dtype, shape, offset, length}} for target.weights.bin
  target.prefill64.s256.onnx    one static graph per role, token count T and past length (context bucket)
  target.step1.s256.onnx, target.step5.s1024.onnx, ...
  draft.*                       the same for the draft (a layer draft reuses target.weights.bin)
  tokenizer/tokenizer.json ...  tokenizer files, when the source had them
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace

from ..errors import BundleError
from . import contract as C

FORMAT = "specedge-bundle"
# 2: attention became position-consistent (a T-token step reproduces T one-token steps bit for bit, so greedy
# speculation is exact on quantized graphs too); it needs cache_len + T <= S, and version-1 graphs do not
# keep speculative output equal to plain output. Re-exporting a version-1 bundle takes seconds.
# 3: a model exported with --batch B > 1 also has prefill graphs of batch 1 ("batch": 1 in their graph entry),
# which prefill one row of the batch cache at a time (bound to that row's slice of the buffers): a batch
# prefill chunk computes every row, idle ones included. Version-2 bundles have no such graphs and read as before.
# 4: a batch model's target also has step graphs of batch 1 (role "step", "batch": 1), which decode and verify
# one row alone when no other row runs: a batch step computes every row, so a lone request paid for B. A
# version-3 reader would take them for prefill graphs, hence the bump; version-3 bundles read as before.
VERSION = 4
READABLE_VERSIONS = (2, 3, 4)
MANIFEST = "manifest.json"
MODEL_NAMES = ("target", "draft")


def graph_file(model: str, role: str, tokens: int, context: int, step_mask: bool = False,
               batch: int | None = None) -> str:
    rows = f".b{batch}" if batch is not None else ""
    return f"{model}.{'tree' if step_mask else role}{tokens}{rows}.s{context}.onnx"


def weights_file(model: str) -> str:
    return f"{model}.weights.bin"


def weights_index_file(weights: str) -> str:
    return weights[: -len(".bin")] + ".json" if weights.endswith(".bin") else weights + ".json"


@dataclass(frozen=True)
class WeightRef:
    """Where one tensor lives inside a weights file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset, "length": self.length}


def write_index(path: str, refs: dict[str, WeightRef]) -> None:
    with open(path, "w") as f:
        json.dump({name: ref.to_json() for name, ref in refs.items()}, f, indent=0)


def read_index(path: str) -> dict[str, WeightRef]:
    try:
        with open(path) as f:
            raw = json.load(f)
        return {n: WeightRef(n, v["dtype"], tuple(v["shape"]), int(v["offset"]), int(v["length"])) for n, v in raw.items()}
    except FileNotFoundError:
        raise BundleError(f"weights index missing: {path}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"weights index {path} is corrupt ({e})") from None


@dataclass(frozen=True)
class GraphEntry:
    tokens: int  # T
    role: str  # contract.PREFILL | contract.STEP
    file: str
    context: int  # the past length this graph reads: a context bucket <= the model's context
    step_mask: bool = False
    batch: int | None = None  # 1: a row graph of a batch model (one row's prefill or step); None: the model's batch

    def to_json(self) -> dict:
        d = asdict(self)
        if self.batch is None:
            del d["batch"]
        return d


@dataclass
class ModelEntry:
    dims: C.ModelDims
    family: str
    weights: str  # relative path of the raw weights file
    graphs: list[GraphEntry]
    source: str = ""
    layers_of: str | None = None  # "target" for a draft cut from the target's first layers
    quant: dict | None = None  # weight-only quantization record (graphs/quant.py QuantSpec.to_json + source report)

    @property
    def session_config(self) -> dict[str, str]:
        """onnxruntime session config entries this model's graphs need (empty for float graphs)."""
        return dict((self.quant or {}).get("onnxruntime_session_config", {}))

    @property
    def quant_spec(self):
        from .quant import QuantSpec
        return QuantSpec.from_json(self.quant) if self.quant else None

    @property
    def batch_graphs(self) -> list[GraphEntry]:
        """The graphs of the model's batch (all of them but the row graphs)."""
        return [g for g in self.graphs if g.batch is None]

    def graph(self, role: str, tokens: int, context: int | None = None, tree: bool = False) -> GraphEntry | None:
        """The graph of a role and T at a context bucket (the full context when None); one per (role, T,
        context). tree: only if it has the step_mask input (a chain runs in either kind: the runtime feeds a
        masked graph the causal mask)."""
        context = context or self.dims.context
        return next((g for g in self.batch_graphs if (g.role, g.tokens, g.context) == (role, tokens, context)
                     and (g.step_mask or not tree)), None)

    def row_graph(self, role: str, tokens: int, context: int) -> GraphEntry | None:
        """The batch-1 graph of a role and T at a context bucket (batch models: prefill since version 3, step
        since version 4)."""
        key = (role, tokens, context)
        return next((g for g in self.graphs if g.batch == 1 and (g.role, g.tokens, g.context) == key), None)

    def row_prefill_tokens(self) -> list[int]:
        """T of the row prefill graphs, largest first (none for a batch-1 model)."""
        return sorted({g.tokens for g in self.graphs if g.batch == 1 and g.role == C.PREFILL}, reverse=True)

    def row_step_tokens(self) -> list[int]:
        """T of the row step graphs, smallest first (none for a batch-1 model or before version 4)."""
        return sorted({g.tokens for g in self.graphs if g.batch == 1 and g.role == C.STEP})

    def graph_dims(self, graph: GraphEntry) -> C.ModelDims:
        """The dims a graph's inputs and outputs follow (a row graph: batch 1)."""
        return self.dims if graph.batch is None else replace(self.dims, batch=graph.batch)

    def step_tokens(self) -> list[int]:
        return sorted({g.tokens for g in self.batch_graphs if g.role == C.STEP})

    def tree_tokens(self) -> list[int]:
        """T of the step graphs that verify token trees (root + T-1 nodes)."""
        return sorted({g.tokens for g in self.batch_graphs if g.role == C.STEP and g.step_mask})

    def buckets(self) -> list[int]:
        return sorted({g.context for g in self.graphs})

    def prefill_tokens(self) -> list[int]:
        """The token counts of the prefill graphs, largest first (the chunk, then smaller tail sizes)."""
        return sorted({g.tokens for g in self.batch_graphs if g.role == C.PREFILL}, reverse=True)

    def to_json(self) -> dict:
        d = {"family": self.family, **self.dims.to_json(), "weights": self.weights,
             "weights_index": weights_index_file(self.weights),
             "graphs": [g.to_json() for g in self.graphs], "source": self.source}
        if self.layers_of:
            d["layers_of"] = self.layers_of
        if self.quant:
            d["quant"] = self.quant
        return d


@dataclass
class TokenizerEntry:
    files: list[str] = field(default_factory=list)
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None


@dataclass
class Manifest:
    models: dict[str, ModelEntry]
    tokenizer: TokenizerEntry
    opset: int = C.OPSET
    portable: bool = True  # standard ONNX domain only, no runtime-specific ops
    export: dict = field(default_factory=dict)  # the exporter settings that produced the bundle
    vocab: dict = field(default_factory=dict)  # target/draft vocab sizes and how they were matched

    @property
    def target(self) -> ModelEntry:
        return self.models["target"]

    @property
    def draft(self) -> ModelEntry | None:
        return self.models.get("draft")

    def draft_of(self, model: ModelEntry) -> ModelEntry | None:
        """The target, when `model` is this bundle's draft; else None. A draft's rows only propose (the target's
        verify step judges them), so it is planned, checked and described apart (runtime/kernel_probe.row_plan)."""
        return None if model is self.target else self.target

    def logits_scale(self, model: str) -> float | None:
        """The quantization step of a model's logits, when its graphs return logits on a uint16 grid (the
        qnn-qdq16 flavour: export.qnn.logits_scale); a runtime snaps them onto it (docs/bundle.md)."""
        scale = ((self.export.get("qnn") or {}).get("logits_scale") or {}).get(model)
        return float(scale) if scale else None

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "opset": self.opset, "portable": self.portable,
                "models": {k: m.to_json() for k, m in self.models.items()},
                "tokenizer": asdict(self.tokenizer), "vocab": self.vocab, "export": self.export}

    def save(self, bundle_dir: str) -> None:
        with open(os.path.join(bundle_dir, MANIFEST), "w") as f:
            json.dump(self.to_json(), f, indent=2)


def _model_from_json(name: str, d: dict) -> ModelEntry:
    try:
        dims = C.ModelDims.from_json(d)
        graphs = [GraphEntry(int(g["tokens"]), g["role"], g["file"], int(g.get("context", d["context"])),
                             bool(g.get("step_mask", False)), None if g.get("batch") is None else int(g["batch"]))
                  for g in d["graphs"]]
        entry = ModelEntry(dims=dims, family=d["family"], weights=d["weights"], graphs=graphs,
                           source=d.get("source", ""), layers_of=d.get("layers_of"), quant=d.get("quant"))
        entry.quant_spec  # a malformed quant record fails here, as a BundleError
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"manifest: model '{name}' is malformed ({type(e).__name__}: {e})") from None
    if dims.dtype not in C.DTYPES:
        raise BundleError(f"manifest: model '{name}' has dtype {dims.dtype}, expected one of {C.DTYPES}")
    for g in graphs:
        if g.role not in C.ROLES or g.tokens < 1 or not 0 < g.context <= dims.context:
            raise BundleError(f"manifest: model '{name}' graph {g.file} has role {g.role!r}, tokens {g.tokens}, "
                              f"context {g.context} (model context {dims.context})")
    for g in graphs:
        if g.batch is not None and (g.batch != 1 or dims.batch == 1 or g.step_mask):
            raise BundleError(f"manifest: model '{name}' graph {g.file} has batch {g.batch}: only graphs of batch 1 "
                              f"without a step mask, in a model of batch > 1, may set it")
    keys = [(g.role, g.tokens, g.context, g.batch) for g in graphs]
    if len(set(keys)) != len(keys):
        role, tokens, context, _ = next(k for k in keys if keys.count(k) > 1)
        raise BundleError(f"manifest: model '{name}' lists two graphs for role {role}, T={tokens}, context {context}")
    if not any(g.role == C.STEP and g.tokens == 1 and g.context == dims.context for g in graphs):
        raise BundleError(f"manifest: model '{name}' has no T=1 step graph over its full context")
    return entry


def load_manifest(bundle_dir: str) -> Manifest:
    path = os.path.join(bundle_dir, MANIFEST)
    if not os.path.isdir(bundle_dir):
        raise BundleError(f"bundle not found: {bundle_dir}")
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise BundleError(f"{bundle_dir} has no {MANIFEST} (not a specedge bundle)") from None
    except ValueError as e:
        raise BundleError(f"{path} is not valid JSON ({e})") from None
    if d.get("format") != FORMAT:
        raise BundleError(f"{path}: format is {d.get('format')!r}, expected {FORMAT!r}")
    if d.get("version") not in READABLE_VERSIONS:
        raise BundleError(f"{path}: bundle version {d.get('version')} is not supported (this specedge reads "
                          f"{', '.join(map(str, READABLE_VERSIONS))}; re-export the bundle with this specedge)")
    models = d.get("models") or {}
    if "target" not in models:
        raise BundleError(f"{path}: no models.target")
    unknown = set(models) - set(MODEL_NAMES)
    if unknown:
        raise BundleError(f"{path}: unknown models {sorted(unknown)}")
    tok = d.get("tokenizer") or {}
    return Manifest(
        models={k: _model_from_json(k, v) for k, v in models.items()},
        tokenizer=TokenizerEntry(files=list(tok.get("files", [])), bos_id=tok.get("bos_id"),
                                 eos_ids=list(tok.get("eos_ids", [])), chat_template=tok.get("chat_template")),
        opset=int(d.get("opset", C.OPSET)), portable=bool(d.get("portable", True)),
        export=dict(d.get("export", {})), vocab=dict(d.get("vocab", {})),
    )
