"""Chat prompts for the real pair, built from text every machine with CPython has offline: the standard
library's source files and their docstrings.

Each prompt is one user turn about one source file (the default system prompt is added by the
target's chat template, as the drafters are trained and as users serve it):

- explain:   a function's or class's source, "explain what it does";
- implement: a function's name, signature and docstring, "write it";
- document:  a function's source without its docstring, "write its docstring";
- module:    a module's docstring, "summarize what the module is for";
- read:      up to READ_TOKENS tokens of a whole file, then a question about one of its definitions
             (the long prompts: training windows reach 2048 tokens through these).

The split is by source file: every 10th file, sorted by path relative to the standard library, is held
out (`held_out_files.json`); no prompt from a held-out file is trained on. The order is a fixed shuffle
(seed 0), so data generation can stop anywhere and resume, and every machine builds the same list.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo", "idlelib"}
MAX_SNIPPET_CHARS = 3000  # a function's source longer than this is skipped (read prompts cover long text)
READ_CHARS = 6000
READ_EVERY = 8  # the read prompts' file excerpt (about 1500-1800 tokens of Python)


@dataclass(frozen=True)
class Prompt:
    key: str  # "<file>:<kind>:<name>", stable, not unique: two methods of one name in a file share it
    source: str  # the file, relative to the standard library
    kind: str
    text: str  # the user turn


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files() -> list[str]:
    root = stdlib_root()
    names = [p.relative_to(root).as_posix() for p in root.rglob("*.py")]
    return sorted(n for n in names if not SKIPPED_DIRS.intersection(n.split("/")[:-1]))


def split() -> tuple[list[str], list[str]]:
    """(training files, held-out files): every 10th file by path is held out."""
    files = source_files()
    held_out = files[::10]
    kept = set(held_out)
    return [f for f in files if f not in kept], held_out


def _definitions(tree: ast.Module) -> list[ast.AST]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not n.name.startswith("__")]


def _segment(lines: list[str], node: ast.AST) -> str:
    """A definition's whole lines (ast.get_source_segment splits the file again on every call)."""
    return "\n".join(lines[node.lineno - 1:node.end_lineno])


def _without_docstring(lines: list[str], node: ast.AST) -> str:
    doc = node.body[0] if node.body and isinstance(node.body[0], ast.Expr) else None
    if doc is None or not isinstance(getattr(doc, "value", None), ast.Constant):
        return _segment(lines, node)
    first, last = node.lineno - 1, node.end_lineno
    drop = set(range(doc.lineno - 1, doc.end_lineno))
    return "\n".join(line for i, line in enumerate(lines[first:last], start=first) if i not in drop)


def file_prompts(name: str) -> list[Prompt]:
    text = (stdlib_root() / name).read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    prompts: list[Prompt] = []
    module_doc = ast.get_docstring(tree)
    if module_doc and len(module_doc) > 80:
        prompts.append(Prompt(f"{name}:module:", name, "module",
                              f"Here is the documentation of the Python module `{name[:-3].replace('/', '.')}`:"
                              f"\n\n{module_doc[:MAX_SNIPPET_CHARS]}\n\nSummarize what the module is for."))
    definitions = _definitions(tree)
    for node in definitions:
        source = _segment(lines, node)
        if not 80 < len(source) <= MAX_SNIPPET_CHARS:
            continue
        what = "class" if isinstance(node, ast.ClassDef) else "function"
        doc = ast.get_docstring(node)
        prompts.append(Prompt(f"{name}:explain:{node.name}", name, "explain",
                              f"Explain what this Python {what} does:\n\n```python\n{source}\n```"))
        if doc and what == "function":
            signature = f"def {node.name}({ast.unparse(node.args)}):"
            prompts.append(Prompt(f"{name}:implement:{node.name}", name, "implement",
                                  f"Write a Python function with the signature `{signature}`. "
                                  f"Its documentation says:\n\n{doc}"))
            prompts.append(Prompt(f"{name}:document:{node.name}", name, "document",
                                  "Write a docstring for this Python function:\n\n```python\n"
                                  f"{_without_docstring(lines, node)}\n```"))
    if len(text) > 2000 and definitions:
        excerpt = text[:READ_CHARS]
        named = [n for n in definitions if f"def {n.name}" in excerpt or f"class {n.name}" in excerpt]
        if named:
            node = named[len(named) // 2]
            prompts.append(Prompt(f"{name}:read:{node.name}", name, "read",
                                  f"Read this Python source file, `{name}`:\n\n```python\n{excerpt}\n```\n\n"
                                  f"What does `{node.name}` do, and how is it used in the file?"))
    return prompts


def build(files: list[str]) -> list[Prompt]:
    """Every prompt of `files`, in a fixed shuffled order in which every READ_EVERY-th prompt is a long
    `read` prompt while they last (they are few, and they are what fills the long windows)."""
    prompts = [p for name in files for p in file_prompts(name)]
    random.Random(0).shuffle(prompts)
    reads = [p for p in prompts if p.kind == "read"]
    others = [p for p in prompts if p.kind != "read"]
    ordered: list[Prompt] = []
    while reads or others:
        if reads and (len(ordered) % READ_EVERY == 0 or not others):
            ordered.append(reads.pop())
        else:
            ordered.append(others.pop())
    return ordered


if __name__ == "__main__":
    train, held = split()
    built = build(train)
    kinds = {}
    for p in built:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    print(f"{len(train)} training files, {len(held)} held out; {len(built)} training prompts: {kinds}")
