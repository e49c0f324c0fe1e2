"""`parity --context`: prompts built to each length, acceptance by length, and a failure seen only at
the longer lengths named as rope or positions (parity/context.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle31_export.errors import UserError
from eagle31_export.formats.tokenizer import load_tokenizer
from eagle31_export.parity.context import (
    ContextRow, context_lines, context_prompts, long_context_failure, parse_lengths,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "models"
KIMI_TARGET = ROOT / "examples" / "kimi" / "models" / "target"
CLI = Path(sys.executable).with_name("eagle31-export")


def test_lengths_parse_sorted_and_bad_ones_are_refused():
    assert parse_lengths("4096,1024,16384,1024") == (1024, 4096, 16384)
    assert parse_lengths(None) == ()
    for bad in ("1k", "0,8", ","):
        with pytest.raises(UserError, match="--context"):
            parse_lengths(bad)


def test_prompts_are_held_out_text_of_exactly_each_length():
    prompts = context_prompts(TINY / "target", (64, 300), 2048, 1024, 36)
    assert [len(p) for p in prompts] == [64, 64, 300, 300]
    assert prompts[2][:64] == prompts[0]  # every length opens with the same text
    assert prompts[1] != prompts[0]
    text = load_tokenizer(TINY / "target").decode(prompts[0])
    held_out = json.loads((TINY / "held_out_files.json").read_text())
    assert held_out[0] == "__future__.py" and text.startswith('"""Record of phased-in incompatible language changes')


def test_a_length_beyond_the_targets_positions_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"--context 1000 needs 1036 positions .* holds 1024 .* up to 988"):
        context_prompts(TINY / "target", (64, 1000), 2048, 1024, 36)


def test_a_target_without_tokenizer_gets_seeded_ids():
    first = context_prompts(KIMI_TARGET, (40,), 1024, None, 10)
    assert first == context_prompts(KIMI_TARGET, (40,), 1024, None, 10)
    assert [len(p) for p in first] == [40, 40] and first[0] != first[1]
    assert all(0 <= t < 1024 for p in first for t in p)


def _row(length, failing):
    return ContextRow(length, 2, 2.0, 2.0, [4, 2, 1], [4, 2, 1], 10, 10, failing)


def test_failing_only_at_the_longer_lengths_names_rope_or_positions():
    rows = [_row(1024, []), _row(4096, [3]), _row(16384, [4, 5])]
    message = long_context_failure(rows)
    assert message.startswith("context: exact up to 1024 tokens, failing from 4096 on (3 prompts at 4096, 16384)")
    assert "rope_scaling" in message and "max_position_embeddings" in message
    assert long_context_failure([_row(1024, [0]), _row(4096, [3])]) is None  # short prompts fail too: not rope
    assert long_context_failure([_row(1024, []), _row(4096, [])]) is None
    table = context_lines(rows, "vllm")
    assert "| 4096 | 2 | 2.000 | 2.000 | 4/2/1 | 4/2/1 | 3 |" in table


def test_cli_refuses_context_with_a_prompts_file(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    done = subprocess.run([str(CLI), "parity", "--drafter", str(TINY / "drafter-eagle31"), "--target",
                           str(TINY / "target"), "--runtime", "reference", "--prompts", str(prompts),
                           "--context", "64"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "--context builds its own prompts" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_served_drafter_that_bounds_or_rotates_positions_otherwise_is_named():
    from eagle31_export.formats.drafter.checkpoint import read_drafter
    from eagle31_export.parity.context import served_rope_differences

    reference = read_drafter(TINY / "drafter-eagle31").config
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 1024}
    long = reference.replace(rope_scaling=yarn, max_position_embeddings=32768)
    assert served_rope_differences(long, long) == []
    dropped, = served_rope_differences(long.replace(rope_scaling=None), long)
    assert dropped == ("the runtime's drafter has rope scaling none, theta 10000 where the reference drafter has "
                       "scaling yarn (factor 32, original_max_position_embeddings 1024), theta 10000")
    cut, = served_rope_differences(long.replace(max_position_embeddings=2048), long)
    assert cut == "the runtime's drafter holds 2048 positions where the reference drafter holds 32768"
    # a v4 `type` spelling of the same rope is the same rope
    assert served_rope_differences(long.replace(rope_scaling={**yarn, "type": "yarn"}), long) == []
