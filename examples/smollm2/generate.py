"""Self-distillation data for the real pair's drafters: the target writes the assistant turns.

    python examples/smollm2/generate.py [--minutes 60]      # resumes where the last run stopped

As EAGLE-3 and SpecForge regenerate their training data with the target, each training prompt of
`prompts.py` (one user turn, the default system prompt added by the chat template) is answered by
the target itself, greedily, in fp32, up to MAX_NEW_TOKENS tokens. Prompts are taken in the fixed
order `prompts.build` gives, CHUNK at a time; each chunk is written as one compressed shard of token
ids, `data/answers-NNNNN.jsonl.gz` (one line per prompt: its key and the answer's ids), renamed into
place when complete. A rerun starts at the first chunk without a shard, on any machine: the prompts
and the target are rebuilt identically, and only the answers (token ids) are kept.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import prompts as prompt_builder  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGET = HERE / "models" / "target"
DATA = HERE / "data"
CHUNK = 64  # prompts per shard
BATCH = 16  # prompts per generate call, grouped by length within a chunk
MAX_PROMPT_TOKENS = 1792  # so prompt + answer fit a 2048-token training window
MAX_NEW_TOKENS = 256


def chat_ids(tokenizer, text: str) -> list[int]:
    """The prompt as the target is served: chat template, default system prompt, generation prompt."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def shard_path(index: int) -> Path:
    return DATA / f"answers-{index:05d}.jsonl.gz"


def done_chunks() -> int:
    index = 0
    while shard_path(index).is_file():
        index += 1
    return index


@torch.no_grad()
def answer(model, tokenizer, batch: list[list[int]]) -> list[list[int]]:
    """Greedy answers to prompts of any lengths (left-padded), each cut after its first <|im_end|>."""
    eos, width = tokenizer.eos_token_id, max(len(p) for p in batch)
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos)[:, width:].tolist()
    return [row[:row.index(eos) + 1] if eos in row else row for row in out]


def chunk_prompts(tokenizer, ordered: list, index: int) -> list[tuple]:
    """Chunk `index`'s prompts with their chat ids, in the order its shard's records are written: those
    of at most MAX_PROMPT_TOKENS tokens, by length (a stable sort). Keys are not unique (two methods of
    one name in a file), so a record belongs to the prompt at its position, not to its key."""
    encoded = [(p, chat_ids(tokenizer, p.text)) for p in ordered[index * CHUNK:(index + 1) * CHUNK]]
    return sorted((e for e in encoded if len(e[1]) <= MAX_PROMPT_TOKENS), key=lambda e: len(e[1]))


def write_shard(index: int, records: list[dict]) -> None:
    path = shard_path(index)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with gzip.open(tmp, "wt") as f:
        for record in records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")
    os.rename(tmp, path)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60, help="stop after the chunk that crosses this")
    ap.add_argument("--chunks", type=int, default=None, help="stop after this many chunks in all")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    DATA.mkdir(exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ordered = prompt_builder.build(prompt_builder.split()[0])
    start, index = time.time(), done_chunks()
    while index * CHUNK < len(ordered) and (args.chunks is None or index < args.chunks):
        encoded = chunk_prompts(tokenizer, ordered, index)
        records = []
        for b in range(0, len(encoded), BATCH):
            group = encoded[b:b + BATCH]
            for (p, _), ids in zip(group, answer(model, tokenizer, [ids for _, ids in group])):
                records.append({"key": p.key, "answer": ids})
        write_shard(index, records)
        tokens = sum(len(r["answer"]) for r in records)
        print(f"chunk {index}: {len(records)} answers, {tokens} tokens ({time.time() - start:.0f}s)", flush=True)
        index += 1
        if time.time() - start > args.minutes * 60:
            break


if __name__ == "__main__":
    main()
