"""The model's tokenizer on the frontend side: text <-> ids and chat templates, from a local directory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_server.engine.types import RequestError
from engine_server.frontend.byte_level import ByteLevelTables
from engine_server.frontend.detokenizer import DetokenizerFactory
from engine_server.frontend.hf_tokenizer import load_hf_tokenizer


class TokenizerLoadError(RuntimeError):
    """The model directory has no loadable tokenizer."""


@dataclass(frozen=True, slots=True)
class Encoding:
    token_ids: list[int]
    offsets: list[tuple[int, int]]  # (start, end) character offsets into the text, one per token


class Tokenizer:
    """A thin wrapper over a Hugging Face fast tokenizer.

    Decoding goes straight to the Rust `tokenizers.Tokenizer` (no Python-side clean-up), so that
    `decode` is exactly what the incremental detokenizer reproduces.
    """

    __slots__ = (
        "_hf", "backend", "bos_token_id", "byte_tables", "detokenizers", "eos_token_id", "max_token_bytes",
        "path", "special_ids", "vocab_size",
    )

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            hf = load_hf_tokenizer(self.path)
        except (OSError, ValueError) as exc:
            raise TokenizerLoadError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerLoadError(f"{str(path)!r} has no fast tokenizer (tokenizer.json); none is served")
        # NOTE: some tokenizer.json files (MiniLM's) pad every encoding to 128 and truncate at 128; the server
        # counts, validates and pads tokens itself, so `encode` must return exactly the text's tokens.
        backend.no_padding()
        backend.no_truncation()
        self._hf: Any = hf
        self.backend: Any = backend  # tokenizers.Tokenizer
        self.eos_token_id: int | None = hf.eos_token_id
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)
        self.special_ids: frozenset[int] = frozenset(hf.all_special_ids)
        # NOTE: built here (start-up runs this off the event loop): ~0.2 s for a 150k vocabulary.
        self.byte_tables: ByteLevelTables | None = ByteLevelTables.build(backend)
        self.detokenizers = DetokenizerFactory(backend, self.byte_tables)
        # NOTE: no token stands for more bytes of text than this, so a text longer than N times it has more
        # than N tokens (api/text_input.py refuses such text before reading it)
        self.max_token_bytes: int = longest_token_bytes(backend, is_byte_level=self.byte_tables is not None)

    # NOTE: through the Rust tokenizer's batch calls, which release the GIL (its single-input `encode` and
    # `decode` hold it throughout): a long text on a worker thread (frontend/tokenizer_pool.py) leaves the
    # event loop running. Same ids and offsets.

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Encoding:
        """Token ids and each token's code-point span in `text`."""
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return Encoding(encoding.ids, encoding.offsets)

    def encode_ids(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids only (no offsets: ~30% faster than `encode`)."""
        (encoding,) = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        (text,) = self.backend.decode_batch([list(token_ids)], skip_special_tokens=skip_special_tokens)
        return str(text)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def render_chat(self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True) -> str:
        """A conversation rendered with the model's chat template, as text (tokenize it without adding special
        tokens: templates carry their own BOS/special tokens, and adding them again would double them)."""
        if not self.has_chat_template:
            raise RequestError("messages", "this model has no chat template; send text or token ids instead")
        conversation = [{"role": role, "content": content} for role, content in messages]
        try:
            rendered = self._hf.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:
            raise RequestError("messages", f"the chat template rejected the conversation: {exc}") from exc
        return str(rendered)

    def apply_chat_template(
        self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Render a conversation with the model's chat template and tokenize it."""
        rendered = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode_ids(rendered, add_special_tokens=False)


def longest_token_bytes(backend: Any, *, is_byte_level: bool) -> int:
    """The most bytes of UTF-8 text that one token can stand for: its longest vocabulary entry.

    NOTE: an entry is never shorter than the text its token covers: byte-level BPE spells each byte as one
    character (so its entries count characters), SentencePiece spells the space its piece covers as "▁" (3
    bytes for 1), WordPiece adds "##", byte-fallback pieces are "<0x41>", added tokens are their own text. A
    tokenizer that drops text can fold more into fewer tokens (WordPiece drops whitespace and makes one [UNK]
    of an unknown word of any length): for those the bound limits what a client may send, as documented,
    rather than what could fit.
    """
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False)
    longest_added = max((len(content.encode()) for content in added), default=1)
    if is_byte_level:
        longest = max((len(entry) for entry in vocab), default=1)
    else:
        longest = max((len(entry.encode()) for entry in vocab), default=1)
    return max(longest, longest_added, 1)
