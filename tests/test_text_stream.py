"""The incremental detokenizer (runtime/text_stream.py; the server, `specedge generate` and the demo stream text
with it) against the oracle: the tokenizer's decode of all ids, cut at the first stop string. Tokens arrive in
rounds of 1 to 9, as speculative rounds commit them."""
import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from specedge.runtime.tokenizer import Tokenizer
from specedge.runtime.text_stream import TextStream

TEXT = ("def total(items):\n    \"\"\"Sum the prices — naïve, in €.\"\"\"\n    return sum(i.price for i in items)\n\n"
        "Café au lait, 東京 and 🙂 done.  Two  spaces, a\ttab, <tag> and the end.\n") * 4


def byte_level(tmp_path) -> Tokenizer:
    """GPT-2/Llama 3/SmolLM2-style byte-level BPE trained on ASCII: every other character is split into bytes."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["def total(x): return sum(i.price for i in items)", "Cafe naive done <tag> end"] * 20,
                           trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _saved(hf, tmp_path)


def sentencepiece(tmp_path) -> Tokenizer:
    """Llama 2/Mistral-style: "▁" for spaces, byte fallback, and a decoder that strips the text's leading space,
    so a token's text depends on whether it comes first."""
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "▁a", "th", "▁th", "in", "re", "▁the"]  # the rest: bytes
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, **{p: 257 + i for i, p in enumerate(pieces)}}
    merges = [("▁", "t"), ("▁", "a"), ("t", "h"), ("▁t", "h"), ("i", "n"), ("r", "e"), ("▁th", "e")]
    hf = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return _saved(hf, tmp_path)


def word_level(tmp_path) -> Tokenizer:
    """No decoder: decode joins tokens with spaces, so no token's text stands alone."""
    words = sorted(set(TEXT.split()))
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>"] + words)}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _saved(hf, tmp_path)


def _saved(hf, tmp_path) -> Tokenizer:
    path = str(tmp_path / "tokenizer.json")
    hf.save(path)
    return Tokenizer(path, None, None)


def rounds(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 9)
        out.append(ids[i:i + n])
        i += n
    return out


def expected_text(tok: Tokenizer, ids: list[int], stop: list[str]) -> str:
    text = tok.decode(ids)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(cuts)] if cuts else text


def reference(tok: Tokenizer, ids: list[int], stop: list[str], min_tokens: int = 0) -> tuple[list[str], int | None]:
    """Plain decode's stream by decoding all ids after each token: the text released after token n for every n
    (all of it but a tail that may start a stop string, nothing new while it ends in an incomplete character,
    the text before the stop string at the end), and the n whose token completed a stop string (or None). A stop
    string counts when it ends in the text added by a token after the first min_tokens."""
    released, out, seen = [], "", 0
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        if not text.endswith("\ufffd"):
            starts = [i for s in stop for i in range(len(text)) if text.startswith(s, i) and i + len(s) > seen]
            seen = len(text)
            if starts and n > min_tokens:
                return released + [out + text[len(out):min(starts)]], n
            held = max([k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])], default=0)
            out += text[len(out):len(text) - held]
        released.append(out)
    return released, None


def stream(tok: Tokenizer, ids: list[int], stop: list[str], seed: int,
           min_tokens: int = 0) -> tuple[TextStream, list[str]]:
    """Push ids round by round as the engine does; after every round the text released and the offsets equal
    the reference's after the round's last token (or its stop)."""
    released, stop_at = reference(tok, ids, stop, min_tokens)
    text, pieces, pushed = TextStream(tok.decode, stop, min_tokens), [], []
    for r in rounds(ids, random.Random(seed)):
        pieces.append(text.push(r))
        pushed += r
        assert text.starts(len(r)) == [len(tok.decode(pushed[:k])) for k in range(len(pushed) - len(r), len(pushed))]
        stops_here = stop_at is not None and stop_at <= len(pushed)
        assert text.stopped == stops_here
        assert "".join(pieces) == released[(stop_at if stops_here else len(pushed)) - 1]
        if text.stopped:
            break
    pieces.append(text.flush())
    assert text.starts(len(pushed)) == [len(tok.decode(pushed[:k])) for k in range(len(pushed))]  # older tokens too
    return text, pieces


