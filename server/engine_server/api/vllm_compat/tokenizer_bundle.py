"""The model's tokenizer files as one zip (what GetTokenizer streams), plus its sha256.

The zip is deterministic (sorted names, fixed timestamps): the same files always give the same sha256, so
a gateway can cache by fingerprint.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHUNK_SIZE = 64 * 1024  # smg's gRPC client reads 64 KiB chunks; well under any message-size limit

# What smg's tokenizer loader reads: the tokenizer itself, its config and chat template, and the model's
# config files (for special token ids and context length).
_FILE_NAMES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.json",
    "config.json", "generation_config.json",
})
_SUFFIXES = (".jinja", ".tiktoken", ".model")
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class TokenizerBundle:
    data: bytes  # the zip
    sha256: str  # hex digest of `data`
    file_names: tuple[str, ...]

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[tuple[bytes, str]]:
        """(bytes, sha256-or-empty) pieces; only the last one carries the digest."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        total = len(self.data)
        for start in range(0, total, chunk_size):
            end = min(start + chunk_size, total)
            yield self.data[start:end], self.sha256 if end == total else ""


def tokenizer_file_names(directory: Path) -> list[str]:
    return sorted(
        path.name for path in directory.iterdir()
        if path.is_file() and (path.name in _FILE_NAMES or path.name.endswith(_SUFFIXES))
    )


def build_tokenizer_bundle(directory: Path) -> TokenizerBundle:
    """Raises FileNotFoundError when the directory holds no tokenizer file."""
    names = tokenizer_file_names(directory)
    if "tokenizer.json" not in names and "tokenizer.model" not in names and "vocab.json" not in names:
        raise FileNotFoundError(f"no tokenizer files in {str(directory)!r}")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, (directory / name).read_bytes())
    data = buffer.getvalue()
    return TokenizerBundle(data=data, sha256=hashlib.sha256(data).hexdigest(), file_names=tuple(names))
