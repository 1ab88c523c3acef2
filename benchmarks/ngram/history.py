"""Prompt lookup with an output history (runtime/output_history.py) on the short edits, four ways of filling
the history, interleaved per prompt in one process (every output checked against plain decode).

    python benchmarks/ngram/history.py BUNDLE [--gamma 8]

First every prompt of tools/prompts/suite.jsonl and tools/prompts/short_edits.jsonl is decoded plainly
(untimed): those outputs fill the histories. Then, per short edit, timed: plain decode; ngram; ngram with the
history holding
  * "earlier": the short edits before this one (what `specedge bench --history` measures: a server that
    answered them first);
  * "suite": the 37 suite prompts' outputs (other tasks than this file's);
  * "others": the suite's and the other 15 short edits' outputs (a server that has answered everything else);
  * "a retry": all of them, this prompt's own output included (the same request asked again).
Only the last puts a prompt's own output in its history. 128 new tokens, EOS held back, 2 threads."""
import argparse
import json

import specedge.runtime.proposers as proposers
from specedge.runtime.generator import Generator
from specedge.runtime.output_history import OutputHistory

SUITE, EDITS = "tools/prompts/suite.jsonl", "tools/prompts/short_edits.jsonl"
NEW = 128

parser = argparse.ArgumentParser()
parser.add_argument("bundle")
parser.add_argument("--gamma", type=int, default=8)
parser.add_argument("--n-min", type=int, default=proposers.HISTORY_N_MIN,
                    help="shortest match drafted from the history (also runs the default, when different)")
a = parser.parse_args()
gen = Generator.load(a.bundle, backend="cpu", threads=2)


def ids(path):
    return [gen.tokenizer.apply_chat_template(json.loads(line)["messages"]) for line in open(path)]


DEFAULT_N_MIN = proposers.HISTORY_N_MIN


def run(prompt, proposer, history=None, n_min=DEFAULT_N_MIN):
    gen.output_history, proposers.HISTORY_N_MIN = history, n_min
    try:
        return gen.generate(prompt, NEW, min_new_tokens=NEW, proposer=proposer, gamma=a.gamma)
    finally:
        gen.output_history, proposers.HISTORY_N_MIN = None, DEFAULT_N_MIN


suite, edits = ids(SUITE), ids(EDITS)
suite_out = [run(p, "none").tokens for p in suite]
edit_out = [run(p, "none").tokens for p in edits]
VARIANTS = {
    "plain": lambda i: ("none", None),
    f"ngram g={a.gamma}": lambda i: ("ngram", None),
    "+ history: earlier": lambda i: ("ngram", OutputHistory.of(edit_out[:i])),
    "+ history: suite": lambda i: ("ngram", OutputHistory.of(suite_out)),
    "+ history: others": lambda i: ("ngram", OutputHistory.of(suite_out + edit_out[:i] + edit_out[i + 1:])),
    "+ history: a retry": lambda i: ("ngram", OutputHistory.of(suite_out + edit_out)),
}
if a.n_min != DEFAULT_N_MIN:
    VARIANTS.update({
        f"+ history: earlier, n_min {a.n_min}": lambda i: ("ngram", OutputHistory.of(edit_out[:i]), a.n_min),
        f"+ history: others, n_min {a.n_min}": lambda i: ("ngram", OutputHistory.of(suite_out + edit_out[:i]
                                                                                   + edit_out[i + 1:]), a.n_min)})
stats = {name: [] for name in VARIANTS}
for i, prompt in enumerate(edits):
    for name in (list(VARIANTS) if i % 2 == 0 else list(VARIANTS)[::-1]):
        r = run(prompt, *VARIANTS[name](i))
        assert r.tokens == edit_out[i], (i, name)  # greedy speculation commits plain decode's tokens
        stats[name].append(r.stats)
plain_ms = sum(s.total_ms for s in stats["plain"])
print("| variant | vs plain | tokens/round | rounds that draft | acceptance |\n|---|---|---|---|---|")
for name, runs in stats.items():
    rounds = sum(s.rounds for s in runs)
    drafting = sum((s.proposed_by_position or [0])[0] for s in runs)
    proposed = sum(s.proposed for s in runs)
    print(f"| {name} | {plain_ms / sum(s.total_ms for s in runs):.3f}x | {NEW * len(runs) / rounds:.2f} | "
          f"{drafting / rounds:.0%} | {sum(s.accepted for s in runs) / max(proposed, 1):.0%} |")
