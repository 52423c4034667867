"""The engine's tokenizer: a `tokenizers.Tokenizer` (tokenizer.json) plus what tokenizer_config.json says.

Owns encoding (with the model's BOS behaviour), decoding, incremental detokenization for stop strings and
the special-token facts (BOS/EOS ids and strings, the chat template). No `transformers` import: the engine
stays light; tests compare against `transformers` separately.

Data is data (`encode_marked_batch`): a `MarkedText` is a text plus the character spans that came from
data. A special-token string (`<|im_end|>`, `<|endoftext|>`, ...) is a control token only where it lies
wholly outside the data spans; one that overlaps a data span is encoded as ordinary text. A text whose data
holds no special-token string is encoded exactly as `encode` encodes it (one call over the whole text, so
no BPE boundary at the span edges); only a text whose data does is cut at the template's own special
tokens, and each piece between them is encoded with special-token matching off (the tokenizers library
cuts the text at every special token before its pre-tokenizer runs, so these are the cut points it uses
anyway: for byte-level BPE the ids equal what the text would give if the data's special-token strings were
plain text; a Metaspace pre-tokenizer with `prepend_scheme: first`, Llama-2 style, would also prefix `▁` to
each piece, so such tokenizers may differ by that at the template's special tokens, in hostile rows only).
Added tokens that are not special (`special: false` in tokenizer.json) are matched in data as
the library always matches them.

Decoding drops an incomplete UTF-8 sequence at the end of the text (a row cut by max_new_tokens in the
middle of a character ends on the last whole character, not U+FFFD).
"""
from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Encoding
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

Span = tuple[int, int]


@dataclass(frozen=True)
class MarkedText:
    """A prompt text and the [start, end) character spans of it that are data (never control tokens)."""

    text: str
    data: tuple[Span, ...] = ()


