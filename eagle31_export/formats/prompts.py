"""Prompt files: JSONL, one `{"prompt_ids": [...]}` or `{"text": "..."}` per line (text needs the
target's tokenizer). Used by `quantize --calib-prompts` and `parity --prompts`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from eagle31_export.errors import UserError
from eagle31_export.formats.tokenizer import load_tokenizer


def read_prompts(path: str | os.PathLike, model_dir: str | os.PathLike, vocab_size: int) -> list[list[int]]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such prompts file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 text (byte {err.start}); expected JSONL, one object per line") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror or err})") from None
    tokenizer = None
    prompts: list[list[int]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as err:
            raise UserError(f"{where}: not JSON ({err}); each line must be an object with 'prompt_ids' or 'text'") from None
        if isinstance(row, dict) and "prompt_ids" in row:
            ids = row["prompt_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                raise UserError(f"{where}: 'prompt_ids' must be a non-empty list of integers")
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            tokenizer = tokenizer or load_tokenizer(model_dir, f"{where} has 'text': give 'prompt_ids' instead")
            ids = tokenizer(row["text"])["input_ids"]
            if not ids:
                raise UserError(f"{where}: 'text' tokenizes to no tokens; give a non-empty prompt")
        else:
            raise UserError(f"{where}: expected an object with 'prompt_ids' (list of ints) or 'text' (string)")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise UserError(f"{where}: token id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1})")
        prompts.append(ids)
    if not prompts:
        raise UserError(f"{path}: no prompts; add JSONL lines with 'prompt_ids' or 'text'")
    return prompts
