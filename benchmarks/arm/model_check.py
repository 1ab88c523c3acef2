"""The probe's verdict at the level of a whole model, on whatever CPU runs this (meant for an emulated aarch64
one, see rows_under_qemu.sh): for each bundle, `specedge check`'s exact-rows comparison, and greedy prompt lookup
against plain decode with the InexactRowsWarning counted.

    python benchmarks/arm/model_check.py BUNDLE [BUNDLE ...]
"""
from __future__ import annotations

import sys
import warnings

from specedge.graphs.manifest import load_manifest
from specedge.runtime import kernel_probe
from specedge.runtime.exactness import InexactRowsWarning
from specedge.runtime.generator import Generator
from specedge.tools.check import check_bundle

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 9, 11, 5, 6, 7, 5]  # repeats, so that prompt lookup drafts


def main(bundles: list[str]) -> None:
    for bundle in bundles:
        quant = load_manifest(bundle).target.quant
        layout = f"int{quant['bits']} in blocks of {quant['block']}"
        rows = [("exact" if ok else "NOT exact") for ok, text in check_bundle(bundle).lines if "exact rows" in text]
        gen = Generator.load(bundle)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plain = gen.generate(PROMPT, 40, proposer="none", stop_ids=[]).tokens
                spec = gen.generate(PROMPT, 40, proposer="ngram", gamma=4, stop_ids=[], adaptive=False)
        finally:
            gen.close()
        warned = sum(issubclass(w.category, InexactRowsWarning) for w in caught)
        print(f"{layout}: probe {'alike' if not kernel_probe.inexact_layouts(quant) else 'DIFFER'}; specedge check "
              f"rows {', '.join(rows)}; prompt lookup == plain: {spec.tokens == plain} (proposed "
              f"{spec.stats.proposed}, accepted {spec.stats.accepted}); warnings {warned}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
