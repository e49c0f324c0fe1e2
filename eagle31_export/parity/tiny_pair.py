"""The embedded default: the tiny trained pair in examples/tiny/models, and its held-out text.

The pair was trained on the Python standard library's top-level source files (every machine
with CPython has them offline); `held_out_files.json` names the files kept out of training.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from eagle31_export.errors import UserError

MODELS = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "models"
TARGET, TARGET_NVFP4 = "target", "target-nvfp4"
DRAFTERS = {"EAGLE-3": "drafter-eagle3", "EAGLE 3.1": "drafter-eagle31"}


def models_dir(folder: Path | None = None) -> Path:
    folder = Path(folder or MODELS)
    if not (folder / TARGET / "config.json").is_file():
        raise UserError(f"{folder}: the tiny pair is missing; run from a checkout of the repository "
                        "(examples/tiny/models) or retrain it with examples/tiny/train.py")
    return folder


def held_out_texts(folder: Path | None = None) -> list[str]:
    names = json.loads((models_dir(folder) / "held_out_files.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / n).read_text(encoding="utf-8", errors="replace") for n in names if (stdlib / n).is_file()]
    if not texts:
        raise UserError(f"none of the held-out files are in {stdlib}; is this the CPython the pair was trained for?")
    return texts


def tokenizer(folder: Path | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(models_dir(folder) / TARGET), local_files_only=True)


def held_out_prompts(context_len: int = 64, per_text: int = 1, folder: Path | None = None) -> list[list[int]]:
    from eagle31_export.parity.acceptance import text_prompts

    return text_prompts(tokenizer(folder), held_out_texts(folder), context_len, per_text)


def mixed_length_prompts(lengths=(16, 48, 96, 192), per_length: int = 2, folder: Path | None = None) -> list[list[int]]:
    """Held-out windows of several context lengths (for tau against context length)."""
    from eagle31_export.parity.acceptance import text_prompts

    tok, texts = tokenizer(folder), held_out_texts(folder)
    prompts = []
    for i, length in enumerate(lengths):
        prompts += text_prompts(tok, texts[i::len(lengths)], length)[:per_length]
    return prompts
