"""runtime/kernel_probe.py's question on whatever CPU runs this (meant for an emulated aarch64 one, see
rows_under_qemu.sh): are the rows of a quantized product alike at 1, 2, 5, 9 and 17 rows, for int8 and int4 in
every block size the export offers? Loads only graphs/quant.py and runtime/kernel_probe.py (numpy and
onnxruntime, no tokenizer), so an aarch64 Python needs nothing else.

    python benchmarks/arm/rows_probe.py
"""
from __future__ import annotations

import importlib.util
import os
import platform
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    for name in ("specedge", "specedge.graphs", "specedge.runtime"):  # bare packages: no runtime/__init__ imports
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    quant = _load("specedge.graphs.quant", "graphs/quant.py")
    probe = _load("specedge.runtime.kernel_probe", "runtime/kernel_probe.py")
    probe.ROWS = (2, 5, 9, 17)  # more row counts than the runtime asks: tile kernels of 4 and 8 rows show too
    import onnxruntime

    print(f"{platform.machine()}, onnxruntime {onnxruntime.__version__}")
    for bits in (8, 4):
        verdicts = ", ".join(f"blocks of {b}: {'alike' if probe.rows_alike(bits, b) else 'DIFFER'}"
                             for b in quant.BLOCK_SIZES)
        print(f"int{bits}: {verdicts}", flush=True)


if __name__ == "__main__":
    main()
