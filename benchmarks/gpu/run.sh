#!/bin/bash
# The GPU check (tools/gpu_check.py) on a machine with an NVIDIA GPU and onnxruntime-gpu, from the repository
# root: models made there (benchmarks/gpu/make_models.py), bundles exported there, results in $OUT.
set -u
OUT=${OUT:-/tmp/gpu-check}
M=${M:-/tmp/gpu-models}
B=${B:-/tmp/gpu-bundles}
mkdir -p "$OUT" "$M" "$B"
python3 -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())"
nvidia-smi --query-gpu=name,driver_version --format=csv
python3 benchmarks/gpu/make_models.py "$M" 2>&1 | grep -v Writing
export_() { python3 -m specedge export --context 256 --gamma 4 --quiet "$@"; }
export_ --target "$M/target" --draft "$M/draft" --out "$B/f32"
export_ --target "$M/target" --draft "$M/draft" --out "$B/f16" --dtype float16
export_ --target "$M/target" --draft-layers 2 --out "$B/int4" --quant int4
export_ --target "$M/target" --out "$B/tree" --step-mask --tree 8
python3 -m specedge export --target "$M/smol" --out "$B/smol32" --context 512 --gamma 4 --quiet
python3 -m specedge export --target "$M/smol" --out "$B/smol16" --context 512 --gamma 4 --dtype float16 --quiet
python3 -m specedge.tools.gpu_check "$B/f32" "$B/f16" "$B/int4" "$B/tree" --backends cuda,tensorrt \
  --new-tokens 64 --json "$OUT/tiny.json" 2>&1 | grep -v "ScatterND with reduction"
python3 -m specedge.tools.gpu_check "$B/smol32" "$B/smol16" --backends cuda --new-tokens 128 \
  --json "$OUT/smol.json" 2>&1 | grep -v "ScatterND with reduction"
