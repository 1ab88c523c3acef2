"""onnxruntime's QNN execution provider: step graphs on a Qualcomm HTP (Hexagon NPU), or on the HTP emulator
that the Linux x86_64 onnxruntime-qnn wheel ships (libQnnHtp.so runs HTP graphs on the host there).

What this backend does differently from `ort` (everything else, weights and I/O binding, is OrtBackend's):
* QNN is a plugin EP: its library is registered with onnxruntime once per process and sessions get it through
  SessionOptions.add_provider_for_devices. The older providers=[("QNNExecutionProvider", ...)] form is
  silently ignored by onnxruntime 1.32 (everything would run on the CPU EP).
* CPU fallback is off unless asked for, so a graph runs entirely on the HTP or not at all. Where a graph ran is
  read from the session's graph-assignment record (session.get_providers() lists QNN even when it placed
  nothing); a graph with nodes QNN cannot place fails with those nodes named.
* Compiled graphs are cached as QNN context binaries (qnn_cache.py), so compilation happens once per bundle,
  SoC and wheel. A load from the cache reports the placement recorded when the graph was compiled.

Options come from the environment, so `Generator.load(bundle, backend="qnn")` and `--backend qnn` need none:
  SPECEDGE_QNN_SOC_MODEL      HTP SoC model id. Default on x86_64 (the emulator): 60, since float graphs fail
                              to finalize on the emulator without one (QNN_COMMON_ERROR_MEM_ALLOC); on a device,
                              unset (QNN detects the SoC). "none" unsets it.
  SPECEDGE_QNN_CPU_FALLBACK=1 let onnxruntime run the nodes QNN cannot place on the CPU (slow; not cached).
  SPECEDGE_QNN_CACHE=0        compile every time (no context binaries).
  SPECEDGE_CACHE              where the cache lives (default: the user cache dir), shared with `specedge demo`.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import time
from dataclasses import dataclass, field

from ...errors import BackendError, PlacementError
from .ort_python import OrtBackend, OrtSession
from .qnn_cache import CONTEXT_FILE, ContextCache

EP = "QNNExecutionProvider"
INSTALL_HINT = "pip install onnxruntime-qnn (or 'specedge[qnn]'; Python >= 3.11)"
EMULATOR_SOC_MODEL = "60"  # accepted by the x86 emulator of onnxruntime-qnn 2.7 (QNN 2.51); 69 worked too
_FALLBACK_REFUSED = "fallback to CPU EP has been explicitly disabled"


def _on_emulator() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@dataclass
class QnnOptions:
    soc_model: str | None = None
    fp16: bool = True  # enable_htp_fp16_precision: float32 graphs compute in fp16 on the HTP (it has no fp32 path)
    cpu_fallback: bool = False
    cache: bool = True
    cache_dir: str | None = None  # None: <SPECEDGE_CACHE or user cache>/qnn

    @classmethod
    def from_env(cls) -> "QnnOptions":
        soc = os.environ.get("SPECEDGE_QNN_SOC_MODEL", EMULATOR_SOC_MODEL if _on_emulator() else "")
        return cls(soc_model=None if soc.lower() in ("", "none") else soc,
                   cpu_fallback=os.environ.get("SPECEDGE_QNN_CPU_FALLBACK", "0") == "1",
                   cache=os.environ.get("SPECEDGE_QNN_CACHE", "1") != "0")


@dataclass
class LoadRecord:
    """How one graph was loaded: for the tests, `specedge check` and the timing notes."""

    graph: str
    source: str  # "compiled", "cache" or "recompiled" (a cached binary was damaged or refused)
    seconds: float
    placement: dict[str, int] = field(default_factory=dict)  # execution provider -> nodes it runs
    context: str | None = None  # the cached context model, when caching

    @property
    def all_on_qnn(self) -> bool:
        return set(self.placement) == {EP}


class QnnBackend(OrtBackend):
    def __init__(self, threads: int | None, options: QnnOptions | None = None):
        if importlib.util.find_spec("onnxruntime_qnn") is None:
            raise BackendError(f"backend 'qnn' needs onnxruntime-qnn, which is not installed: {INSTALL_HINT}")
        self.options = options or QnnOptions.from_env()
        self.cache = ContextCache(self.options.cache_dir) if self.options.cache and not self.options.cpu_fallback else None
        self.loads: list[LoadRecord] = []
        super().__init__("qnn", threads)

    def _providers(self) -> list[str]:
        import onnxruntime_qnn

        self._qnn = onnxruntime_qnn
        ort = self._ort
        if not any(d.ep_name == EP for d in ort.get_ep_devices()):  # registration is per process
            try:
                ort.register_execution_provider_library(EP, onnxruntime_qnn.get_library_path())
            except Exception as e:
                raise BackendError(f"onnxruntime {ort.__version__} cannot register onnxruntime-qnn "
                                   f"{onnxruntime_qnn.__version__}: {str(e).splitlines()[0]}") from None
        self._devices = [d for d in ort.get_ep_devices() if d.ep_name == EP]
        if not self._devices:
            raise BackendError("onnxruntime-qnn is installed but offers no QNN device")
        return []  # sessions get QNN through add_provider_for_devices, never a providers list

    # -- options ---------------------------------------------------------------------------------------
    def provider_options(self) -> dict[str, str]:
        # Only the HTP backend exists in the wheel that matters here (no libQnnCpu.so; the GPU backend does not
        # initialise on the emulator host).
        # offload_graph_io_quantization 0: a QDQ graph's input QuantizeLinear and output DequantizeLinear run on
        # the HTP too (by default the EP leaves them to the CPU EP: on SmolLM2's qnn-qdq16 graphs, 121 nodes).
        opts = {"backend_path": self._qnn.get_qnn_htp_path(), "offload_graph_io_quantization": "0"}
        if self.options.soc_model:
            opts["soc_model"] = self.options.soc_model
        if self.options.fp16:
            opts["enable_htp_fp16_precision"] = "1"
        return opts

    def _cache_options(self, config: dict[str, str] | None) -> dict:
        """Everything besides the files that shapes a compiled binary (the library path is not: versions are)."""
        provider = {k: v for k, v in self.provider_options().items() if k != "backend_path"}
        return {"backend": "htp", "provider": provider, "config": dict(config or {}),
                "onnxruntime": self._ort.__version__, "onnxruntime_qnn": self._qnn.__version__,
                "qnn_sdk": getattr(getattr(self._qnn, "build_and_package_info", None), "qnn_version", "?")}

    # -- sessions ----------------------------------------------------------------------------------------
    def load(self, graph_path: str, weights_path: str, prepack: bool = True,
             config: dict[str, str] | None = None, int4_block: int | None = None) -> OrtSession:
        """A session running `graph_path` on the HTP; loads.append() says how (compiled or cached) and where
        its nodes run. `prepack` means nothing to QNN (it packs weights into its own binary), nor
        `int4_block` (its graphs are never re-blocked: the HTP's rows are not onnxruntime's CPU kernels')."""
        started = time.perf_counter()
        if self.cache is None:
            session, source, ctx = self._create(graph_path, weights_path, config), "compiled", None
            placement = _placement(session)
        else:
            session, source, ctx, placement = self._load_cached(graph_path, weights_path, config)
        eps = set(_placement(session)) | set(placement)
        if not self.options.cpu_fallback and eps != {EP}:  # onnxruntime refuses this; never trust it
            raise PlacementError(f"{os.path.basename(graph_path)}: nodes placed on {sorted(eps - {EP})} "
                               "although CPU fallback is disabled")
        self.loads.append(LoadRecord(os.path.basename(graph_path), source, time.perf_counter() - started,
                                     placement, ctx))
        return OrtSession(session, name=os.path.basename(graph_path))

    def _load_cached(self, graph_path: str, weights_path: str, config):
        """(session, source, context model, placement of the bundle graph's nodes as compiled)."""
        key = self.cache.key(graph_path, weights_path, self._cache_options(config))
        source = "recompiled" if self.cache.exists(key) else "compiled"
        ctx = self.cache.lookup(key)  # None when absent, or damaged (its digest no longer matches: removed)
        placement = self.cache.placement(key) if ctx else None
        if ctx and placement:
            try:
                return self._create(ctx, weights_path, config), "cache", ctx, placement
            except BackendError:  # intact file that QNN refuses (e.g. built for another HTP): build it again
                pass
        if ctx:  # refused, or its placement record is unreadable
            self.cache.discard(key)
            source = "recompiled"
        staged = self.cache.staging(key)
        try:
            session = self._create(graph_path, weights_path, config, context_out=os.path.join(staged, CONTEXT_FILE))
            if not os.path.isfile(os.path.join(staged, CONTEXT_FILE)):
                raise BackendError(f"onnxruntime-qnn wrote no context binary for {os.path.basename(graph_path)}")
            placement = _placement(session)
            return session, source, self.cache.commit(key, staged, placement, graph_path), placement
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise

    def _create(self, path: str, weights_path: str, config, context_out: str | None = None,
                fallback: bool | None = None):
        fallback = self.options.cpu_fallback if fallback is None else fallback
        so = self.session_options(weights_path, True, config)
        so.log_severity_level = 4  # QNN logs unsupported nodes as errors; our BackendError names them instead
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "0" if fallback else "1")
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        if context_out:
            so.add_session_config_entry("ep.context_enable", "1")
            so.add_session_config_entry("ep.context_file_path", context_out)
            so.add_session_config_entry("ep.context_embed_mode", "1")  # one self-contained file per graph
        so.add_provider_for_devices(self._devices, self.provider_options())
        try:
            return self._ort.InferenceSession(path, so)
        except Exception as e:
            message = str(e)
            if _FALLBACK_REFUSED in message:
                raise PlacementError(self._unplaced_message(path, weights_path, config)) from None
            hint = ""
            if "MEM_ALLOC" in message and not self.options.soc_model:
                hint = (f"; on the x86 HTP emulator float graphs need a SoC model: "
                        f"SPECEDGE_QNN_SOC_MODEL={EMULATOR_SOC_MODEL}")
            raise PlacementError(f"QNN cannot compile {os.path.basename(path)}: "
                               f"{message.splitlines()[0] if message else type(e).__name__}{hint}") from None

    def _unplaced_message(self, path: str, weights_path: str, config) -> str:
        """Name the nodes QNN cannot place: place the graph again with CPU fallback allowed and read where
        onnxruntime put each node."""
        name = os.path.basename(path)
        try:
            info = self._create(path, weights_path, config, fallback=True).get_provider_graph_assignment_info()
        except BackendError as e:
            return f"{name}: some nodes cannot run on QNN ({e})"
        placed = [(g.ep_name, n) for g in info for n in g.get_nodes()]
        cpu = [n for ep, n in placed if ep != EP]
        shown = ", ".join(f"{n.op_type} {n.name!r}" if n.name else f"{n.op_type} (unnamed)" for n in cpu[:5])
        more = f" and {len(cpu) - 5} more" if len(cpu) > 5 else ""
        return (f"{name}: {len(cpu)} of {len(placed)} nodes cannot run on QNN (HTP): {shown}{more}. Export the "
                f"bundle with this specedge (its graphs use ops the HTP runs), or allow CPU fallback with "
                f"SPECEDGE_QNN_CPU_FALLBACK=1 (slow)")


def _placement(session) -> dict[str, int]:
    counts: dict[str, int] = {}
    for subgraph in session.get_provider_graph_assignment_info():
        counts[subgraph.ep_name] = counts.get(subgraph.ep_name, 0) + len(subgraph.get_nodes())
    return counts
