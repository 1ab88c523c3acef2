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
    """The weights index at `path`, every entry checked for what the runtime reads of it: a bad one is a
    BundleError naming it (map_weights checks the entries against the weights file's size)."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise BundleError(f"weights index missing: {path}") from None
    except OSError as e:  # a directory, no permission
        raise BundleError(f"weights index {path} cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise BundleError(f"weights index {path} is corrupt ({e})") from None
    if not isinstance(raw, dict):
        raise BundleError(f"weights index {path} is corrupt: it holds a JSON {_json_type(raw)}, not an object")
    try:
        return {name: _weight_ref(name, v) for name, v in raw.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"weights index {path} is corrupt: {_what(e)}") from None


def _weight_ref(name: str, v) -> WeightRef:
    if not isinstance(v, dict):
        raise TypeError(f"entry {name!r} is a JSON {_json_type(v)}, not an object")
    missing = [k for k in ("dtype", "shape", "offset", "length") if k not in v]
    if missing:
        raise ValueError(f"entry {name!r} has no {', '.join(map(repr, missing))}")
    if not isinstance(v["dtype"], str):
        raise TypeError(f"entry {name!r}: dtype must be a string, not {v['dtype']!r}")
    if not isinstance(v["shape"], list):
        raise TypeError(f"entry {name!r}: shape must be a list of integers, not {v['shape']!r}")
    shape = tuple(_int(d, f"entry {name!r}: shape {v['shape']}: every dim", 0) for d in v["shape"])
    return WeightRef(name, v["dtype"], shape, _int(v["offset"], f"entry {name!r}: offset", 0),
                     _int(v["length"], f"entry {name!r}: length", 0))


def _int(value, what: str, low: int = 1) -> int:
    """An integer field, checked: int() would take "30" or 1.5 without a word, and JSON's true is an int to Python."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, not {value!r}")
    if value < low:
        raise ValueError(f"{what} must be at least {low}, not {value}")
    return value


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _what(e: Exception) -> str:
    """A parse error's text for a message: a KeyError's own text is only the quoted key."""
    return f"missing field {e.args[0]!r}" if isinstance(e, KeyError) and e.args else str(e)


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


def _model_from_json(path: str, name: str, d) -> ModelEntry:
    try:
        if not isinstance(d, dict):
            raise TypeError(f"it is a JSON {_json_type(d)}, not an object")
        dims = C.ModelDims.from_json(d)
        for k in C.ModelDims.__dataclass_fields__:  # the shapes of every buffer and graph input follow from them
            if k != "dtype":
                _int(getattr(dims, k), k)
        if not isinstance(d["graphs"], list):
            raise TypeError(f"graphs must be a list, not {d['graphs']!r}")
        graphs = [_graph_from_json(g, dims.context) for g in d["graphs"]]
        for k in ("family", "weights"):
            if not isinstance(d[k], str):
                raise TypeError(f"{k} must be a string, not {d[k]!r}")
        if not isinstance(d.get("quant"), (dict, type(None))):
            raise TypeError(f"quant must be an object, not {d['quant']!r}")
        entry = ModelEntry(dims=dims, family=d["family"], weights=d["weights"], graphs=graphs,
                           source=d.get("source", ""), layers_of=d.get("layers_of"), quant=d.get("quant"))
        entry.quant_spec  # a malformed quant record fails here, as a BundleError
        entry.session_config
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BundleError(f"{path} is corrupt: models.{name}: {_what(e)}") from None
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


def _graph_from_json(g, model_context: int) -> GraphEntry:
    if not isinstance(g, dict):
        raise TypeError(f"graph entry {g!r} is not an object")
    if not isinstance(g["file"], str) or not isinstance(g["role"], str):
        raise TypeError(f"graph entry {g!r}: file and role must be strings")
    where = f"graph {g['file']}:"
    if not isinstance(g.get("step_mask", False), bool):
        raise TypeError(f"{where} step_mask must be true or false, not {g['step_mask']!r}")
    batch = g.get("batch")
    return GraphEntry(_int(g["tokens"], f"{where} tokens"), g["role"], g["file"],
                      _int(g.get("context", model_context), f"{where} context"), g.get("step_mask", False),
                      None if batch is None else _int(batch, f"{where} batch"))


def load_manifest(bundle_dir: str) -> Manifest:
    path = os.path.join(bundle_dir, MANIFEST)
    if not os.path.isdir(bundle_dir):
        raise BundleError(f"{bundle_dir} is a file, not a bundle directory (export one with `specedge export`)"
                          if os.path.exists(bundle_dir) else f"bundle not found: {bundle_dir}")
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise BundleError(f"{bundle_dir} has no {MANIFEST} (not a specedge bundle)") from None
    except OSError as e:  # a directory, no permission
        raise BundleError(f"{path} cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise BundleError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise BundleError(f"{path} is corrupt: it holds a JSON {_json_type(d)}, not an object")
    if d.get("format") != FORMAT:
        raise BundleError(f"{path}: format is {d.get('format')!r}, expected {FORMAT!r}")
    version = d.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise BundleError(f"{path} is corrupt: version must be an integer, not {version!r}")
    if version not in READABLE_VERSIONS:
        raise BundleError(f"{path}: bundle version {version} is not supported (this specedge reads "
                          f"{', '.join(map(str, READABLE_VERSIONS))}; re-export the bundle with this specedge)")
    models = d.get("models") or {}
    if not isinstance(models, dict):
        raise BundleError(f"{path} is corrupt: models must be an object, not a JSON {_json_type(models)}")
    if "target" not in models:
        raise BundleError(f"{path}: no models.target")
    unknown = set(models) - set(MODEL_NAMES)
    if unknown:
        raise BundleError(f"{path}: unknown models {sorted(unknown)}")
    entries = {k: _model_from_json(path, k, v) for k, v in models.items()}
    try:  # what the runtime reads of the rest, checked here: a bad field is this one message, not a traceback later
        tok = d.get("tokenizer") or {}
        bos_id, eos_ids, files = tok.get("bos_id"), tok.get("eos_ids", []), tok.get("files", [])
        if not isinstance(eos_ids, list) or not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise TypeError("tokenizer.eos_ids must be a list of token ids, tokenizer.files a list of paths")
        for token in eos_ids:
            _int(token, "every tokenizer.eos_ids entry", 0)
        if bos_id is not None:
            _int(bos_id, "tokenizer.bos_id", 0)
        template = tok.get("chat_template")
        if not isinstance(template, (str, type(None))):
            raise TypeError(f"tokenizer.chat_template must be a string, not {template!r}")
        for k in ("export", "vocab"):
            if not isinstance(d.get(k, {}), dict):
                raise TypeError(f"{k} must be an object, not {d[k]!r}")
        manifest = Manifest(
            models=entries,
            tokenizer=TokenizerEntry(files=files, bos_id=bos_id, eos_ids=eos_ids, chat_template=template),
            opset=_int(d.get("opset", C.OPSET), "opset"), portable=bool(d.get("portable", True)),
            export=dict(d.get("export", {})), vocab=dict(d.get("vocab", {})),
        )
        for k in entries:
            manifest.logits_scale(k)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BundleError(f"{path} is corrupt: {_what(e)}") from None
    return manifest
