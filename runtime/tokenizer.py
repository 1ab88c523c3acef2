"""Text in and out, optional: the runtime itself works on token ids.

Uses the `tokenizers` package (Rust, no torch) for tokenizer.json and `jinja2` for the chat template, when
they are installed (pip install 'specedge[text]').
"""
from __future__ import annotations

import json
import os

from ..errors import BundleError, GenerationError
from ..graphs.manifest import Manifest


class Tokenizer:
    def __init__(self, path: str, bos_id: int | None, chat_template: str | None):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception for unreadable, non-JSON or incomplete files
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise BundleError(f"{path} is not a tokenizer the tokenizers package can read: {first}") from None
        self.bos_id = bos_id
        self.chat_template = chat_template
        self._byte_level = _has_decoder(json.loads(self._tok.to_str()).get("decoder"), "ByteLevel")

    @classmethod
    def from_bundle(cls, bundle_dir: str, manifest: Manifest) -> "Tokenizer | None":
        path = os.path.join(bundle_dir, "tokenizer", "tokenizer.json")
        if "tokenizer/tokenizer.json" not in manifest.tokenizer.files or not os.path.isfile(path):
            return None
        try:
            return cls(path, manifest.tokenizer.bos_id, manifest.tokenizer.chat_template)
        except ImportError:
            return None

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] + ids) if self.bos_id is not None and (not ids or ids[0] != self.bos_id) else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes | None:
        return self.token_text_and_bytes(token)[1]

    def token_text_and_bytes(self, token: int) -> tuple[str, bytes | None]:
        """One token's text and its own bytes, as OpenAI's logprobs report them: a token that holds part of a
        UTF-8 character has bytes but no text of its own ("\ufffd"). Byte-level BPE (GPT-2, Llama 3, Qwen,
        SmolLM2) spells each byte as one character of its alphabet; SentencePiece's byte fallback spells a byte
        <0xNN>. Otherwise the bytes are the token's text, or None where that text is not whole. A special token
        (no text) has no bytes."""
        text = self.decode([token])
        piece = self._tok.id_to_token(token)
        if not text or piece is None:
            return text, b""
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return text, bytes(_BYTE_OF_CHAR[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return text, bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return text, None if "\ufffd" in text else text.encode()

    @staticmethod
    def check_messages(messages) -> list[dict]:
        """Chat messages as a template takes them: a non-empty list of {role, content} with string content (a
        list of text parts is joined). Anything else is a GenerationError naming the first bad entry (a
        template handed a wrong shape renders garbage or fails inside jinja)."""
        if not isinstance(messages, list) or not messages:
            raise GenerationError("messages must be a non-empty list")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise GenerationError(f"messages[{i}] must be an object with a role")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise GenerationError(f"messages[{i}].content: only text parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise GenerationError(f"messages[{i}].content must be a string")
            out.append({**m, "content": content})  # other keys (a name, tool calls) are the template's to read
        return out

    def apply_chat_template(self, messages: str | list[dict]) -> list[int]:
        """The chat template rendered for the messages (a string is one user turn) plus the assistant's
        generation prompt, with the settings transformers renders chat templates with."""
        if not self.chat_template:
            raise GenerationError("this bundle's tokenizer has no chat template: give plain prompts (no --chat, "
                                  "no 'messages')")
        try:
            import jinja2
            import jinja2.sandbox
        except ImportError:
            raise GenerationError("chat templates need jinja2: pip install 'specedge[text]'") from None
        messages = self.check_messages([{"role": "user", "content": messages}] if isinstance(messages, str)
                                       else messages)

        def raise_exception(message):
            raise GenerationError(f"chat template: {message}")

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                          bos_token="", eos_token="")
        # The template writes its own special tokens; add no BOS beyond what it wrote.
        return self._tok.encode(text, add_special_tokens=False).ids


def _has_decoder(decoder: dict | None, kind: str) -> bool:
    """Whether a tokenizer.json decoder (or one of a Sequence's) is of this type."""
    if not decoder:
        return False
    return decoder.get("type") == kind or any(_has_decoder(d, kind) for d in decoder.get("decoders") or [])


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, the other 68 bytes for
    the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in kept}
    shifted = (b for b in range(256) if b not in chars)
    chars.update((b, chr(256 + i)) for i, b in enumerate(shifted))
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_alphabet()
