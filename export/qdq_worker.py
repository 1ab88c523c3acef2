"""qnn-qdq16 graphs quantized in a child process:
`python -m specedge.export.qdq_worker RANGES GRAPH FOLDER [GRAPH FOLDER ...]`.

export/qdq.py runs several at once (onnxruntime's quantizer is single-threaded Python), each over its share of
the graphs, so that a worker pays its imports once. RANGES is the JSON {tensor: [low, high]} of the graphs'
model; each GRAPH is a float32 step graph and FOLDER an empty folder that receives its QDQ graph and then an
empty DONE file. Exit 0 when every graph is done; otherwise the last line of the output says why.
"""
from __future__ import annotations

import json
import os
import sys

DONE = "done"  # written into a FOLDER once its graph is complete


def main(argv: list[str]) -> int:
    from .qdq import quantize_graph

    if len(argv) < 3 or len(argv) % 2 == 0:
        print(__doc__.splitlines()[1], file=sys.stderr)
        return 2
    ranges_file, pairs = argv[0], argv[1:]
    with open(ranges_file) as f:
        ranges = {name: (low, high) for name, (low, high) in json.load(f).items()}
    for graph, folder in zip(pairs[::2], pairs[1::2]):
        quantize_graph(graph, ranges, folder)
        open(os.path.join(folder, DONE), "w").close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
