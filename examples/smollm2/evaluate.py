"""EAGLE 3.1 against EAGLE-3 on the real pair, as the seed claims them: acceptance by draft depth, by
context length, under chat-template and system-prompt variation, and `diagnose`'s drift by depth.

    python examples/smollm2/evaluate.py [--prompts 96 --template-prompts 48 --documents 24] [--out DIR]

Greedy, fp32 reference, both drafters on the same prompts. Every prompt's acceptance at depths 1..6
comes from one greedy text of the target and one teacher-forced pass of each drafter
(eagle31_export/parity/chains.py: the loop's rounds, checked against it in
tests/test_acceptance_chains.py). tau = tokens per target forward; mean ± standard error over
prompts; "3.1 - 3" is the paired difference over the same prompts (its standard error is what says
whether a difference is more than the prompts' spread). acc@k = rounds whose k-th draft was accepted,
pooled over all rounds of a row.

1. depth: held-out chat prompts (files never trained on, up to 768 tokens), as served: the chat
   template with its default system prompt, as the drafters were trained;
2. context: sections of the long held-out source files (one per file in turn, the longest files
   giving several), each cut at a line so that the whole conversation (a user turn "read this part
   of the file, then summarize it", the default system prompt) fills the length less the answer's
   room; the drafters were trained on windows up to 2048 tokens and the
   target holds 8192 positions;
3. template: the depth table's first prompts, the same user turn four ways: the default system prompt
   (as trained), none, a long unusual one, and another chat format (Alpaca's, no ChatML tokens);
4. diagnose: agreement with the target, fed-back RMS and attention on sink positions by depth.

Writes claims.json, tau_by_context.png and tau_by_template.png to --out, and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import prompts as prompt_builder  # noqa: E402
from generate import chat_ids  # noqa: E402

from eagle31_export.parity.claims import SetResult, measure_sets, plot_sets  # noqa: E402
from eagle31_export.reference.pair import load_pair  # noqa: E402

MODELS = HERE / "models"
TARGET = MODELS / "target"
DRAFTERS = {"EAGLE-3": MODELS / "drafter-eagle3", "EAGLE 3.1": MODELS / "drafter-eagle31"}
DEPTHS = tuple(range(1, 7))
HEADLINE_DEPTH = 3
MAX_PROMPT_TOKENS = 768
CONTEXTS = (512, 1024, 2048, 4096, 8192)
TRAINED_WINDOW = 2048  # train.py: the longest training window
LONG_SYSTEM = (
    "You are Quillon, the archival assistant of the Lighthouse Keepers' Guild of the Outer Hebrides. You "
    "answer every question as a meticulous archivist would: first restate the request in one sentence, "
    "then answer in numbered paragraphs of plain prose, never using the first person plural, never using "
    "exclamation marks, and always noting any assumption you had to make. When code is involved, describe "
    "its behaviour as if cataloguing an instrument: its purpose, its inputs, its outputs, its failure "
    "modes, in that order. Spell in British English. If a question cannot be answered from what you were "
    "given, say so plainly and suggest which document the Guild's archive would hold the answer in.")
DEMO_PROMPTS_FILE = MODELS / "claims_prompts.json"
DEMO_DOCUMENTS, DEMO_CONTEXTS, DEMO_TEMPLATE_PROMPTS = 2, (512, 2048, 8192), 4
READ_QUESTION = "Summarize what this file does and name its most important classes and functions."


def held_out_prompts(tokenizer, count: int) -> list[prompt_builder.Prompt]:
    """`count` chat prompts from the held-out files, up to MAX_PROMPT_TOKENS as served, every 7th of the
    fixed order (train.py's held-out evaluation takes the first 12 of the same)."""
    built = prompt_builder.build(prompt_builder.split()[1])
    fitting = [p for p in built if len(chat_ids(tokenizer, p.text)) <= MAX_PROMPT_TOKENS][::7]
    if len(fitting) < count:
        raise SystemExit(f"only {len(fitting)} held-out prompts fit {MAX_PROMPT_TOKENS} tokens; ask for fewer")
    return fitting[:count]


def _tokens(tokenizer, rendered: str) -> list[int]:
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def template_variants(tokenizer, prompts: list[prompt_builder.Prompt]) -> dict[str, list[list[int]]]:
    """The same user turns four ways (see the module's docstring)."""
    def rendered(text: str, system: str | None = None) -> str:
        turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)

    default = [_tokens(tokenizer, rendered(p.text)) for p in prompts]
    if default != [chat_ids(tokenizer, p.text) for p in prompts]:
        raise SystemExit("rendering the chat template as text does not give the served prompt's tokens")
    system_block = re.compile(r"\A<\|im_start\|>system\n.*?<\|im_end\|>\n", re.DOTALL)
    none = [_tokens(tokenizer, system_block.sub("", rendered(p.text), count=1)) for p in prompts]
    if any(len(a) >= len(b) for a, b in zip(none, default)):
        raise SystemExit("the chat template's default system prompt was not found to remove")
    return {
        "default system prompt (as trained)": default,
        "no system prompt": none,
        "long unusual system prompt": [_tokens(tokenizer, rendered(p.text, LONG_SYSTEM)) for p in prompts],
        "other chat format (Alpaca)": [_tokens(tokenizer, f"### Instruction:\n{p.text}\n\n### Response:\n")
                                       for p in prompts],
    }


