"""Long context on a real vLLM engine (vLLM's CPU build, 0.32): `parity --context` over the tiny pair
stretched to 32768 positions (eagle31_export/demo/long_pair.py: yarn for the EAGLE 3.1 pair, llama3
for the EAGLE-3 pair), exact at every length; and the rope bugs of public trackers, each in a bundle
vLLM runs without a word, failing with a first line that names rope or positions.

One engine per bundle, one prompt a length (a 16384-token prompt costs the engine and the reference
about a minute on 2 cores); the broken bundles at 1024 and 4096 tokens, past the pair's original 1024.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eagle31_export.demo.long_pair import write_long_context_pair
from eagle31_export.export.vllm import export_vllm
from eagle31_export.formats.drafter.checkpoint import read_drafter, write_drafter
from eagle31_export.parity.sides import check_parity

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "parity"))
sys.path.insert(0, str(ROOT / "tests"))

from sabotage import cut_positions, drop_rope_scaling, yarn_as_linear  # noqa: E402
from test_vllm_engine import TINY, assert_exact_pass, vllm  # noqa: E402,F401 (the fixture)

pytestmark = pytest.mark.engine

SABOTAGES = {"rope_scaling dropped": drop_rope_scaling, "yarn read as linear": yarn_as_linear,
             "positions cut to 2048": cut_positions}


@pytest.fixture(scope="module")
def long_pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("long-context")
    return {rope: write_long_context_pair(TINY, root / rope, rope) for rope in ("yarn", "llama3")}


def _parity(vllm, bundle, drafter, target, lengths, per_length=1):
    return check_parity("vllm", bundle, drafter, target, None, None, 3, 32, runtime_options={"vllm": vllm},
                        context=lengths, per_length=per_length)


# own engines: each local engine is sized to its run's longest context (`--context`), one bundle each
@pytest.mark.parametrize("drafter, rope, lengths", [("drafter-eagle31", "yarn", (1024, 4096, 16384)),
                                                    ("drafter-eagle3", "llama3", (1024, 4096, 8192))])
def test_long_context_parity_is_exact_on_vllm(vllm, tmp_path, long_pairs, drafter, rope, lengths):
    pair = long_pairs[rope]
    source, target = pair / drafter, pair / "target"
    report = _parity(vllm, export_vllm(source, target, tmp_path / "bundle"), source, target, lengths)
    assert_exact_pass(report)
    assert [row.length for row in report.context] == list(lengths)
    assert sorted({r.prompt_len for r in report.rows}) == list(lengths)
    for row in report.context:
        assert row.prompts == 1 and not row.failing_prompts
        assert row.accepted_per_position_runtime == row.accepted_per_position_reference
        assert row.rounds_runtime == row.rounds_reference > 0
        assert sum(row.accepted_per_position_reference) > 0  # drafts accepted at every length: compared


@pytest.mark.parametrize("bug", list(SABOTAGES))
def test_rope_bugs_fail_on_vllm_naming_rope_or_positions(vllm, tmp_path, long_pairs, bug):
    pair = long_pairs["yarn"]
    faithful, target = pair / "drafter-eagle31", pair / "target"
    broken = write_drafter(SABOTAGES[bug](read_drafter(faithful)), tmp_path / "broken", "specforge")
    report = _parity(vllm, export_vllm(broken, target, tmp_path / "bundle"), faithful, target, (1024, 4096))
    assert not report.passed
    assert report.failures[0].startswith("rope or positions: the runtime's drafter "), report.failures
    assert all(r.tokens_identical for r in report.rows)  # lossless: only acceptance shows it
    short, long = report.context
    assert long.failing_prompts, report.failures  # the long length fails whatever the short one does
    if bug == "positions cut to 2048":
        # vLLM serves it without a word and drafts nothing it keeps past the drafter's positions;
        # the short length, within them, is exact
        assert "holds 2048 positions where the reference drafter holds 32768" in report.failures[0]
        assert not short.failing_prompts and sum(long.accepted_per_position_runtime) == 0
        assert report.failures[1].startswith("context: exact up to 1024 tokens, failing from 4096 on")
    else:
        assert "scaling yarn (factor 32, original_max_position_embeddings 1024)" in report.failures[0]
