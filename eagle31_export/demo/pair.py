"""An embedded demo pair: a folder holding a target, its NVFP4 copy and two drafters, plus the
held-out text it is measured on.

The tiny pair (`examples/tiny/models` in a checkout) was trained on the Python standard
library's top-level source files (every machine with CPython has them offline);
`held_out_files.json` names the files kept out of training. The folder is always given
explicitly (`demo --pair DIR`); nothing here guesses where a checkout lives.
"""

from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from eagle31_export.errors import UserError
from eagle31_export.formats.tokenizer import load_tokenizer
from eagle31_export.parity.acceptance import text_prompts

TARGET, TARGET_NVFP4 = "target", "target-nvfp4"
DRAFTERS = {"EAGLE-3": "drafter-eagle3", "EAGLE 3.1": "drafter-eagle31"}
DEFAULT_PAIR = Path("examples/tiny/models")  # relative to a checkout's root, where `make demo` runs


@dataclass(frozen=True)
class EmbeddedPair:
    folder: Path

    @classmethod
    def open(cls, folder: str | Path) -> "EmbeddedPair":
        folder = Path(folder)
        missing = [n for n in (TARGET, TARGET_NVFP4, *DRAFTERS.values()) if not (folder / n / "config.json").is_file()]
        if missing:
            raise UserError(f"{folder}: not a demo pair (no {missing[0]}/config.json); pass --pair with the "
                            "models folder of an example, e.g. examples/tiny/models in a checkout")
        return cls(folder)

    @property
    def target(self) -> Path:
        return self.folder / TARGET

    @property
    def target_nvfp4(self) -> Path:
        return self.folder / TARGET_NVFP4

    def drafter(self, label: str) -> Path:
        return self.folder / DRAFTERS[label]

    def held_out_texts(self) -> list[str]:
        names = json.loads((self.folder / "held_out_files.json").read_text())
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = [(stdlib / n).read_text(encoding="utf-8", errors="replace") for n in names if (stdlib / n).is_file()]
        if not texts:
            raise UserError(f"none of the held-out files are in {stdlib}; is this the CPython the pair was trained for?")
        return texts

    def tokenizer(self):
        return load_tokenizer(self.target, "the demo pair's target must carry its tokenizer")

    def held_out_prompts(self, context_len: int = 64, per_text: int = 1) -> list[list[int]]:
        return text_prompts(self.tokenizer(), self.held_out_texts(), context_len, per_text)

    def mixed_length_prompts(self, lengths=(16, 48, 96, 192), per_length: int = 2) -> list[list[int]]:
        """Held-out windows of several context lengths (for tau against context length)."""
        tok, texts = self.tokenizer(), self.held_out_texts()
        prompts = []
        for i, length in enumerate(lengths):
            prompts += text_prompts(tok, texts[i::len(lengths)], length)[:per_length]
        return prompts