def long_documents(tokenizer, count: int, tokens: int) -> list[tuple[str, list[str]]]:
    """`count` held-out documents of at least `tokens` tokens, as (file name, lines): each long held-out
    file cut at lines into consecutive sections of that size (its tail dropped), taken one section of
    each file in turn (longest file first), so as many files as possible are represented."""
    root = prompt_builder.stdlib_root()
    by_file = []
    for name in prompt_builder.split()[1]:
        lines = (root / name).read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        sections, current, size = [], [], 0
        for line in lines:
            current.append(line)
            size += len(tokenizer(line, add_special_tokens=False)["input_ids"])
            if size >= tokens * 1.05:  # a margin for tokens merging across line ends
                sections.append(current)
                current, size = [], 0
        if sections:
            by_file.append([(name, section) for section in sections])
    by_file.sort(key=len, reverse=True)
    taken = [doc for turn in range(max(map(len, by_file), default=0)) for docs in by_file if turn < len(docs)
             for doc in [docs[turn]]]
    if len(taken) < count:
        raise SystemExit(f"the held-out files hold {len(taken)} sections of {tokens} tokens; ask for fewer --documents")
    return taken[:count]


def read_prompt(tokenizer, name: str, lines: list[str], budget: int) -> list[int]:
    """The longest conversation over the document's first lines that fits `budget` tokens."""
    def ids(k: int) -> list[int]:
        return chat_ids(tokenizer, f"Read this part of the Python source file `{name}`:\n\n```python\n"
                                   f"{''.join(lines[:k])}```\n\n{READ_QUESTION}")

    low, high = 1, len(lines)
    while low < high:  # the largest k with len(ids(k)) <= budget
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(ids(mid)) <= budget else (low, mid - 1)
    return ids(low)


def context_sets(tokenizer, documents, lengths, room: int) -> dict[str, list[list[int]]]:
    return {str(n): [read_prompt(tokenizer, name, lines, n - room) for name, lines in documents] for n in lengths}


