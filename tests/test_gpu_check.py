"""tools/gpu_check.py, run on the CPU: the `ort` backend takes the code path of the GPU backends
(onnxruntime's Python API), so the tool's comparisons can be proven here; a GPU backend this onnxruntime
lacks is one error record, and the other backends still run."""
from __future__ import annotations

import json

import onnxruntime as ort
import pytest

from specedge.tools import gpu_check


def test_gpu_check_holds_a_backend_against_the_cpu(tiny_pair_bundle, tmp_path):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    out = tmp_path / "gpu.json"
    assert gpu_check.main([tiny_pair_bundle, "--backends", "cuda,ort", "--new-tokens", "32",
                           "--json", str(out)]) == 0
    missing, ort_result = json.loads(out.read_text())["results"]
    assert missing["backend"] == "cuda" and "CUDAExecutionProvider" in missing["error"]
    assert ort_result["backend"] == "ort" and "error" not in ort_result
    for model in ("target", "draft"):  # the same kernels as the cpu backend: every row exact, same logits
        rows = ort_result["exact_rows"][model]
        assert rows and set(rows.values()) == {0.0}, rows
        assert ort_result[f"{model}_step_logits_max_diff_vs_cpu"] == 0.0
    assert ort_result["plain_equals_cpu_plain"] and ort_result["plain_first_difference"] is None
    runs = ort_result["runs"]
    assert set(runs) == {"none g=0", "ngram g=4", "draft g=4"}
    for name, run in runs.items():
        assert run["equals_own_plain"] and run["cpu_equals_cpu_plain"], name
    for name in ("ngram g=4", "draft g=4"):  # the speculative paths ran: drafts proposed, some accepted
        assert 0 < runs[name]["accepted"] < runs[name]["proposed"], (name, runs[name])
