"""The target's own answers to requests of many kinds: Magpie requests and standard-library prompts,
greedy and sampled, some of two turns.

    python examples/smollm2/generate_chat.py --engine vllm --hours 6     # resumes at the first missing shard
    python examples/smollm2/generate_chat.py --engine transformers --bench 64   # output tokens/s, greedy

Shard NNNNN is made in two steps, each written whole and renamed into place (a rerun redoes only a
missing step, with the same sampling seeds):

1. `data/chat/prompts-NNNNN.jsonl.gz`: requests the target writes itself (`magpie.py`).
2. `data/chat/answers-NNNNN.jsonl.gz`: one conversation a line, as token ids (`ids`: the served
   prompt, then the target's answer, and for two-turn ones the next request and answer), with its
   kind: `source` (magpie or stdlib), `system` (the system prompt's label, `magpie.SYSTEM_PROMPTS`, in
   the conversation; `written_under`: the one the request was written under, see below),
   `mode` (greedy, t0.7 or t1.0: the answers' temperature), `turns`, `answer_tokens` (the target's
   tokens in `ids`). Its requests: the shard's training Magpie requests, and STDLIB_PER_SHARD
   standard-library prompts (`prompts.py`, the default system prompt) taken from the end of
   `generate.py`'s order backwards, so that the two scripts do not answer the same prompts soon.

Without a system prompt the target seldom ends a request it writes (most run past MAX_PROMPT_TOKENS),
so half of the requests written under the default system prompt (by hash) are answered without one.
Answer modes by a hash of the request: half greedy, a quarter each at temperature 0.7 and 1.0 (top-p
1), as EAGLE-3 data are regenerated at the temperatures users serve. A Magpie conversation is given
a second turn (one in SECOND_TURN_EVERY, by hash) when the first answer ended and the whole fits
SECOND_TURN_BEFORE tokens: the target writes the next request as in step 1, then answers it in the
same mode. Every conversation fits WINDOW tokens (the training windows' largest).

`data/chat/progress.json`, rewritten after every shard, counts what the shards hold: conversations
and answer tokens by source, system prompt, mode and turns, held-out requests, and why written
requests were dropped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engines  # noqa: E402
import magpie  # noqa: E402
import prompts as prompt_builder  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGET = HERE / "models" / "target"
CHAT = magpie.CHAT
PROGRESS = CHAT / "progress.json"
WINDOW = 2048
MAX_NEW_TOKENS = 512
STDLIB_PER_SHARD = 24
MODES = (("greedy", 0.0), ("greedy", 0.0), ("t0.7", 0.7), ("t1.0", 1.0))
SECOND_TURN_EVERY = 3
SECOND_TURN_BEFORE = 1024


def answers_path(index: int) -> Path:
    return CHAT / f"answers-{index:05d}.jsonl.gz"


def _hash(text: str, salt: str) -> int:
    return int(hashlib.sha1(f"{salt}:{text}".encode()).hexdigest()[:8], 16)


def mode_of(text: str) -> tuple[str, float]:
    return MODES[_hash(text, "mode") % len(MODES)]


def stdlib_prompts(tokenizer, ordered: list, index: int) -> list[tuple]:
    """Shard `index`'s standard-library prompts: (key, kind, chat ids), from the end of the order back."""
    from generate import MAX_PROMPT_TOKENS, chat_ids
    end = len(ordered) - index * STDLIB_PER_SHARD
    picked = ordered[max(0, end - STDLIB_PER_SHARD):max(0, end)][::-1]
    encoded = [(p.key, p.kind, chat_ids(tokenizer, p.text)) for p in picked]
    return [e for e in encoded if len(e[2]) <= MAX_PROMPT_TOKENS]


