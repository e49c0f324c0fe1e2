"""The target's tokenizer, read from its folder (never downloaded, never remote code)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from eagle31_export.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def has_tokenizer(folder: str | os.PathLike) -> bool:
    return any((Path(folder) / n).exists() for n in TOKENIZER_FILES)


def load_tokenizer(folder: str | os.PathLike, needed_for: str | None = None):
    """The tokenizer saved in `folder`; None when there is none and `needed_for` is None,
    else a one-line UserError saying what it was needed for. Tokenizer files that are there
    but cannot be read are an error either way, naming the file and the parser's reason."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not has_tokenizer(folder):
        if needed_for is None:
            return None
        raise UserError(f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}); {needed_for}")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as err:  # `tokenizers` (Rust) raises plain Exceptions, transformers OSError/ValueError
        where, reason = _unreadable_file(folder, err)
        raise UserError(f"{where}: the tokenizer cannot be read ({reason}); re-save it, or "
                        f"{needed_for or 'pass token ids instead'}") from None


def _unreadable_file(folder: Path, err: Exception) -> tuple[Path, str]:
    """The tokenizer file at fault and why: a JSON file that does not parse names itself and the
    parser's message; otherwise the first file present and the loader's own first line."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as bad:
                return path, f"not valid JSON: {bad}"
    present = next(folder / n for n in TOKENIZER_FILES if (folder / n).exists())
    return present, (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
