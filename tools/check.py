"""`specedge check BUNDLE`: does the bundle hold what its manifest says, in the portable form?

For every graph: the file parses; its I/O names, dtypes and shapes are exactly the contract's for its
model dims, T and role; every dim is a number; every node is in the standard ONNX domain at the declared
opset; onnx.checker's full check passes; every initializer stored outside the graph points into the
model's weights file at the offset, length, dtype and shape of the weights index; and onnxruntime loads
the graph and runs it once on zeros with outputs of the contract's shapes. Then, per model, the graphs'
rows are checked for position consistency (tools/exact_rows.py): every T-token graph bitwise equal to T
one-token steps (a tree graph also for a token tree's rows), every bucket's one-token graph equal to the
smallest bucket's.

With backend "qnn" the load-and-run check runs on onnxruntime's QNN execution provider (the HTP, or its x86
emulator) with CPU fallback disabled, and reports per graph whether every node is placed on QNN, read from
onnxruntime's graph-assignment record. The exact-rows check runs there only when asked (`exact_rows=True`,
`--exact-rows`): it runs T decode steps per graph, minutes per graph for SmolLM2 on the x86 emulator; on a
device it is the check that matters (the HTP rounds differently from the CPU). A qnn-qdq16
bundle's logits grid (the scale its step graphs dequantize logits with) is checked against the manifest, and
its rows are compared on that grid, as the runtime reads them.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import BundleError
from ..graphs import contract as C
from ..graphs.llama import MATRICES
from ..graphs.manifest import GraphEntry, ModelEntry, load_manifest, read_index, weights_index_file
from ..runtime import kernel_probe
from ..runtime.exactness import ONNXRUNTIME_CPU, flavour

_ONNX_TO_NP = {1: "float32", 10: "float16", 7: "int64", 6: "int32", 9: "bool", 3: "int8", 22: "int4", 2: "uint8",
               4: "uint16", 5: "int16"}


@dataclass
class Report:
    lines: list[tuple[bool, str]] = field(default_factory=list)

    def add(self, ok: bool, text: str) -> bool:
        self.lines.append((ok, text))
        return ok

    @property
    def ok(self) -> bool:
        return all(ok for ok, _ in self.lines)

    def render(self) -> str:
        body = "\n".join(f"  {'ok  ' if ok else 'FAIL'}  {text}" for ok, text in self.lines)
        failed = sum(not ok for ok, _ in self.lines)
        verdict = "bundle OK" if self.ok else f"bundle has {failed} problem{'s' if failed > 1 else ''}"
        return f"{body}\n{verdict}"


def _value_specs(values) -> tuple[list[C.TensorSpec], list[str]]:
    specs, symbolic = [], []
    for v in values:
        t = v.type.tensor_type
        dims = []
        for d in t.shape.dim:
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            else:
                dims.append(-1)
                symbolic.append(f"{v.name}[{d.dim_param or '?'}]")
        specs.append(C.TensorSpec(v.name, _ONNX_TO_NP.get(t.elem_type, f"onnx:{t.elem_type}"), tuple(dims)))
    return specs, symbolic


def _compare(kind: str, got: list[C.TensorSpec], want: list[C.TensorSpec]) -> list[str]:
    problems = []
    got_by, want_by = {s.name: s for s in got}, {s.name: s for s in want}
    for name in want_by.keys() - got_by.keys():
        problems.append(f"missing {kind} {name}")
    for name in got_by.keys() - want_by.keys():
        problems.append(f"unexpected {kind} {name}")
    for name in want_by.keys() & got_by.keys():
        g, w = got_by[name], want_by[name]
        if (g.dtype, g.shape) != (w.dtype, w.shape):
            problems.append(f"{kind} {name} is {g.dtype}{list(g.shape)}, contract says {w.dtype}{list(w.shape)}")
    return sorted(problems)


def _check_graph(bundle: str, name: str, model: ModelEntry, graph: GraphEntry, index, opset: int,
                 report: Report, load: bool, backend: str = "cpu", qdq: bool = False, cached: bool = False,
                 int4_block: int | None = None) -> None:
    """qdq: the qnn-qdq16 flavour (export/qdq.py), whose weight products read int8 DequantizeLinear weights.
    cached: load through the backend's compiled-graph cache (see _make_backend). int4_block: load the int4
    products in this block, as the runtime does here (kernel_probe.RowPlan)."""
    import onnx

    from ..graphs.external_data import file_pointer

    path = os.path.join(bundle, graph.file)
    label = f"{graph.file} ({name}, {graph.role}, T={graph.tokens}, S={graph.context})"
    if not os.path.isfile(path):
        report.add(False, f"{label}: file missing")
        return
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError and friends on a truncated file
        report.add(False, f"{label}: not a readable ONNX file ({type(e).__name__}: {e})")
        return
    dims = model.graph_dims(graph)
    ins, sym_in = _value_specs(proto.graph.input)
    outs, sym_out = _value_specs(proto.graph.output)
    problems = _compare("input", ins, C.step_inputs(dims, graph.tokens, graph.step_mask, graph.context))
    problems += _compare("output", outs, C.step_outputs(dims, graph.tokens, graph.role))
    report.add(not problems, f"{label}: I/O matches the contract" if not problems else f"{label}: " + "; ".join(problems))
    report.add(not (sym_in or sym_out), f"{label}: every dim is fixed" if not (sym_in or sym_out)
               else f"{label}: symbolic dims {', '.join(sym_in + sym_out)}")

    domains = {(o.domain or "ai.onnx", o.version) for o in proto.opset_import}
    foreign = sorted({n.domain for n in proto.graph.node if n.domain not in ("", "ai.onnx")})
    ok = domains == {("ai.onnx", opset)} and not foreign
    report.add(ok, f"{label}: {len(proto.graph.node)} nodes, standard domain only, opset {opset}" if ok else
               f"{label}: opsets {sorted(domains)}, non-standard node domains {foreign} (manifest says opset {opset})")

    problems = _check_quant(proto, model, qdq)
    spec = model.quant_spec
    layout = ("int8 integer products (weights per column, activations per row), embedding in blocks of "
              f"{spec.block}" if spec and spec.rows else
              f"{spec.weight_type} weights in blocks of {spec.block}, head int{spec.head_bits}" if spec else
              "QDQ weights and activations (qnn-qdq16)" if qdq else "float weights")
    report.add(not problems, f"{label}: {layout} as the manifest says" if not problems else f"{label}: " + "; ".join(problems[:3]))

    bad = []
    for init in proto.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL:
            if init.name in index:  # a runtime hands the weights file's tensors to every session by name
                bad.append(f"{init.name} is embedded, but the weights file's {init.name} would replace it")
            continue
        location, offset, length = file_pointer(init)
        ref = index.get(init.name)
        if location != model.weights:
            bad.append(f"{init.name} points at {location}, not {model.weights}")
        elif ref is None:
            bad.append(f"{init.name} is not in the weights index")
        elif (offset, length) != (ref.offset, ref.length) or \
                tuple(init.dims) != ref.shape or _ONNX_TO_NP.get(init.data_type) != ref.dtype:
            bad.append(f"{init.name} disagrees with the weights index")
    report.add(not bad, f"{label}: weights point into {model.weights} as indexed" if not bad
               else f"{label}: " + "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""))

    try:
        onnx.checker.check_model(path, full_check=True)
        report.add(True, f"{label}: onnx.checker full check passes")
    except Exception as e:
        report.add(False, f"{label}: onnx.checker: {str(e).splitlines()[0]}")

    if load:
        _check_loads(bundle, model, graph, label, report, backend, cached, int4_block)


def _check_quant(proto, model: ModelEntry, qdq: bool = False) -> list[str]:
    """Weight products against the manifest's quant record: each MatMul weight is a stored int weight through a
    symmetric (no zero point) blocked DequantizeLinear on axis 0 of the declared type and block, or a float
    weight when the model is not quantized."""
    import onnx

    spec = model.quant_spec
    inits = {i.name: i for i in proto.graph.initializer}
    producers = {o: n for n in proto.graph.node for o in n.output}
    problems = []
    for node in proto.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        weight = node.input[1]
        dq = producers.get(weight)
        if spec is None:
            if dq is not None and dq.op_type == "DequantizeLinear" and not qdq:
                problems.append(f"{node.name} reads a DequantizeLinear weight, but the manifest has no quant record")
            continue
        if weight in inits and inits[weight].data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) \
                and len(inits[weight].dims) == 2 and inits[weight].dims[0] > 1 and weight in _weight_names(model):
            problems.append(f"{node.name} reads float weight {weight} in a {spec.weight_type} bundle")
        if dq is None or dq.op_type != "DequantizeLinear":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in dq.attribute}
        stored = inits.get(dq.input[0])
        bits = spec.head_bits if dq.input[0].startswith("lm_head") else spec.bits
        want_type = onnx.TensorProto.INT4 if bits == 4 else onnx.TensorProto.INT8
        if stored is None or stored.data_type != want_type:
            problems.append(f"{dq.input[0]} is not stored as int{bits}")
        if attrs.get("block_size") != spec.block or attrs.get("axis", 1) != 0:
            problems.append(f"{dq.input[0]}: block {attrs.get('block_size')} on axis {attrs.get('axis', 1)}, "
                            f"the manifest says block {spec.block} on axis 0")
        if len(dq.input) > 2 and dq.input[2]:
            problems.append(f"{dq.input[0]} has a zero point; the layout is symmetric")
    if spec is not None and spec.rows:
        problems += _check_integer_products(proto, model, inits, producers)
    elif any(n.op_type == "MatMulInteger" for n in proto.graph.node):
        problems.append(f"integer products (MatMulInteger), but the manifest's scheme is {spec.scheme if spec else 'float'}")
    elif spec is not None:  # the offset scheme: every layer weight's product has its offsets' term, and only then
        layer_weights = _weight_names(model) - {"embed", "lm_head"}
        read = {w[: -len(".q")] for n in proto.graph.node if n.op_type == "DequantizeLinear" for w in n.input[:1]}
        offsets = {w[: -len(".offset")] for n in proto.graph.node if n.op_type in ("MatMul", "Gemm")
                   for w in n.input[1:2] if w.endswith(".offset")}
        want = read & layer_weights if spec.offsets else set()
        if offsets != want:
            problems.append(f"offset products for {sorted(offsets ^ want)[:3]} disagree with the manifest's "
                            f"scheme ({'offset' if spec.offsets else 'symmetric'})")
    return problems


def _check_integer_products(proto, model: ModelEntry, inits: dict, producers: dict) -> list[str]:
    """The rows scheme (graphs/quant.py): every weight product is a MatMulInteger of the row-quantized input (a
    QuantizeLinear whose one block spans the row) and an int8 weight [K, N] whose scale is [1, N]; no weight is
    dequantized into a float product."""
    import onnx

    problems = []
    matrices = _weight_names(model) - {"embed"}
    read = set()
    for node in proto.graph.node:
        if node.op_type != "MatMulInteger":
            continue
        name = node.input[1][: -len(".q")]
        read.add(name)
        stored, scale = inits.get(node.input[1]), inits.get(name + ".scale")
        if name not in matrices or stored is None or stored.data_type != onnx.TensorProto.INT8:
            problems.append(f"{node.name} reads {node.input[1]}, not an int8 weight of the model")
            continue
        if scale is None or list(scale.dims) != [1, stored.dims[1]]:
            problems.append(f"{name}.scale is not one scale per output column ([1, {stored.dims[1]}])")
        quantize = producers.get(node.input[0])
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in quantize.attribute} if quantize else {}
        if quantize is None or quantize.op_type != "QuantizeLinear" or attrs.get("block_size") != stored.dims[0]:
            problems.append(f"{node.name}: its input is not quantized with one scale per row")
    dequantized = {n.input[0] for n in proto.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    if dequantized:
        problems.append(f"{sorted(dequantized)[0]} is dequantized into a float product; the rows scheme has none")
    unread = {m for m in matrices if m + ".q" in inits} - read
    if unread:
        problems.append(f"{sorted(unread)[0]} is not read by an integer product")
    return problems


def _weight_names(model: ModelEntry) -> set[str]:
    """Float weight matrices a quantized graph must not contain (rope tables and norms are not products)."""
    return {"embed", "lm_head"} | {f"layers.{i}.{m}" for i in range(model.dims.num_layers) for m in MATRICES}


def _make_backend(name: str, cached: bool = False):
    """cached (qnn): compile into the context-binary cache, or load from it, as the runtime does; the placement
    reported is then the one recorded when the graph was compiled. Used when the rows comparison will load every
    graph from that cache anyway, so each graph is compiled once. Otherwise the graph is compiled without writing
    a binary (a SmolLM2 graph's is about as large as its weights)."""
    from ..runtime.backends import create_backend

    if name == "qnn" and not cached:
        from dataclasses import replace

        from ..runtime.backends.qnn import QnnBackend, QnnOptions

        return QnnBackend(None, replace(QnnOptions.from_env(), cache=False))
    return create_backend(name, threads=None)


def _check_loads(bundle: str, model: ModelEntry, graph: GraphEntry, label: str, report: Report,
                 backend_name: str = "cpu", cached: bool = False, int4_block: int | None = None) -> None:
    started = time.perf_counter()
    try:
        backend = _make_backend(backend_name, cached)
        weights = os.path.join(bundle, model.weights)
        backend.add_weights_file(weights, read_index(os.path.join(bundle, weights_index_file(model.weights))))
        session = backend.load(os.path.join(bundle, graph.file), weights, prepack=False, config=model.session_config,
                               int4_block=int4_block)
        dims = model.graph_dims(graph)
        feeds = {s.name: np.zeros(s.shape, dtype=s.dtype)
                 for s in C.step_inputs(dims, graph.tokens, graph.step_mask, graph.context)}
        outputs = {s.name: np.empty(s.shape, dtype=s.dtype) for s in C.step_outputs(dims, graph.tokens, graph.role)}
        session.bind(feeds, outputs)
        session.run()
        finite = all(np.isfinite(v).all() for v in outputs.values())
        where = "" if backend_name == "cpu" else f" on {backend_name}"
        report.add(finite, f"{label}: loads and runs in onnxruntime{where} ({time.perf_counter() - started:.1f} s)"
                   + ("" if finite else ", but returns non-finite values on zero inputs"))
        if backend_name == "qnn":
            placed = backend.loads[-1]
            nodes = ", ".join(f"{n} on {ep}" for ep, n in sorted(placed.placement.items()))
            how = (f"as compiled into the context cache, loaded in {placed.seconds:.1f} s" if placed.source == "cache"
                   else f"compiled in {placed.seconds:.1f} s")
            report.add(placed.all_on_qnn, f"{label}: every node on QNN ({nodes}; {how})"
                       if placed.all_on_qnn else f"{label}: not every node on QNN ({nodes})")
        backend.close()
    except Exception as e:
        report.add(False, f"{label}: onnxruntime cannot run it: {str(e).splitlines()[0] if str(e) else type(e).__name__}")


def _check_rows(bundle: str, name: str, model: ModelEntry, report: Report, backend_name: str = "cpu",
                logits_scale: float | None = None, plan: kernel_probe.RowPlan = kernel_probe.RowPlan(),
                draft: bool = False) -> None:
    from ..runtime.backends import create_backend
    from .exact_rows import check_model_rows

    started = time.perf_counter()
    backend = create_backend(backend_name, threads=None)  # qnn: as the runtime loads it (its context cache)
    try:
        results = check_model_rows(bundle, model, backend, logits_scale=logits_scale, plan=plan)
    finally:
        backend.close()
    inexact = [r for r in results if not r.exact]
    label = f"{name}: exact rows" + ("" if backend_name == "cpu" else f" on {backend_name}")
    if plan.int4_block:
        label += (f" (int4 loaded in blocks of {plan.int4_block} on this machine, the bundle's "
                  f"{model.quant['block']} re-blocked: runtime/reblock.py)")
    elif plan.min_rows > 1:
        label += (f" (decode as two-row steps on this machine, a padding row beside each token: int4 in blocks of "
                  f"{model.quant['block']} computes a lone row unlike the rest: runtime/kernel_probe.py)")
    if not inexact:
        trees = sum(r.tree for r in results)
        report.add(True, f"{label}: {len({r.graph.file for r in results})} graphs compute each row bit for bit as "
                   f"decode does" + (f", {trees} of them also a token tree's rows" if trees else "")
                   + f" ({time.perf_counter() - started:.1f} s)")
    elif draft:  # Manifest.draft_of: a draft's rows only propose, the target's verify judges them
        report.add(True, f"{name}: rows differ from decode's in {len(inexact)} of {len(results)} comparisons on this "
                   f"machine (the first: {inexact[0].graph.file} by {inexact[0].max_diff:.3g}); a draft only "
                   "proposes, so speculation stays exact (at a near tie it may propose another token)")
    else:
        found = "; ".join(f"{r.graph.file} differs from {r.reference} by {r.max_diff:.3g}" for r in inexact[:3])
        why = ""
        if model.quant and backend_name in ONNXRUNTIME_CPU:
            reason = kernel_probe.why_inexact(model)
            why = f"; {reason}" if reason else ""
        report.add(False, f"{label}: {found} (speculative output would not equal plain output{why})")


def _check_logits_grid(bundle: str, name: str, model: ModelEntry, recorded: float | None, report: Report) -> None:
    """qnn-qdq16: every step graph's logits are dequantized with the scale the manifest records, the grid a
    runtime snaps them onto (runtime/model.snap_to_grid); another grid would move every logit."""
    from ..export.qdq import graph_logits_scale

    if recorded is None:
        report.add(True, f"{name}: no logits grid recorded (exported before 2026-12-05): logits are used as the "
                   "graphs return them")
        return
    wrong = [g.file for g in model.graphs if g.role == C.STEP
             and graph_logits_scale(os.path.join(bundle, g.file)) != recorded]
    report.add(not wrong, f"{name}: logits on the recorded uint16 grid (scale {recorded:.6g}) in every step graph"
               if not wrong else f"{name}: {', '.join(wrong[:3])} dequantize their logits with another scale than "
               f"the manifest's {recorded:.6g} (a runtime would snap them onto the wrong grid)")


def _rows_skipped(backend: str, kind: str, exact_rows: bool | None) -> str | None:
    """Why the exact-rows comparison is left out, or None to run it."""
    if exact_rows is False:
        return "skipped (--no-exact-rows)"
    if exact_rows:
        return None
    if backend == "qnn":
        # T emulated decode steps per graph: minutes for SmolLM2 on the x86 emulator, so a device asks for it.
        return ("not checked on qnn by default (T decode steps per graph, minutes on the x86 emulator; "
                "--exact-rows checks them on the HTP)")
    if kind == "qnn-qdq16":
        # onnxruntime's CPU kernels for QDQ graphs (quantized MatMul, requantization) do not keep a T-token
        # step's rows equal to one-token steps; the flavour is for the HTP.
        return (f"not checked for qnn-qdq16 on {backend} (its kernels are not the HTP's; "
                "`--backend qnn --exact-rows` checks them on the HTP)")
    return None


def check_bundle(bundle: str, load: bool = True, backend: str = "cpu", exact_rows: bool | None = None) -> Report:
    """`backend`: where graphs are loaded and run once, and exact rows checked (cpu, ort, cuda, tensorrt, qnn), and
    for qnn also node placement on the HTP. `exact_rows`: None runs the rows comparison where it is quick and
    meaningful (not on qnn, not for qnn-qdq16 on the CPU), True always, False never."""
    report = Report()
    if load and backend != "cpu":
        _make_backend(backend).close()  # a backend that is not installed is one error, not one per graph
    try:
        manifest = load_manifest(bundle)
    except BundleError as e:
        report.add(False, str(e))
        return report
    kind = flavour(manifest)
    report.add(True, f"manifest: {', '.join(f'{k} ({m.family}, {m.dims.num_layers} layers, {m.dims.dtype})' for k, m in manifest.models.items())}")
    for name, model in manifest.models.items():
        wpath = os.path.join(bundle, model.weights)
        try:
            index = read_index(os.path.join(bundle, weights_index_file(model.weights)))
        except BundleError as e:
            report.add(False, f"{name}: {e}")
            continue
        need = max((r.offset + r.length for r in index.values()), default=0)
        size = os.path.getsize(wpath) if os.path.isfile(wpath) else -1
        if not report.add(size >= need, f"{name}: {model.weights} holds {size} bytes for {len(index)} tensors"
                          if size >= need else f"{name}: weights file {model.weights} "
                          + ("missing" if size < 0 else f"truncated ({size} bytes, index needs {need})")):
            continue
        skipped = _rows_skipped(backend, kind, exact_rows)
        # how the runtime loads and runs the model here (the probe runs a product: not for --no-load)
        draft_of = manifest.draft_of(model)
        plan = kernel_probe.row_plan(model, backend, draft_of) if load else kernel_probe.RowPlan()
        for graph in model.graphs:
            _check_graph(bundle, name, model, graph, index, manifest.opset, report, load, backend,
                         qdq=kind == "qnn-qdq16", cached=skipped is None, int4_block=plan.int4_block)
        if kind == "qnn-qdq16":
            _check_logits_grid(bundle, name, model, manifest.logits_scale(name), report)
        if load and report.ok:
            if skipped:
                report.add(True, f"{name}: exact rows {skipped}")
            else:
                _check_rows(bundle, name, model, report, backend, manifest.logits_scale(name), plan,
                            draft=draft_of is not None)
    from ..runtime.tokenizer import Tokenizer

    for f in manifest.tokenizer.files:
        if not os.path.isfile(os.path.join(bundle, f)):
            report.add(False, f"tokenizer file {f} missing")
        elif f == "tokenizer/tokenizer.json":  # loaded as the runtime loads it (when tokenizers is installed)
            try:
                read = Tokenizer.from_bundle(bundle, manifest) is not None
                report.add(True, f"tokenizer file {f}" + (", read by the tokenizers package" if read else ""))
            except BundleError as e:
                report.add(False, str(e))
        else:
            report.add(True, f"tokenizer file {f}")
    return report
