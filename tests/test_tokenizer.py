"""Token bytes (runtime/tokenizer.py, what OpenAI logprobs report as `bytes`): a token that holds part of a UTF-8
character has no text of its own but has bytes, and a text's tokens' bytes put together are the text's UTF-8."""
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from specedge.runtime.tokenizer import Tokenizer

TEXT = "Café — naïve 東京 🙂 done\n\tx <tag>"


def test_byte_level_tokens_give_their_bytes(tmp_path):
    """A byte-level BPE trained on ASCII: every non-ASCII character is split into byte tokens."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["def total(x): return x * 2", "Cafe naive done <tag>"] * 20,
                           trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = str(tmp_path / "tokenizer.json")
    hf.save(path)
    tok = Tokenizer(path, None, None)
    ids = tok.encode(TEXT)
    pieces = [tok.token_bytes(t) for t in ids]
    assert b"".join(pieces) == TEXT.encode()
    partial = [t for t in ids if "\ufffd" in tok.decode([t])]
    assert len(partial) >= 4 and all(tok.token_bytes(t) for t in partial)
    assert all(tok.token_bytes(t) == tok.decode([t]).encode() for t in ids if t not in partial)


def test_sentencepiece_byte_fallback_tokens_give_their_byte(tmp_path):
    """SentencePiece's byte fallback (Llama 2, Mistral): a character the vocabulary lacks is spelled <0xNN>."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258, "▁a": 259}
    hf = HFTokenizer(models.BPE(vocab, [("▁", "a")], unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    path = str(tmp_path / "tokenizer.json")
    hf.save(path)
    tok = Tokenizer(path, None, None)
    ids = tok.encode("a é a")
    assert [tok.token_bytes(t) for t in ids] == [b"a", b" ", b"\xc3", b"\xa9", b" a"]
    assert tok.decode([ids[2]]) == "\ufffd"


@pytest.mark.parametrize("kind", ["word", "special"])
def test_tokens_without_byte_pieces_give_their_text(tmp_path, kind):
    hf = HFTokenizer(models.WordLevel({"<s>": 0, "t1": 1, "é": 2}, unk_token="t1"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens(["<s>"])
    path = str(tmp_path / "tokenizer.json")
    hf.save(path)
    tok = Tokenizer(path, None, None)
    if kind == "word":
        assert tok.token_bytes(2) == "é".encode() and tok.token_bytes(1) == b"t1"
    else:
        assert tok.token_bytes(0) == b"" and tok.decode([0]) == ""  # skipped in text, so no bytes either
