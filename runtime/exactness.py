"""Where greedy speculation is known to be exact: the graph flavours, dtypes and backends whose verify rows equal
decode rows bit for bit (position consistency, docs/bundle.md), as `specedge check --exact-rows` measures and the
test suite asserts.

Elsewhere a verify step may round a row differently from a decode step, and at a near tie speculative output can
then differ from plain output (sampled output is then drawn from slightly other probabilities). The runtime still
runs there, and says so once per process: an `InexactRowsWarning`, which the CLI prints as one line.
"""
from __future__ import annotations

import warnings

from ..errors import SpecedgeWarning
from ..graphs.manifest import Manifest
from . import kernel_probe


class InexactRowsWarning(SpecedgeWarning):
    """Speculation on a backend where the bundle's verify rows are not known to equal decode rows bit for bit."""


ONNXRUNTIME_CPU = kernel_probe.ONNXRUNTIME_CPU


def flavour(manifest: Manifest) -> str:
    return manifest.export.get("flavour") or "portable"


def unverified_rows(manifest: Manifest, backend: str) -> str | None:
    """None where the target's rows are verified exact on `backend`; else what is known there, for a message."""
    kind, dtype = flavour(manifest), manifest.target.dims.dtype
    if backend in ONNXRUNTIME_CPU:
        if kind == "portable" and dtype == "float32":  # quantized bundles included: their graphs compute float32
            return kernel_probe.why_inexact(manifest.target) if manifest.target.quant else None
        if kind == "qnn-qdq16":
            return "qnn-qdq16 graphs are for the HTP; onnxruntime's CPU kernels for them round rows differently"
        # measured on a tiny float16 bundle: 2.4e-4 to 4.9e-4 in the logits, in every verify graph with graph
        # optimization off too (the float16 kernels themselves, not a rewrite)
        return ("float16 graphs on onnxruntime's CPU kernels: a verify row's logits were measured up to 5e-4 from "
                "decode's; a float32 bundle is exact on the CPU")
    if backend == "qnn":
        if kind in ("qnn-fp16", "qnn-qdq16"):
            return None
        return ("the portable flavour on the HTP: rows measured about 1e-3 apart on a tiny model; export with "
                "--for qnn or --for qnn-qdq16 for exact rows there")
    return f"rows on {backend} are not checked by the test suite (no GPU in CI)"


def warn_if_unverified(manifest: Manifest, backend: str, bundle: str) -> None:
    """Say once per process (per bundle and backend) that speculation may not be exact here."""
    why = unverified_rows(manifest, backend)
    if why is None:
        return
    warnings.warn(f"speculation on backend {backend} is not known to be exact for this bundle: {why}. Its output "
                  "can differ from plain decode wherever the top two logits are closer than the rows' difference; "
                  f"`specedge check {bundle} --backend {backend} --exact-rows` measures its rows",
                  InexactRowsWarning, stacklevel=2)