def _overlaps(start: int, end: int, spans: Sequence[Span]) -> bool:
    return any(start < e and s < end for s, e in spans if s < e)


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def pending_utf8(data: bytes) -> int:
    """How many bytes at the end of `data` are an incomplete UTF-8 sequence (0: it ends on a whole
    character or on invalid bytes, which decode to U+FFFD as usual)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data, final=False)
    return len(decoder.getstate()[0])


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


class Tokenizer:
    """Encode/decode for one model. Build with `Tokenizer.from_dir(folder)`.

    `eos_token_ids` holds the tokenizer's EOS id (the facade adds the model config's EOS ids to it);
    `chat_template` is the Jinja source or None.
    """

    def __init__(self, tokenizer_json: Path, config: dict[str, Any] | None = None,
                 chat_template: str | None = None) -> None:
        self.path = Path(tokenizer_json)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {self.path}")
        self._tok = _HFTokenizer.from_file(str(self.path))
        self._tok.no_padding()
        self._tok.no_truncation()
        config = config or {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token, "bos_token")
        eos_id = self._id_of(self.eos_token, "eos_token")
        self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
        self.add_bos_token: bool | None = config.get("add_bos_token")
        self.chat_template = chat_template if chat_template is not None else config.get("chat_template")
        if isinstance(self.chat_template, list):  # the named-templates form: [{"name", "template"}]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default")
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self._json: str | None = None
        self._special = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        names = sorted(set(self._special.values()), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, names))) if names else None
        self._special_any = re.compile("(?=(" + self._special_re.pattern + "))") if names else None
        self._longest_special = max((len(n) for n in names), default=0)
        self._plain: _HFTokenizer | None = None
        self._decoder_kind: str | None = None

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Tokenizer":
        """Load tokenizer.json + tokenizer_config.json (+ chat_template.jinja / chat_template.json if there)."""
        folder = Path(folder)
        tokenizer_json = folder / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{config_path}: invalid JSON ({exc})") from exc
        template = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif (folder / "chat_template.json").is_file():
            template = json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
        return cls(tokenizer_json, config, template)

    def _id_of(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer_config.json: {field} {token!r} is not in the vocabulary of {self.path}")
        return token_id

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """One text -> token ids. `add_special_tokens` applies tokenizer.json's post-processor and BOS rule."""
        return self.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """Texts -> token ids (Rust, parallel). A rendered chat template is encoded with
        add_special_tokens=False (the template writes its own BOS), as transformers does."""
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        out = [e.ids for e in encodings]
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            out = [ids if ids[:1] == [self.bos_token_id] else [self.bos_token_id, *ids] for ids in out]
        return out

    # ---- data is data
    def count_special(self, text: str) -> int:
        """How many special-token strings `text` holds (leftmost-longest, as the tokenizer matches them)."""
        return 0 if self._special_re is None else sum(1 for _ in self._special_re.finditer(text))

    def data_holds_special(self, marked: MarkedText) -> bool:
        """Whether a special-token string overlaps one of the data spans (straddling an edge counts)."""
        if self._special_any is None:
            return False
        reach = self._longest_special - 1
        for s, e in marked.data:
            if s >= e:
                continue
            lo = max(0, s - reach)
            for m in self._special_any.finditer(marked.text, lo, min(len(marked.text), e + reach)):
                if m.start() < e and s < m.start() + len(m.group(1)):
                    return True
        return False

    def encode_marked_batch(self, texts: Sequence[MarkedText], *, add_special_tokens: bool = True) -> list[list[int]]:
        """Encode texts whose data spans must not produce control tokens (see the module docstring).
        Texts whose data holds no special-token string give exactly `encode_batch`'s ids."""
        out = self.encode_batch([t.text for t in texts], add_special_tokens=add_special_tokens)
        for i, marked in enumerate(texts):
            if marked.data and self.data_holds_special(marked):
                out[i] = self._encode_marked(marked, add_special_tokens)
        return out

    def _plain_tokenizer(self) -> _HFTokenizer:
        """A copy of the tokenizer that encodes special-token strings as text (built on first use)."""
        if self._plain is None:
            plain = _HFTokenizer.from_str(self.to_json())
            plain.no_padding()
            plain.no_truncation()
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def _encode_marked(self, marked: MarkedText, add_special_tokens: bool) -> list[int]:
        text, plain = marked.text, self._plain_tokenizer()
        whole = self._tok.encode(text, add_special_tokens=False)
        pieces: list[Encoding] = []
        pos = 0
        for token_id, (start, end) in zip(whole.ids, whole.offsets):
            if token_id not in self._special or _overlaps(start, end, marked.data):
                continue
            if start > pos:
                pieces.append(plain.encode(text[pos:start], add_special_tokens=False))
            pieces.append(self._tok.encode(text[start:end], add_special_tokens=False))
            pos = end
        if pos < len(text):
            pieces.append(plain.encode(text[pos:], add_special_tokens=False))
        if not pieces:
            return self.encode(text, add_special_tokens=add_special_tokens)
        merged = Encoding.merge(pieces, growing_offsets=True)
        if not add_special_tokens:
            return list(merged.ids)
        ids = list(self._tok.post_process(merged, add_special_tokens=True).ids)
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    # ---- decoding
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Token ids -> text, without an incomplete UTF-8 sequence at the end."""
        ids = list(ids)
        return self._whole_chars(ids, self._tok.decode(ids, skip_special_tokens=skip_special_tokens),
                                 skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], *, skip_special_tokens: bool = True) -> list[str]:
        """Many `decode`s at once (Rust, parallel)."""
        batch = [list(ids) for ids in batch]
        texts = self._tok.decode_batch(batch, skip_special_tokens=skip_special_tokens)
        return [self._whole_chars(ids, t, skip_special_tokens) for ids, t in zip(batch, texts)]

    def _whole_chars(self, ids: list[int], text: str, skip_special_tokens: bool) -> str:
        """`text` (the decode of `ids`) without the U+FFFD that an incomplete trailing UTF-8 sequence
        decodes to. Byte-level BPE (GPT-2 style) writes one U+FFFD for it; byte-fallback tokens
        (`<0xE2>`) one per byte token, so those trailing tokens are dropped and the rest re-decoded. A
        U+FFFD the model wrote as a whole character, or one for invalid bytes, stays."""
        if not text.endswith("\ufffd"):
            return text
        tail = [i for i in ids[-8:] if not (skip_special_tokens and i in self._special)]
        pieces = [self._token_bytes(i) for i in tail]
        if any(p is None for p in pieces):
            return text
        pending = pending_utf8(b"".join(pieces))  # type: ignore[arg-type]
        if not pending:
            return text
        if self._decoder() == "byte_level":
            return text[:-1]
        if all(_BYTE_TOKEN.fullmatch(self._tok.id_to_token(i) or "") for i in tail[-pending:]):
            shown = [k for k, i in enumerate(ids) if not (skip_special_tokens and i in self._special)]
            return self._tok.decode(ids[:shown[-pending]], skip_special_tokens=skip_special_tokens)
        return text

    def _decoder(self) -> str:
        """"byte_level" when tokenizer.json's decoder is (or holds) ByteLevel, else "other"."""
        if self._decoder_kind is None:
            decoder = json.loads(self.to_json()).get("decoder") or {}
            steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
            self._decoder_kind = "byte_level" if any(d.get("type") == "ByteLevel" for d in steps) else "other"
        return self._decoder_kind

    def _token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token contributes to the text, when this tokenizer's alphabet says (byte-level
        or `<0xHH>` byte-fallback tokens; a special token's text), else None."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return None
        if token_id in self._special:
            return piece.encode("utf-8")
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if self._decoder() == "byte_level":
            table = _byte_level_table()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return None
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer.json text (what llguidance builds its token trie from), serialised once."""
        if self._json is None:
            self._json = self._tok.to_str()
        return self._json

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Text of a growing token sequence, one token at a time, without re-decoding the whole sequence.

    `push(token_id)` returns the text that token completes ("" while a multi-byte character is still
    partial); `text` is everything so far. Special tokens are skipped.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer._tok
        self._stream = DecodeStream(skip_special_tokens=True)
        self.text = ""

    def push(self, token_id: int) -> str:
        piece = self._stream.step(self._tok, token_id) or ""
        self.text += piece
        return piece
