"""The engine's tokenizer: a `tokenizers.Tokenizer` (tokenizer.json) plus what tokenizer_config.json says.

Owns encoding (with the model's BOS behaviour), decoding, incremental detokenization for stop strings and
the special-token facts (BOS/EOS ids and strings, the chat template). No `transformers` import: the engine
stays light; tests compare against `transformers` separately.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


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

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], *, skip_special_tokens: bool = True) -> list[str]:
        return self._tok.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

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
