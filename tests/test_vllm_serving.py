"""What a vLLM server tells about how it serves, against one real engine (vLLM's CPU build) started
apart: bf16, one sequence at a time (`--max-num-seqs 1`), vLLM's development endpoints on
(VLLM_SERVER_DEV_MODE=1, so its /server_info says what dtype it computes in).

- Batching is measured, not assumed: with 4 requests in flight this engine still runs one, and parity
  fails with "the runtime did not batch" (tests/test_vllm_engine.py: a default engine verifies several requests a step).
- --url reads the served dtype where the server tells: bf16 here, so the comparison is the half
  precision one; a --runtime-dtype the server contradicts is refused in one line.

One engine for the module (15-40 s to start on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from eagle31_export.export.bundle import read_bundle
from eagle31_export.export.vllm import export_vllm
from eagle31_export.parity.concurrency import NOT_BATCHED
from eagle31_export.parity.report import markdown
from eagle31_export.runtime.registry import LoadOptions
from eagle31_export.runtime.vllm_engine import LocalServer, find_vllm
from eagle31_export.runtime.vllm_runtime import engine_args
from test_vllm_engine import DRAFTER31, TARGET, _assert_one_line, cli, parity, vllm  # noqa: F401  (vllm: fixture)

# real engines or servers, or minutes: `make test` runs it, `make test-quick` does not
pytestmark = pytest.mark.engine


# its own engine: a start-up option no other test serves with (--max-num-seqs 1, development endpoints)
@pytest.fixture(scope="module")
def serial_bf16(vllm, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-serial")
    record = read_bundle(export_vllm(DRAFTER31, TARGET, root / "bundle"))
    args = [*engine_args(record, LoadOptions(depth=3, dtype=torch.bfloat16)), "--max-num-seqs", "1"]
    with LocalServer(find_vllm(vllm), args, root, env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        yield server


def test_a_runtime_dtype_the_server_contradicts_is_refused(vllm, serial_bf16):
    _assert_one_line(*cli("parity", "--drafter", DRAFTER31, "--target", TARGET, "--runtime", "vllm", "--url",
                          serial_bf16.url, "--runtime-dtype", "fp32"),
                     "--runtime-dtype fp32", "computes in bfloat16", "--runtime-dtype bf16")


def test_an_engine_that_runs_one_request_at_a_time_did_not_batch(vllm, serial_bf16):
    """Four requests in flight, all answered, every prompt the same as at C = 1: only the sampled
    batch sizes show that the engine queued them. The dtype is the server's own (not stated), so the
    bf16 engine is compared as half precision: differences from the reference are numerical ties,
    none blamed on the drafter."""
    report = parity(vllm, None, DRAFTER31, url=serial_bf16.url, concurrency=(1, 4), runtime_options={"dtype": None})
    assert report.runtime_dtype["dtype"] == "bfloat16" and report.runtime_dtype["basis"] == "observed"
    assert not report.exact and report.ties_judged
    rows = {row.concurrency: row for row in report.concurrency}
    assert rows[4].same_tokens_as_c1 == rows[4].same_rounds_as_c1 == 8  # nothing else tells it
    batching = rows[4].batching
    assert batching["largest"] == 1 and set(batching["histogram"]) == {"1"}, batching
    assert rows[4].runtime_counters["engine_steps"] > rows[4].rounds  # a step per round and prompt, prefills too
    if batching["in_flight"] >= 2:  # the engine was sent two or more at once and ran one: its fault
        assert [f for f in report.failures if NOT_BATCHED in f] and all(NOT_BATCHED in f for f in report.failures), \
            report.failures
    else:  # a client starved of CPU sent one at a time: the engine's batching is not shown, and not failed
        assert not report.failures and "batching not shown" in rows[4].batching_not_shown, rows[4]
    assert all(not row.untied for row in report.rows)  # half-precision differences: ties, not drafter bugs
    assert "runtime dtype: bfloat16, observed: the server's /server_info" in markdown(report)


def test_a_server_that_says_how_it_drafts_needs_no_stated_rule(vllm, serial_bf16):
    """/server_info carries speculative_config.draft_sample_method: greedy here (vLLM's default), so
    sampling parity takes the rule as observed; a stated rule other than greedy-drafts is refused."""
    report = parity(vllm, None, DRAFTER31, url=serial_bf16.url, runtime_options={"dtype": None}, temperature=0.7,
                    max_new_tokens=8)
    assert report.sampling.rule == "greedy-drafts" and report.sampling_rule_basis.startswith("observed")
    assert report.sampled is not None and report.sampled.rounds > 0
    _assert_one_line(*cli("parity", "--drafter", DRAFTER31, "--target", TARGET, "--runtime", "vllm", "--url",
                          serial_bf16.url, "--temperature", "0.7", "--sampling-rule", "rejection"),
                     "vLLM samples by greedy-drafts")