def answer_shard(engine, tokenizer, ordered: list, index: int) -> list[dict]:
    conversations = []  # dicts with "ids" ready for the answer
    for i, r in enumerate(magpie.read_jsonl(magpie.prompts_path(index))):
        if r["split"] == "train":
            mode, temperature = mode_of(r["text"])
            system = "none" if r["system"] == "default" and _hash(r["text"], "system") % 2 else r["system"]
            conversations.append({"source": "magpie", "system": system, "written_under": r["system"], "mode": mode,
                                  "temperature": temperature, "ids": magpie.prompt_ids(tokenizer, system, r["text"]),
                                  "second": _hash(r["text"], "turn") % SECOND_TURN_EVERY == 0, "seed": i})
    for j, (key, kind, ids) in enumerate(stdlib_prompts(tokenizer, ordered, index)):
        mode, temperature = mode_of(key)
        conversations.append({"source": "stdlib", "kind": kind, "key": key, "system": "default", "mode": mode,
                              "temperature": temperature, "ids": ids, "second": False, "seed": 10_000 + j})
    base = 1_000_003 * index

    def answer(items: list[dict], salt: int) -> None:
        requests = [engines.Request(c["ids"], c["temperature"], min(MAX_NEW_TOKENS, WINDOW - len(c["ids"])),
                                    base + salt + c["seed"]) for c in items]
        for c, ids in zip(items, engine.generate(requests)):
            c["ids"] = c["ids"] + ids
            c["answer_tokens"] = c.get("answer_tokens", 0) + len(ids)
            c["ended"] = bool(ids) and ids[-1] == engines.EOS
            c["turns"] = c.get("turns", 0) + 1

    answer(conversations, 0)
    # second turns: the target writes the next request after its own answer, then answers it
    follow = [c for c in conversations if c["second"] and c["ended"] and len(c["ids"]) < SECOND_TURN_BEFORE]
    opening = magpie.encode(tokenizer, "\n<|im_start|>user\n")
    written = engine.generate([engines.Request(c["ids"] + opening, magpie.TEMPERATURE, magpie.MAX_PROMPT_TOKENS + 1,
                                               base + 500_000 + c["seed"]) for c in follow])
    again = []
    for c, ids in zip(follow, written):
        text = tokenizer.decode(ids[:-1] if ids and ids[-1] == engines.EOS else ids).strip()
        if magpie.rejection(ids, text) is None:
            ids = c["ids"] + magpie.encode(tokenizer, f"\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
            if len(ids) < WINDOW - 64:
                c["ids"] = ids
                again.append(c)
    if again:
        answer(again, 700_000)
    keep = ("source", "system", "written_under", "mode", "turns", "answer_tokens", "kind", "key", "ids")
    return [{k: c[k] for k in keep if k in c} for c in conversations]


def progress(seconds: float, engine: str) -> dict:
    """What the shards hold (recounted from them)."""
    out = {"shards": 0, "conversations": Counter(), "answer_tokens": Counter(), "tokens": 0, "held_out_prompts": 0,
           "by_system": Counter(), "by_mode": Counter(), "by_turns": Counter(), "answers_ended": 0}
    index = 0
    while answers_path(index).is_file():
        for r in magpie.read_jsonl(magpie.prompts_path(index)):
            out["held_out_prompts"] += r["split"] == "held_out"
        for r in magpie.read_jsonl(answers_path(index)):
            out["conversations"][r["source"]] += 1
            out["answer_tokens"][r["source"]] += r["answer_tokens"]
            out["tokens"] += len(r["ids"])
            out["by_system"][r["system"]] += r["answer_tokens"]
            out["by_mode"][r["mode"]] += r["answer_tokens"]
            out["by_turns"][str(r["turns"])] += r["answer_tokens"]
            out["answers_ended"] += r["ids"][-1] == engines.EOS
        index += 1
    out["shards"] = index
    written = magpie.written_counts()
    out["magpie_written"] = dict(sum((Counter(v) for k, v in written.items() if int(k) < index), Counter()))
    total = sum(out["answer_tokens"].values())
    out["answer_tokens_total"] = total
    out["share_of_answer_tokens"] = {k: round(v / total, 3) for k, v in out["answer_tokens"].items()} if total else {}
    out["generation_seconds"] = round(seconds)
    out["engine"] = engine
    return {k: dict(v) if isinstance(v, Counter) else v for k, v in out.items()}


def done_shards() -> int:
    index = 0
    while answers_path(index).is_file():
        index += 1
    return index


def bench(engine, tokenizer, count: int, max_tokens: int, limit_s: float | None = None, step: int = 16) -> dict:
    """Greedy answers to the first `count` standard-library training prompts of at most 1792 tokens (in
    `generate.py`'s order: one in 8 a long `read` prompt), up to `max_tokens` each, all submitted at
    once, or with `limit_s` `step` at a time from the shortest until that many seconds have passed:
    output tokens a second of wall time and of this process's CPU time (all its threads; vLLM's engine
    runs in this process), the second fairer on a shared machine."""
    from generate import MAX_PROMPT_TOKENS, chat_ids
    encoded = [chat_ids(tokenizer, p.text) for p in prompt_builder.build(prompt_builder.split()[0])[:2 * count]]
    requests = [engines.Request(ids, 0.0, max_tokens, i) for i, ids in enumerate(encoded)
                if len(ids) <= MAX_PROMPT_TOKENS][:count]
    start, cpu, answers = time.time(), time.process_time(), []
    if limit_s is None:
        answers = engine.generate(requests)
    else:  # in batches, shortest prompts first (the cheapest), until the time limit
        requests.sort(key=lambda r: len(r.ids))
        for b in range(0, len(requests), step):
            answers += engine.generate(requests[b:b + step])
            if time.time() - start > limit_s:
                break
        requests = requests[:len(answers)]
    seconds, cpu = time.time() - start, time.process_time() - cpu
    out = sum(map(len, answers))
    return {"engine": engine.name, "requests": len(requests), "prompt_tokens": sum(len(r.ids) for r in requests),
            "output_tokens": out, "seconds": round(seconds, 1), "output_tok_s": round(out / seconds, 1),
            "cpu_seconds": round(cpu, 1), "output_tok_per_cpu_s": round(out / cpu, 2)}


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    ap.add_argument("--hours", type=float, default=6, help="stop after the shard that crosses this")
    ap.add_argument("--shards", type=int, default=None, help="stop when this many shards exist")
    ap.add_argument("--bench", type=int, default=None, help="measure only: greedy answers to this many prompts")
    ap.add_argument("--bench-tokens", type=int, default=128)
    ap.add_argument("--bench-limit-s", type=float, default=None, help="stop the measurement after this")
    ap.add_argument("--batch", type=int, default=16, help="transformers: prompts per generate call")
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    start = time.time()
    engine = engines.make(args.engine, TARGET, **({"batch": args.batch} if args.engine == "transformers" else {}))
    print(f"{args.engine} engine loaded in {time.time() - start:.0f}s", flush=True)
    if args.bench:
        print(json.dumps(bench(engine, tokenizer, args.bench, args.bench_tokens, args.bench_limit_s, args.batch)), flush=True)
        return
    CHAT.mkdir(parents=True, exist_ok=True)
    ordered = prompt_builder.build(prompt_builder.split()[0])
    before = json.loads(PROGRESS.read_text()).get("generation_seconds", 0) if PROGRESS.is_file() else 0
    index = done_shards()
    seen = magpie.seen_hashes(index + 1 if magpie.prompts_path(index).is_file() else index)
    start = time.time()
    while args.shards is None or index < args.shards:
        t0 = time.time()
        if not magpie.prompts_path(index).is_file():
            dropped = magpie.write_shard(engine, tokenizer, index, seen)
            print(f"prompts {index}: {dropped}", flush=True)
        records = answer_shard(engine, tokenizer, ordered, index)
        magpie.write_jsonl(answers_path(index), records)
        state = progress(before + time.time() - start, args.engine)
        PROGRESS.write_text(json.dumps(state, indent=1) + "\n")
        tokens = sum(r["answer_tokens"] for r in records)
        print(f"shard {index}: {len(records)} conversations, {tokens} answer tokens in {time.time() - t0:.0f}s "
              f"({tokens / (time.time() - t0):.1f} answer tok/s); total {state['answer_tokens_total']} answer tokens "
              f"{state['share_of_answer_tokens']}", flush=True)
        index += 1
        if time.time() - start > args.hours * 3600:
            break


if __name__ == "__main__":
    main()
