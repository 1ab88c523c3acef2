"""What sampling penalties cost prompt lookup: plain decode and ngram g=8 with no penalty, a repetition penalty
and presence/frequency penalties, interleaved per prompt in one process (every speculative output checked
against plain decode with the same penalties).

    python benchmarks/ngram/penalties.py BUNDLE tools/prompts/short_edits.jsonl

A penalty changes the text (so each setting has its own plain baseline) and discourages exactly what prompt
lookup drafts: text that occurred before."""
import json
import sys

from specedge.runtime.generator import Generator

bundle, path = sys.argv[1], sys.argv[2]
gen = Generator.load(bundle, backend="cpu", threads=2)
ids = [gen.tokenizer.apply_chat_template(json.loads(line)["messages"]) for line in open(path)]
SETTINGS = {"none": {}, "repetition 1.05": dict(repetition_penalty=1.05),
            "repetition 1.1": dict(repetition_penalty=1.1), "repetition 1.2": dict(repetition_penalty=1.2),
            "presence 0.5, frequency 0.5": dict(presence_penalty=0.5, frequency_penalty=0.5)}
RUNS = [(name, proposer) for name in SETTINGS for proposer in ("none", "ngram")]


def run(name, proposer, prompt):
    return gen.generate(prompt, 128, min_new_tokens=128, proposer=proposer, gamma=8, **SETTINGS[name])


for name, proposer in RUNS:  # warm-up: sessions of every graph the runs use
    run(name, proposer, ids[0])
stats = {key: [] for key in RUNS}
for i, prompt in enumerate(ids):
    tokens = {}
    for key in (RUNS if i % 2 == 0 else RUNS[::-1]):
        r = run(*key, prompt)
        stats[key].append(r.stats)
        tokens[key] = r.tokens
    for name in SETTINGS:
        assert tokens[name, "ngram"] == tokens[name, "none"], (i, name)
    print(f"prompt {i}: done", file=sys.stderr)
for name in SETTINGS:
    plain, ngram = stats[name, "none"], stats[name, "ngram"]
    ms = sum(s.total_ms for s in plain) / sum(s.total_ms for s in ngram)
    rounds = sum(s.rounds for s in ngram)
    print(f"{name:28s} ngram g=8 {ms:.3f}x plain, {128 * len(ngram) / rounds:.2f} tokens/round, acceptance "
          f"{sum(s.accepted for s in ngram) / max(1, sum(s.proposed for s in ngram)):.0%}, "
          f"{sum((s.proposed_by_position or [0])[0] for s in ngram) / rounds:.0%} of rounds draft")