@pytest.mark.parametrize("make", [byte_level, sentencepiece, word_level])
@pytest.mark.parametrize("stop", [[], ["the end"], ["\n\n", "€."], ["NEVER"]])
def test_streamed_text_is_the_decode_of_all_ids_cut_at_the_first_stop(tmp_path, make, stop):
    tok = make(tmp_path)
    ids = tok.encode(TEXT)
    if make is byte_level:
        assert any(tok.decode([t]).endswith("\ufffd") for t in ids)  # characters split across tokens occur
    for seed in range(5):
        text, pieces = stream(tok, ids, stop, seed)
        want = expected_text(tok, ids, stop)
        assert "".join(pieces) == want and text.text == want
        assert text.stopped == (want != tok.decode(ids))


def test_random_ids_including_broken_characters_stream_as_decoding_everything_does(tmp_path):
    """Ids a model could emit in any order: lone continuation bytes, characters cut short, special tokens.
    (Byte-level text, once whole, never changes. SentencePiece's byte fallback turns a run of byte tokens that
    is not UTF-8 into one "\ufffd" per byte, so there a broken run that starts before the window may show a
    different number of "\ufffd" than decoding everything would: runtime/text_stream.py.)"""
    tok = byte_level(tmp_path)
    vocab = tok._tok.get_vocab_size()
    for seed in range(30):
        rng = random.Random(seed)
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
        for stop in ([], ["a"]):
            _, pieces = stream(tok, ids, stop, seed)
            assert "".join(pieces) == expected_text(tok, ids, stop)
        stream(tok, ids, ["a", "e"], seed, min_tokens=len(ids) // 2)  # earlier matches passed over


def test_a_long_stream_decodes_each_id_a_bounded_number_of_times(tmp_path):
    """Re-decoding every id at every round would decode 2,000 ids about 200,000 times over."""
    tok = byte_level(tmp_path)
    ids = tok.encode(TEXT * 8)[:2000]
    decoded = []

    def decode(part):
        decoded.append(len(part))
        return tok.decode(part)

    text = TextStream(decode, ["NEVER"])
    for r in rounds(ids, random.Random(0)):
        text.push(r)
        text.starts(len(r))
    assert text.flush() is not None and text.text == tok.decode(ids)
    assert sum(decoded) < 40 * len(ids)


def test_a_tokenizer_whose_earlier_text_changes_falls_back_to_decoding_everything():
    """A decode that rewrites earlier text when more ids come (here: the text of an odd count of ids ends in
    "?") cannot be windowed; the stream still ends with the decode of all ids."""
    def decode(ids):
        return "".join(f"<{i}>" for i in ids) + ("?" if len(ids) % 2 else "")

    text = TextStream(decode, [])
    pieces = [text.push([i]) for i in range(7)] + [text.flush()]
    assert text.text == decode(list(range(7)))
    assert pieces[0] == "<0>?"


@pytest.mark.slow
def test_smollm2_tokenizer_streams_its_quality_text_exactly(smollm2_path, tmp_path):
    from specedge.export.sources import open_source

    path = tmp_path / "tokenizer.json"
    path.write_bytes(open_source(smollm2_path).tokenizer().files["tokenizer.json"])
    tok = Tokenizer(str(path), None, None)
    ids = tok.encode(TEXT)[:400] + tok.encode("ünïcödé 𝔘 — 漢字かな")
    for stop in ([], ["sum("], ["🙂"]):
        _, pieces = stream(tok, ids, stop, seed=1)
        assert "".join(pieces) == expected_text(tok, ids, stop)


def test_generate_streams_the_text_its_json_reports(tiny_bundle, capsys):
    from specedge.cli import main

    args = ["generate", tiny_bundle, "--prompt-ids", "5,6,7,5,6", "--max-new-tokens", "24", "--proposer", "ngram"]
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    streamed = capsys.readouterr().out
    assert len(report["tokens"]) == 24 and streamed == report["text"] + "\n"
