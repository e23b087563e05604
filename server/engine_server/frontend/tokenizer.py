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
        "_hf", "backend", "bos_token_id", "byte_tables", "detokenizers", "eos_token_id", "path",
        "special_ids", "vocab_size",
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

    def encode(self, text: str, *, add_special_tokens: bool = True) -> Encoding:
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return Encoding(list(encoding.ids), list(encoding.offsets))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def apply_chat_template(
        self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Render a conversation with the model's chat template and tokenize it."""
        if not self.has_chat_template:
            raise RequestError("messages", "this model has no chat template; send text or token ids instead")
        conversation = [{"role": role, "content": content} for role, content in messages]
        try:
            rendered = self._hf.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:
            raise RequestError("messages", f"the chat template rejected the conversation: {exc}") from exc
        # NOTE: templates carry their own BOS/special tokens; adding them again would double them.
        return self.encode(str(rendered), add_special_tokens=False).token_ids