def print_sets(title: str, column: str, results: list[SetResult], depth: int, note=lambda r: "") -> None:
    e3, e31 = "EAGLE-3", "EAGLE 3.1"
    accs = " ".join(f"@{k}" for k in range(1, depth + 1))
    print(f"\n{title}\n")
    print(f"| {column} | prompts | mean tokens | tau EAGLE-3 | tau EAGLE 3.1 | 3.1 - 3 (paired) | tau 3.1/3 |"
          f" acc{accs} EAGLE-3 | acc{accs} EAGLE 3.1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        tau3, tau31 = r.tau(e3, depth), r.tau(e31, depth)
        print(f"| {r.label}{note(r)} | {len(r.prompt_tokens)} | {sum(r.prompt_tokens) / len(r.prompt_tokens):.0f} "
              f"| {tau3} | {tau31} | {r.difference(e3, e31, depth):+.3f} | {tau31.mean / tau3.mean:.3f} "
              f"| {' '.join(f'{a:.2f}' for a in r.acceptance(e3, depth))} "
              f"| {' '.join(f'{a:.2f}' for a in r.acceptance(e31, depth))} |", flush=True)


def print_depths(result: SetResult) -> None:
    print(f"\n1. by draft depth ({len(result.prompt_tokens)} held-out chat prompts)\n")
    print("| depth | tau EAGLE-3 | tau EAGLE 3.1 | 3.1 - 3 (paired) | acceptance by position EAGLE-3 "
          "| acceptance by position EAGLE 3.1 |")
    print("|---|---|---|---|---|---|")
    for d in DEPTHS:
        print(f"| {d} | {result.tau('EAGLE-3', d)} | {result.tau('EAGLE 3.1', d)} "
              f"| {result.difference('EAGLE-3', 'EAGLE 3.1', d):+.3f} "
              f"| {' '.join(f'{a:.2f}' for a in result.acceptance('EAGLE-3', d))} "
              f"| {' '.join(f'{a:.2f}' for a in result.acceptance('EAGLE 3.1', d))} |", flush=True)


def diagnose_rows(prompts: list[list[int]]) -> dict:
    """`diagnose` on both drafters over `prompts` (depth 6): agreement, fed-back RMS, sink attention."""
    from eagle31_export.parity.diagnose import diagnose

    out = {}
    print(f"\n4. diagnose ({len(prompts)} held-out chat prompts, depth 6)\n")
    print("| drafter | quantity | " + " | ".join(f"depth {d}" for d in DEPTHS) + " |")
    print("|---|---|" + "---|" * len(DEPTHS))
    for label, folder in DRAFTERS.items():
        report = diagnose(folder, TARGET, prompts=prompts, depth=max(DEPTHS))
        rows = {"agreement with the target": [r.agreement for r in report.rows],
                "fed-back RMS": [r.fed_back_rms for r in report.rows],
                "fed-back RMS / depth 1": [r.fed_back_rms_rel for r in report.rows],
                "attention on sinks": [r.attention_sink for r in report.rows]}
        for quantity, values in rows.items():
            cells = " | ".join("-" if v is None else f"{v:.3f}" for v in values)
            print(f"| {label} | {quantity} | {cells} |", flush=True)
        out[label] = {**rows, "verdict": report.verdict}
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=96, help="held-out chat prompts for the depth table")
    ap.add_argument("--template-prompts", type=int, default=48, help="of them, how many the template table varies")
    ap.add_argument("--documents", type=int, default=24, help="long held-out documents for the context table")
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--diagnose-prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tables", default="depth,context,template,diagnose")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=HERE / "claims")
    ap.add_argument("--write-demo-prompts", action="store_true",
                    help=f"write {DEMO_PROMPTS_FILE.relative_to(HERE)} (what `demo --pair` measures of these tables) and stop")
    return ap.parse_args()


