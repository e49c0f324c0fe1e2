"""An embedded demo pair: a folder holding a target, its NVFP4 copy and two drafters, plus what it
is measured on: held-out text, or token-id prompts.

The tiny pair (`examples/tiny/models` in a checkout) was trained on the Python standard
library's top-level source files (every machine with CPython has them offline);
`held_out_files.json` names the files kept out of training. A pair without a tokenizer (the
Kimi-shaped pair, `examples/kimi/models`) carries `prompts.json` instead:
`{"prompt_ids": [[...], ...]}`. The folder is given explicitly (`demo --pair DIR`), or by
example name (`demo --pair kimi` is `examples/kimi/models`, relative to the working directory:
a checkout's root, where `make demo` runs); nothing here guesses where a checkout lives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle31_export.errors import UserError
from eagle31_export.formats.tokenizer import load_tokenizer
from eagle31_export.parity.acceptance import text_prompts
from eagle31_export.parity.context import HELD_OUT_FILES, stdlib_texts

TARGET, TARGET_NVFP4 = "target", "target-nvfp4"
DRAFTERS = {"EAGLE-3": "drafter-eagle3", "EAGLE 3.1": "drafter-eagle31"}
DEFAULT_PAIR = Path("examples/tiny/models")  # relative to a checkout's root, where `make demo` runs
PROMPTS_FILE = "prompts.json"


def pair_folder(name_or_path: str | Path) -> Path:
    """`--pair` as given: a name without a slash is an example's models folder (`examples/NAME/models`)."""
    text = str(name_or_path)
    if "/" not in text and text not in (".", ".."):
        return Path("examples") / text / "models"
    return Path(text)


@dataclass(frozen=True)
class EmbeddedPair:
    folder: Path

    @classmethod
    def open(cls, folder: str | Path) -> "EmbeddedPair":
        folder = Path(folder)
        missing = [n for n in (TARGET, TARGET_NVFP4, *DRAFTERS.values()) if not (folder / n / "config.json").is_file()]
        if missing:
            raise UserError(f"{folder}: not a demo pair (no {missing[0]}/config.json); pass --pair with the "
                            "models folder of an example, e.g. examples/tiny/models in a checkout, or an "
                            "example's name (tiny, kimi)")
        if not (folder / HELD_OUT_FILES).is_file() and not (folder / PROMPTS_FILE).is_file():
            raise UserError(f"{folder}: not a demo pair (neither {HELD_OUT_FILES} nor {PROMPTS_FILE}: "
                            "nothing to measure it on)")
        return cls(folder)

    @property
    def has_text(self) -> bool:
        """Whether the pair is measured on held-out text (else on its token-id prompts)."""
        return (self.folder / HELD_OUT_FILES).is_file()

    @property
    def name(self) -> str:
        return self.folder.parent.name if self.folder.name == "models" else self.folder.name

    def token_prompts(self) -> list[list[int]]:
        """The pair's own token-id prompts (`prompts.json`), checked against its target's vocabulary."""
        from eagle31_export.formats.target.checkpoint import read_target_info

        path = self.folder / PROMPTS_FILE
        try:
            prompts = json.loads(path.read_text())["prompt_ids"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"{path}: expected {{\"prompt_ids\": [[...], ...]}} ({err})") from None
        vocab = read_target_info(self.target).vocab_size
        ok = isinstance(prompts, list) and prompts and all(
            isinstance(p, list) and p and all(isinstance(i, int) and 0 <= i < vocab for i in p) for p in prompts)
        if not ok:
            raise UserError(f"{path}: prompt_ids must be non-empty lists of token ids below {vocab}")
        return prompts

    def prompts(self, context_len: int = 64) -> list[list[int]]:
        """What tau is measured on: held-out windows of `context_len` tokens, or the pair's prompts."""
        return self.held_out_prompts(context_len) if self.has_text else self.token_prompts()

    def agreement_windows(self, length: int, count: int = 8) -> list[list[int]]:
        """Sequences for teacher-forced agreement: held-out text windows, or the pair's prompts."""
        if self.has_text:
            return text_prompts(self.tokenizer(), self.held_out_texts(), length)[:count]
        return self.token_prompts()[:count]

    @property
    def target(self) -> Path:
        return self.folder / TARGET

    @property
    def target_nvfp4(self) -> Path:
        return self.folder / TARGET_NVFP4

    def drafter(self, label: str) -> Path:
        return self.folder / DRAFTERS[label]

    def held_out_texts(self) -> list[str]:
        return stdlib_texts(json.loads((self.folder / HELD_OUT_FILES).read_text()))

    def tokenizer(self):
        return load_tokenizer(self.target, "the demo pair's target must carry its tokenizer")

    def held_out_prompts(self, context_len: int = 64, per_text: int = 1) -> list[list[int]]:
        return text_prompts(self.tokenizer(), self.held_out_texts(), context_len, per_text)

    def mixed_length_prompts(self, lengths=(16, 48, 96, 192), per_length: int = 2) -> list[list[int]]:
        """Held-out windows of several context lengths (for tau against context length); a pair without
        text: its own prompts (of mixed lengths)."""
        if not self.has_text:
            return self.token_prompts()
        tok, texts = self.tokenizer(), self.held_out_texts()
        prompts = []
        for i, length in enumerate(lengths):
            prompts += text_prompts(tok, texts[i::len(lengths)], length)[:per_length]
        return prompts
