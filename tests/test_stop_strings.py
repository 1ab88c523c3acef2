"""Stop strings (runtime/stop_strings.py): the output ends after the token that completes one, as plain decode
ends it one token per round; speculative rounds that commit tokens past it are cut there."""
import json
import random

import numpy as np
import pytest
from test_generate import NEW, prompt_of
from test_text_stream import TEXT, byte_level

from specedge.errors import GenerationError
from specedge.runtime.stop_strings import cut_round
from specedge.runtime.text_stream import TextStream


def oracle(decode, tokens: list[int], stop: list[str], min_new_tokens: int = 0) -> tuple[int, str] | None:
    """Plain decode's stop by brute force: after each token whose text is whole, a stop string that ends past the
    text seen before ends the output, if the token came after the first min_new_tokens. (tokens kept, text before
    the string)"""
    seen = 0
    for n in range(1, len(tokens) + 1):
        text = decode(tokens[:n])
        if text.endswith("\ufffd"):
            continue
        starts = [i for s in stop for i in range(len(text)) if text.startswith(s, i) and i + len(s) > seen]
        seen = len(text)
        if starts and n > min_new_tokens:
            return n, text[:min(starts)]
    return None


def stop_in(decode, tokens: list[int], at: int, width: int = 2) -> str:
    """A stop string cut from the output's text: the text of tokens[at:at + width], less its first character."""
    return decode(tokens[at:at + width])[1:]


def test_rounds_of_any_size_stop_where_one_token_rounds_do(tmp_path):
    """cut_round against the oracle on a byte-level tokenizer whose characters span tokens, with stop strings
    that start, end and sit inside split characters, and min_new_tokens passing earlier matches over."""
    tok = byte_level(tmp_path)
    ids = tok.encode(TEXT)
    rng = random.Random(0)
    checked = 0
    for trial in range(300):
        stop = [TEXT[i:i + rng.randint(1, 6)] for i in (rng.randrange(len(TEXT) - 6) for _ in range(rng.randint(1, 3)))]
        min_new = rng.choice([0, 0, rng.randrange(len(ids))])
        want = oracle(tok.decode, ids, stop, min_new)
        strings, out, reason = TextStream(tok.decode, stop, min_new), [], ""
        while len(out) < len(ids) and not reason:
            new, reason = cut_round(ids[len(out):len(out) + rng.randint(1, 9)], len(out), len(ids), set(), strings)
            out += new
        if want is None:
            assert not strings.stopped and out == ids
        else:
            assert (reason, len(out), strings.text) == ("stop", *want), (stop, min_new)
            checked += min_new > 0
    assert checked > 20  # matches before min_new_tokens were passed over and later ones counted


def test_a_stop_string_completed_by_the_last_allowed_token_is_the_reason(tmp_path):
    """Plain decode checks the text before the token limit, as for stop ids: finish_reason "stop", not "length"."""
    tok = byte_level(tmp_path)
    ids = tok.encode("def total(items): return sum")
    strings = TextStream(tok.decode, [tok.decode(ids[-2:])])
    assert cut_round(ids, 0, len(ids), set(), strings) == (ids, "stop")
    assert cut_round(ids, 0, len(ids), set(), TextStream(tok.decode, ["NEVER"])) == (ids, "max_new_tokens")


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_output_with_stop_strings_equals_plain(gen, proposer):
    """Greedy, every gamma, adaptive=False: the same tokens, text and reason as plain decode with the same stop
    strings, and as the brute-force oracle on the unstopped output; drafts proposed, accepted and rejected,
    and rounds that committed tokens past the stop string were cut."""
    decode = gen.tokenizer.decode
    prompts = [prompt_of(n, seed=n) for n in (9, 30)] + [echo_prompt_of(gen, s) for s in (1, 2)]
    proposed = accepted = cut = 0
    for prompt in prompts:
        free = gen.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
        for at in (3, 11, 25):
            stop = [stop_in(decode, free, at)]
            plain = gen.generate(prompt, NEW, proposer="none", stop_ids=[], stop=stop)
            n, text = oracle(decode, free, stop)
            assert (plain.tokens, plain.text, plain.stats.stop_reason) == (free[:n], text, "stop")
            for gamma in (2, 4, 8):
                rounds = [len(r) for r in gen.stream(prompt, NEW, proposer=proposer, gamma=gamma, stop_ids=[],
                                                     adaptive=False)]
                out = gen.generate(prompt, NEW, proposer=proposer, gamma=gamma, stop_ids=[], adaptive=False,
                                   stop=stop)
                assert (out.tokens, out.text, out.stats.stop_reason) == (plain.tokens, plain.text, "stop")
                proposed, accepted = proposed + out.stats.proposed, accepted + out.stats.accepted
                cut += n not in np.cumsum(rounds)  # the round holding the stop went on past it
    assert 0 < accepted < proposed and cut > 0, (accepted, proposed, cut)


def echo_prompt_of(gen, seed: int) -> list[int]:
    head = prompt_of(12, seed)[:6]
    return head + gen.generate(head, 24, proposer="none", stop_ids=[]).tokens + head


def test_sampled_output_with_stop_strings_is_the_unstopped_output_cut(gen):
    """A seed draws the same tokens with and without stop strings up to the stop: the law is unchanged."""
    decode = gen.tokenizer.decode
    prompt = prompt_of(20, seed=3)
    for seed in range(4):
        free = gen.generate(prompt, NEW, proposer="ngram", gamma=4, temperature=0.8, seed=seed, stop_ids=[]).tokens
        stop = [stop_in(decode, free, 10, 3)]
        n, text = oracle(decode, free, stop)
        out = gen.generate(prompt, NEW, proposer="ngram", gamma=4, temperature=0.8, seed=seed, stop_ids=[], stop=stop)
        assert (out.tokens, out.text) == (free[:n], text)


def test_a_stop_string_before_min_new_tokens_does_not_end_the_output(gen):
    decode = gen.tokenizer.decode
    prompt = prompt_of(20, seed=4)
    free = gen.generate(prompt, NEW, proposer="none", stop_ids=[]).tokens
    stop = [stop_in(decode, free, 2)]
    for proposer in ("none", "ngram"):
        out = gen.generate(prompt, NEW, proposer=proposer, stop_ids=[], stop=stop, min_new_tokens=10)
        want = oracle(decode, free, stop, 10)
        if want is None:
            assert out.tokens == free and out.stats.stop_reason == "max_new_tokens"
        else:
            assert (out.tokens, out.text) == (free[:want[0]], want[1]) and len(out.tokens) > 10


@pytest.mark.parametrize("stop", [[""], [5], "", ["a"] * 17, {"a": 1}])
def test_bad_stop_strings_are_refused(gen, stop):
    with pytest.raises(GenerationError, match="stop"):
        gen.generate([5, 6, 7], 4, proposer="none", stop=stop)


def test_generate_cli_stops_at_the_string_and_leaves_it_out(tiny_bundle, gen, capsys):
    from specedge.cli import main

    prompt = prompt_of(20, seed=5)
    free = gen.generate(prompt, NEW, proposer="none").tokens
    stop = stop_in(gen.tokenizer.decode, free, 12)
    n, text = oracle(gen.tokenizer.decode, free, [stop])
    args = ["generate", tiny_bundle, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(NEW),
            "--proposer", "ngram", "--stop", stop]
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == free[:n] and report["text"] == text and report["stats"]["stop_reason"] == "stop"
    assert main(args) == 0
    assert capsys.readouterr().out == text + "\n"