def write_demo_prompts(tokenizer, room: int) -> None:
    """A few prompts of the context and template tables, for the demo: the first DEMO_DOCUMENTS documents
    at DEMO_CONTEXTS, the first DEMO_TEMPLATE_PROMPTS prompts in every format."""
    documents = long_documents(tokenizer, DEMO_DOCUMENTS, max(DEMO_CONTEXTS))
    record = {"source": f"examples/smollm2/evaluate.py --write-demo-prompts: {DEMO_DOCUMENTS} held-out documents at "
                        f"{', '.join(map(str, DEMO_CONTEXTS))} positions, {DEMO_TEMPLATE_PROMPTS} held-out chat "
                        "prompts in 4 formats (the full tables: examples/smollm2/README.md)",
              "context": context_sets(tokenizer, documents, DEMO_CONTEXTS, room),
              "template": template_variants(tokenizer, held_out_prompts(tokenizer, DEMO_TEMPLATE_PROMPTS))}
    DEMO_PROMPTS_FILE.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(f"wrote {DEMO_PROMPTS_FILE}")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tables = set(args.tables.split(","))
    tokenizer = prompt_builder_tokenizer()
    if args.write_demo_prompts:
        return write_demo_prompts(tokenizer, args.new_tokens + max(DEPTHS) + 1)
    chat = held_out_prompts(tokenizer, max(args.prompts, args.template_prompts, args.diagnose_prompts))
    args.out.mkdir(parents=True, exist_ok=True)
    pairs = {label: load_pair(folder, TARGET) for label, folder in DRAFTERS.items()}
    record = {"command": " ".join(["python", "examples/smollm2/evaluate.py", *sys.argv[1:]]), "depths": list(DEPTHS),
              "new_tokens": args.new_tokens, "headline_depth": HEADLINE_DEPTH, "seconds": {}}
    measure = lambda sets: measure_sets(pairs, sets, DEPTHS, args.new_tokens,  # noqa: E731
                                        lambda what: print(f"  {what}", file=sys.stderr, flush=True))
    if "depth" in tables:
        start = time.time()
        [depth] = measure({"held-out chat": [chat_ids(tokenizer, p.text) for p in chat[:args.prompts]]})
        print_depths(depth)
        record["depth"], record["seconds"]["depth"] = depth.to_json(DEPTHS), round(time.time() - start)
    if "context" in tables:
        start, lengths = time.time(), [int(n) for n in args.contexts.split(",")]
        room = args.new_tokens + max(DEPTHS) + 1
        sets = context_sets(tokenizer, long_documents(tokenizer, args.documents, max(lengths)), lengths, room)
        results = measure(sets)
        past = lambda r: " (past training)" if int(r.label) > TRAINED_WINDOW else ""  # noqa: E731
        print_sets(f"2. by context length ({args.documents} held-out documents; the conversation fills the length "
                   f"less {room} tokens of answer; depth {HEADLINE_DEPTH})", "context", results, HEADLINE_DEPTH, past)
        plot_sets(results, HEADLINE_DEPTH, args.out / "tau_by_context.png",
                  f"SmolLM2-135M-Instruct, {args.documents} held-out documents; trained up to {TRAINED_WINDOW}",
                  "context (positions: prompt + answer)", log2_x=True)
        record["context"] = [r.to_json(DEPTHS) for r in results]
        record["seconds"]["context"] = round(time.time() - start)
    if "template" in tables:
        start = time.time()
        results = measure(template_variants(tokenizer, chat[:args.template_prompts]))
        print_sets(f"3. under template and system-prompt variation ({args.template_prompts} held-out chat prompts; "
                   f"depth {HEADLINE_DEPTH})", "prompt format", results, HEADLINE_DEPTH)
        plot_sets(results, HEADLINE_DEPTH, args.out / "tau_by_template.png",
                  f"SmolLM2-135M-Instruct, {args.template_prompts} held-out chat prompts", "the same user turn")
        record["template"] = [r.to_json(DEPTHS) for r in results]
        record["seconds"]["template"] = round(time.time() - start)
    if "diagnose" in tables:
        start = time.time()
        record["diagnose"] = diagnose_rows([chat_ids(tokenizer, p.text) for p in chat[:args.diagnose_prompts]])
        record["seconds"]["diagnose"] = round(time.time() - start)
    (args.out / "claims.json").write_text(json.dumps(record, indent=1) + "\n")


def prompt_builder_tokenizer():
    from eagle31_export.formats.tokenizer import load_tokenizer

    return load_tokenizer(TARGET, "the real pair's target carries its tokenizer (make smollm2-target)")


if __name__ == "__main__":
    main()
