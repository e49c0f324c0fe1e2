"""`parity --context`: prompts built to each context length, and acceptance by length.

Rope bugs hide at long context: a drafter whose rope scaling was dropped or misread, or whose
positions are fewer than the runtime serves, drafts as well as ever on short prompts and falls
behind with position (docs/speculation.md, "Long context"). So each asked length L gets prompts of
exactly L tokens, and the report shows tau and accepted drafts per position by L, reference beside
runtime. A failure that shows only from some length on, the shorter lengths exact, is named as a
rope or positions failure.

Text: held-out text tokenized by the target's own tokenizer. The texts are Python standard library
files (offline on every machine with CPython): those a `held_out_files.json` beside the target names
(the tiny pair's: files kept out of its training), else DEFAULT_TEXTS. The files' tokens are laid
end to end (an end-of-text token between files where the tokenizer has one) and prompt i of length
L is the i-th run of L tokens of that stream, so the prompts of every length open with the same
text. A target without a tokenizer gets seeded token ids: `random.Random(L * 1000 + i)` draws each
id of prompt i uniformly below the vocabulary size.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle31_export.config import DrafterConfig, Rope
from eagle31_export.errors import UserError
from eagle31_export.formats.tokenizer import has_tokenizer, load_tokenizer

PROMPTS_PER_LENGTH = 2
HELD_OUT_FILES = "held_out_files.json"
# the tiny pair's held-out files (examples/tiny/models/held_out_files.json): CPython's own sources
DEFAULT_TEXTS = ("__future__.py", "_pydecimal.py", "argparse.py", "cgi.py", "contextlib.py", "dis.py", "getopt.py",
                 "imghdr.py", "mailcap.py", "optparse.py", "poplib.py", "quopri.py", "shutil.py", "sre_parse.py",
                 "sysconfig.py", "tokenize.py", "warnings.py")


def parse_lengths(text: str | None) -> tuple[int, ...]:
    """`--context 1024,4096,16384` -> (1024, 4096, 16384); None -> ()."""
    if text is None:
        return ()
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UserError(f"--context {text!r}: expected prompt lengths in tokens, comma-separated, "
                        "such as 1024,4096,16384") from None
    if not lengths or lengths[0] < 1:
        raise UserError(f"--context {text!r}: each length must be a positive number of tokens")
    return tuple(lengths)


def stdlib_texts(names) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / n).read_text(encoding="utf-8", errors="replace") for n in names if (stdlib / n).is_file()]
    if not texts:
        raise UserError(f"none of the held-out files are in {stdlib}; is this the CPython the pair was trained for?")
    return texts


def context_prompts(target: Path, lengths: tuple[int, ...], vocab: int, max_positions: int | None, room: int,
                    count: int = PROMPTS_PER_LENGTH) -> list[list[int]]:
    """`count` prompts of exactly L tokens for each L, shortest first; refused where L and the
    `room` generation needs exceed the target's positions."""
    longest = lengths[-1]
    if max_positions is not None and longest + room > max_positions:
        raise UserError(f"--context {longest} needs {longest + room} positions (the prompt and {room} for the "
                        f"tokens and drafts it generates) but the target holds {max_positions} "
                        f"(max_position_embeddings): ask for lengths up to {max_positions - room}")
    if not has_tokenizer(target):
        return [[random.Random(length * 1000 + i).randrange(vocab) for _ in range(length)]
                for length in lengths for i in range(count)]
    stream = _token_stream(target, count * longest)
    return [stream[i * length:(i + 1) * length] for length in lengths for i in range(count)]


def _token_stream(target: Path, needed: int) -> list[int]:
    names_file = target.parent / HELD_OUT_FILES
    names = json.loads(names_file.read_text()) if names_file.is_file() else DEFAULT_TEXTS
    tokenizer = load_tokenizer(target, "--context builds its prompts from text")
    separator = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    stream: list[int] = []
    for text in stdlib_texts(names):
        stream += tokenizer(text)["input_ids"] + separator
        if len(stream) >= needed:
            return stream
    raise UserError(f"the held-out text holds {len(stream)} tokens for this tokenizer, fewer than the {needed} "
                    "--context needs: ask for shorter or fewer lengths")


@dataclass
class ContextRow:
    """One asked length: its prompts' tau and accepted drafts per position, both sides."""

    length: int
    prompts: int
    tau_reference: float
    tau_runtime: float
    accepted_per_position_reference: list[int]
    accepted_per_position_runtime: list[int]
    rounds_reference: int
    rounds_runtime: int
    failing_prompts: list[int]

    def to_json(self) -> dict:
        return asdict(self)


