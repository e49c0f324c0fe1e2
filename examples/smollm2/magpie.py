"""User requests written by the target itself (the Magpie method), for the real pair's training data.

    python examples/smollm2/magpie.py --engine vllm --shards 4      # prompts only; generate_chat.py
                                                                    # writes them and answers them

An instruction model continued from the opening of a user turn, `<|im_start|>user\\n` (after a system
turn or none), writes a user request of the kind it was trained on (Xu et al., "Magpie: Alignment Data
Synthesis from Scratch by Prompting Aligned LLMs with Nothing", arXiv:2406.08464: temperature 1,
top-p 1, the turn ended by the model's end-of-turn token). The system prompt steers what is asked:
SYSTEM_PROMPTS, none and the template's default the most often.

Each request is kept if the model ended the turn itself, it is English-looking text of MIN_WORDS to
MAX_PROMPT_TOKENS, and it does not loop; then deduplicated (lower-cased, punctuation and spaces
collapsed) against every earlier shard. One in HELD_OUT_EVERY requests, chosen by a hash of that
normalized text, is held out (never answered for training: evaluation prompts of the same kind).

A shard, `data/chat/prompts-NNNNN.jsonl.gz`, holds one line per kept request: its text, the system
prompt's label, its split. It is written whole and renamed into place; a rerun skips shards that
exist, and sampling seeds depend on the shard and request index only. `prompts-counts.json` keeps,
per shard, how many requests were kept and why the others were dropped.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engines  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGET = HERE / "models" / "target"
CHAT = HERE / "data" / "chat"
COUNTS = CHAT / "prompts-counts.json"

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the chat template's
# label -> (system prompt or None, weight): the share of requests written under it
SYSTEM_PROMPTS: dict[str, tuple[str | None, int]] = {
    "none": (None, 4),
    "default": (DEFAULT_SYSTEM, 4),
    "assistant": ("You are a helpful assistant.", 2),
    "coding": ("You are an expert programmer. You help users write, explain, debug and review code in any "
               "programming language.", 2),
    "math": ("You are a patient math tutor. You solve problems step by step and explain your reasoning.", 1),
    "writing": ("You are a creative writing assistant. You help with stories, poems, letters, emails and essays.", 1),
    "knowledge": ("You answer questions about science, history, geography, health and everyday life, "
                  "accurately and clearly.", 1),
    "concise": ("You are a concise assistant. Answer in a few sentences.", 1),
}
LABELS = [label for label, (_, weight) in SYSTEM_PROMPTS.items() for _ in range(weight)]
TEMPERATURE = 1.0
PER_SHARD = 128  # requests sampled a shard
MAX_PROMPT_TOKENS = 256
MIN_WORDS = 3
HELD_OUT_EVERY = 20
COMMON = set("the a an to of and is in for what how can you i my me your it this that with on be are do does "
             "write explain please give make help tell why which who when where list describe create".split())


def system_block(label: str) -> str:
    text = SYSTEM_PROMPTS[label][0]
    return "" if text is None else f"<|im_start|>system\n{text}<|im_end|>\n"


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def opening(tokenizer, label: str) -> list[int]:
    """What the model continues to write a request: the system turn (if any), then a user turn's start."""
    return encode(tokenizer, system_block(label) + "<|im_start|>user\n")


def prompt_ids(tokenizer, label: str, text: str) -> list[int]:
    """A one-turn conversation as served, ready for the answer (for "default", what the chat template gives)."""
    return encode(tokenizer, system_block(label) + f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def normalized(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def text_hash(text: str) -> str:
    return hashlib.sha1(normalized(text).encode()).hexdigest()


def held_out(text: str) -> bool:
    return int(text_hash(text)[:8], 16) % HELD_OUT_EVERY == 0


def rejection(ids: list[int], text: str) -> str | None:
    """Why a written request is not kept, or None."""
    if not ids or ids[-1] != engines.EOS:
        return "unfinished"
    if "<|im_" in text or re.match(r"\s*(assistant|user|system)\b", text):
        return "role text"
    words = text.split()
    if len(words) < MIN_WORDS or len(ids) > MAX_PROMPT_TOKENS:
        return "length"
    if sum(c.isascii() for c in text) < 0.97 * len(text) or not COMMON.intersection(w.lower().strip(".,?!:;") for w in words):
        return "language"
    trigrams = Counter(zip(words, words[1:], words[2:]))
    if trigrams and trigrams.most_common(1)[0][1] > 3:
        return "repetition"
    return None


def prompts_path(index: int) -> Path:
    return CHAT / f"prompts-{index:05d}.jsonl.gz"


def read_jsonl(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with gzip.open(tmp, "wt") as f:
        for record in records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
    os.rename(tmp, path)


def seen_hashes(before: int) -> set[str]:
    return {text_hash(r["text"]) for i in range(before) if prompts_path(i).is_file()
            for r in read_jsonl(prompts_path(i))}


def write_shard(engine, tokenizer, index: int, seen: set[str]) -> dict:
    """Sample PER_SHARD requests, keep, dedup, split; write prompts-<index>. Returns the counts."""
    labels = [LABELS[(index * PER_SHARD + i) % len(LABELS)] for i in range(PER_SHARD)]
    requests = [engines.Request(opening(tokenizer, label), TEMPERATURE, MAX_PROMPT_TOKENS + 1,
                                seed=1_000_003 * index + i) for i, label in enumerate(labels)]
    counts: Counter = Counter()
    records = []
    for label, ids in zip(labels, engine.generate(requests)):
        text = tokenizer.decode(ids[:-1] if ids and ids[-1] == engines.EOS else ids).strip()
        reason = rejection(ids, text)
        if reason is None and text_hash(text) in seen:
            reason = "duplicate"
        counts[reason or "kept"] += 1
        if reason is None:
            seen.add(text_hash(text))
            records.append({"text": text, "system": label, "split": "held_out" if held_out(text) else "train",
                            "written_tokens": len(ids)})
    write_jsonl(prompts_path(index), records)
    written = written_counts()
    written[str(index)] = dict(counts)
    tmp = COUNTS.with_name(f".{COUNTS.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(written, sort_keys=True) + "\n")
    os.rename(tmp, COUNTS)
    return dict(counts)


def written_counts() -> dict[str, dict]:
    """Per prompts shard: requests kept, and dropped by reason (`rejection`, "duplicate")."""
    return json.loads(COUNTS.read_text()) if COUNTS.is_file() else {}


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    ap.add_argument("--shards", type=int, default=1, help="write prompt shards up to this index (exclusive)")
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    engine = engines.make(args.engine, TARGET)
    seen = seen_hashes(args.shards)
    for index in range(args.shards):
        if not prompts_path(index).is_file():
            print(f"prompts {index}: {write_shard(engine, tokenizer, index, seen)}", flush=True)


if __name__ == "__main__":
    main()
