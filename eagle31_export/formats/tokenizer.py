"""The target's tokenizer, read from its folder (never downloaded, never remote code)."""

from __future__ import annotations

import os
from pathlib import Path

from eagle31_export.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def has_tokenizer(folder: str | os.PathLike) -> bool:
    return any((Path(folder) / n).exists() for n in TOKENIZER_FILES)


def load_tokenizer(folder: str | os.PathLike, needed_for: str | None = None):
    """The tokenizer saved in `folder`; None when there is none and `needed_for` is None,
    else a one-line UserError saying what it was needed for."""
    from transformers import AutoTokenizer

    try:
        if not has_tokenizer(folder):
            raise OSError("no tokenizer files")
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError):
        if needed_for is None:
            return None
        raise UserError(f"{folder} has no tokenizer; {needed_for}") from None
    except Exception as err:  # tokenizer files are parsed by `tokenizers` (Rust), whose errors are plain Exceptions
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UserError(f"{folder}: its tokenizer files cannot be read ({first}); re-save them, or "
                        f"{needed_for or 'pass token ids instead'}") from None