def context_rows(rows, lengths: tuple[int, ...], failures: list[str]) -> list[ContextRow]:
    """The report's prompt rows grouped by length (parity/compare.py: PromptRow)."""
    failing = {i for i in range(len(rows)) if any(f.startswith(f"prompt {i}:") for f in failures)}
    out = []
    for length in lengths:
        group = [r for r in rows if r.prompt_len == length]
        if not group:
            continue
        out.append(ContextRow(
            length, len(group), sum(r.tau_reference for r in group) / len(group),
            sum(r.tau_runtime for r in group) / len(group),
            _summed(r.accepted_per_position_reference for r in group),
            _summed(r.accepted_per_position_runtime for r in group),
            sum(r.rounds_reference for r in group), sum(r.rounds_runtime for r in group),
            sorted(r.prompt_index for r in group if r.prompt_index in failing)))
    return out


def _summed(lists) -> list[int]:
    lists = [list(x) for x in lists]
    width = max(map(len, lists), default=0)
    return [sum(x[i] for x in lists if i < len(x)) for i in range(width)]


def long_context_failure(rows: list[ContextRow]) -> str | None:
    """Where the failing prompts are all at the longer lengths and the shortest length is exact: the
    drafter or its runtime treats positions differently beyond some point (rope scaling dropped or
    misread, fewer positions than served)."""
    failing = [r for r in rows if r.failing_prompts]
    if not failing or len(rows) < 2 or rows[0].failing_prompts:
        return None
    first = failing[0].length
    passing = [r.length for r in rows if r.length < first]
    return (f"context: exact up to {passing[-1]} tokens, failing from {first} on "
            f"({sum(len(r.failing_prompts) for r in failing)} prompts at {', '.join(str(r.length) for r in failing)}): "
            "positions are rotated or bounded differently at long context (rope_scaling dropped or read as another "
            "schedule, rope_theta, or a max_position_embeddings shorter than the context served; "
            "`eagle31-export inspect DRAFTER --target TARGET` compares the drafter's rope with its target's)")


def context_lines(rows: list[ContextRow], runtime: str) -> list[str]:
    if not rows:
        return []
    lines = ["## By context length", "",
             "| context (tokens) | prompts | tau reference | tau runtime | accepted per position: reference "
             "| runtime | failing prompts |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.length} | {r.prompts} | {r.tau_reference:.3f} | {r.tau_runtime:.3f} "
                     f"| {'/'.join(map(str, r.accepted_per_position_reference))} "
                     f"| {'/'.join(map(str, r.accepted_per_position_runtime))} "
                     f"| {', '.join(map(str, r.failing_prompts)) or '-'} |")
    return lines + ["", f"runtime: {runtime}. Accepted per position: rounds whose draft at that position was "
                        "accepted, summed over the length's prompts.", ""]


def context_plot(rows: list[ContextRow], runtime: str, path: Path, save) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = [r.length for r in rows]
    ax.plot(lengths, [r.tau_reference for r in rows], "o-", label="reference")
    ax.plot(lengths, [r.tau_runtime for r in rows], "x--", label=runtime)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context (prompt tokens)", ylabel="tau (tokens per target forward)",
           title="Acceptance length by context", xticks=lengths, xticklabels=[str(n) for n in lengths])
    ax.legend()
    return save(fig, path)


def served_drafter(bundle: Path | None) -> Path | None:
    """The drafter folder a serving bundle of ours hands its engine (`export vllm` / `export sglang`:
    bundle.json's `drafter`); None for other outputs and plain folders."""
    record = None if bundle is None else bundle / "bundle.json"
    if record is None or not record.is_file():
        return None
    name = json.loads(record.read_text()).get("drafter")
    return bundle / name if isinstance(name, str) and (bundle / name).is_dir() else None


def served_rope_differences(served: DrafterConfig, reference: DrafterConfig) -> list[str]:
    """How the drafter a runtime was handed rotates or bounds positions unlike the reference drafter:
    what a converter that dropped or misread the rope, or cut the positions, leaves behind."""
    ours, theirs = (Rope.of(c.rope_theta, c.rope_scaling) for c in (served, reference))
    out = []
    if ours != theirs:
        out.append(f"the runtime's drafter has rope {_rope_words(ours)} where the reference drafter has "
                   f"{_rope_words(theirs)}")
    if served.max_position_embeddings < reference.max_position_embeddings:
        out.append(f"the runtime's drafter holds {served.max_position_embeddings} positions where the reference "
                   f"drafter holds {reference.max_position_embeddings}")
    return out


def _rope_words(rope: Rope) -> str:
    theta = "" if rope.theta is None else f", theta {rope.theta:g}"
    return f"scaling {rope.describe()}{theta}"
