"""Reading vLLM's /metrics (Prometheus text, with prometheus_client's parser), the batch figures of a
level from samples of its running gauge, and --repeat's comparison, on hand-written inputs; the same
code against real engines: tests/test_vllm_engine.py, tests/test_vllm_serving.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eagle31_export.parity.concurrency import ConcurrencyRow, LoadRuns, compare_repeats
from eagle31_export.reference.speculate import SpecResult
from eagle31_export.runtime.contract import ConcurrentRun
from eagle31_export.runtime.vllm_client import (
    BatchSample, RunningSampler, parse_engine_metrics, parse_metrics, parse_spec_counters,
)
from eagle31_export.runtime.vllm_runtime import batch_figures

# two engines, as vLLM 0.32 writes its page (counters as NAME_total and NAME_created)
PAGE = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 40.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="target"} 2.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.79e+09
vllm:spec_decode_num_drafts_created{engine="1",model_name="target"} 1.79e+09
# HELP vllm:spec_decode_num_draft_tokens Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 120.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="target"} 6.0
# HELP vllm:spec_decode_num_accepted_tokens Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 50.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="target"} 1.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="0"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="target"} 3.0
vllm:num_requests_running{engine="1",model_name="target"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="target"} 2.0
vllm:num_requests_waiting{engine="1",model_name="target"} 0.0
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="target"} 600.0
vllm:prefix_cache_queries_total{engine="1",model_name="target"} 100.0
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="target"} 256.0
vllm:prefix_cache_hits_total{engine="1",model_name="target"} 0.0
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="target"} 3.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="target"} 30.0
vllm:iteration_tokens_total_count{engine="0",model_name="target"} 30.0
vllm:iteration_tokens_total_sum{engine="0",model_name="target"} 411.0
vllm:iteration_tokens_total_count{engine="1",model_name="target"} 4.0
vllm:iteration_tokens_total_sum{engine="1",model_name="target"} 9.0
# HELP vllm:generation_tokens Number of generation tokens processed.
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="target"} 93.0
vllm:generation_tokens_total{engine="1",model_name="target"} 7.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0"} 1.0
"""


def test_spec_counters_are_summed_over_engines():
    counters = parse_spec_counters(PAGE)
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (42, 126, 51)
    assert counters.accepted_per_position == [26, 15, 10]


def test_a_page_without_speculative_decoding_has_no_spec_counters():
    no_spec = "\n".join(line for line in PAGE.splitlines() if "spec_decode" not in line) + "\n"
    assert parse_spec_counters(no_spec) is None
    assert parse_spec_counters("") is None


def test_engine_metrics():
    m = parse_engine_metrics(PAGE)
    assert (m.running, m.waiting, m.prefix_cache_hits, m.prefix_cache_queries, m.steps) == (4, 2, 256, 700, 34)
    assert m.cache_info["block_size"] == "128" and m.cache_info["enable_prefix_caching"] == "True"
    assert m.spec.drafts == 42 and m.generated == 100


def test_families_filter_keeps_the_named_metrics_only():
    samples = parse_metrics(PAGE, ("vllm:num_requests_running",))
    assert set(samples) == {"vllm:num_requests_running"}
    assert sorted(v for _, v in samples["vllm:num_requests_running"]) == [1.0, 3.0]


def test_a_page_that_is_not_prometheus_text_is_a_value_error():
    with pytest.raises(ValueError):
        parse_metrics("<html><body>Not Found</body></html>")


def _sampler(samples: list[tuple[int, int, int]], most: int) -> RunningSampler:
    sampler = RunningSampler(client=None)
    sampler.samples = [BatchSample(running, 0, (before, after)) for running, before, after in samples]
    sampler.most_in_flight = most
    return sampler


def test_batch_figures_from_samples():
    # idle before, 1 then 4 running while all 4 were in flight, 2 while the last two finished, idle after
    figures = batch_figures(_sampler([(0, 0, 4), (1, 4, 4), (4, 4, 4), (4, 4, 4), (2, 2, 2), (0, 0, 0)], 4), 4)
    assert figures.histogram == {1: 1, 4: 2, 2: 1} and figures.largest == 4 and figures.in_flight == 4
    assert figures.mean == pytest.approx(11 / 4) and figures.steady_mean == pytest.approx(3.0)
    assert figures.steady_calls == 3
    serial = batch_figures(_sampler([(1, 4, 4)] * 5, 4), 4)
    assert serial.largest == 1 and serial.mean == 1.0
    assert batch_figures(_sampler([], 4), 4) is None  # no sample: cannot tell


def _result(tokens, steps):
    return SpecResult(tokens, [], steps, 3)


def test_a_repeat_that_differs_fails_naming_the_level_the_repeat_and_the_prompt():
    base = [_result([1, 2, 3, 4], [2, 0]), _result([5, 6, 7], [1, 0])]
    same = ConcurrentRun([_result([1, 2, 3, 4], [2, 0]), _result([5, 6, 7], [1, 0])],
                         {"prefix_cache_hits": 128, "prefix_cache_queries": 300})
    off = ConcurrentRun([_result([1, 2, 3, 4], [2, 0]), _result([5, 6, 7], [0, 1])],
                        {"prefix_cache_hits": 128, "prefix_cache_queries": 300})
    load = LoadRuns(runs={4: ConcurrentRun(base)}, seconds={4: 1.0},
                    repeats={1: [(same, 1.0)], 4: [(same, 1.0), (off, 1.0)]})
    rows = [ConcurrencyRow(c, 2, 2, 2, 2, 2, [], 4, 3, [2, 1, 0], 1.75, 1.0, 7) for c in (1, 4)]
    failures = compare_repeats(rows, base, load, exact=True)
    assert len(failures) == 1, failures
    assert failures[0].startswith("concurrency 4, repeat 2 of 2: 1 of 2 prompts differ from this level's first send")
    assert "prompt 1: round 0 accepted 0 drafts vs 1" in failures[0] and "prefix cache" in failures[0]
    assert [r.same_as_first for r in rows[1].repeats] == [2, 1] and rows[1].repeats[1].differing_prompts == [1]
    assert rows[0].repeats[0].prefix_cache_hits == 128
    # half precision without a tie judge: counted, not failed (as the levels are)
    assert compare_repeats([ConcurrencyRow(c, 2, 2, 2, 2, 2, [], 4, 3, [2, 1, 0], 1.75, 1.0, 7) for c in (1, 4)],
                           base, load, exact=False) == []


def test_sparse_samples_are_held_against_the_engine_counters():
    # two reads only, both caught 2 running; the engine verified 192 rounds in 18 steps: a mean of
    # 10.67 requests a step, so some step verified 11 or more
    figures = batch_figures(_sampler([(2, 16, 16), (2, 16, 16)], 16), 16, {"rounds": 192, "engine_steps": 18})
    assert (figures.sampled_largest, figures.counted_largest, figures.largest) == (2, 11, 11)
    assert "counters" in figures.source
    # an engine that ran one at a time takes more steps than rounds: the counters prove nothing more
    serial = batch_figures(_sampler([(1, 4, 4)] * 3, 4), 4, {"rounds": 96, "engine_steps": 104})
    assert (serial.sampled_largest, serial.counted_largest, serial.largest) == (1, 1, 1)
    unknown = batch_figures(_sampler([(3, 4, 4)], 4), 4, {"rounds": 96, "engine_steps": None})
    assert (unknown.counted_largest, unknown.largest) == (None, 3) and "counters" not in unknown.source


def test_counters_read_the_same_with_or_without_total():
    """vLLM exports its counters as NAME_total on /metrics (prometheus_client's text format) and as NAME in
    LLM.get_metrics() (vllm/v1/metrics/reader.py, 0.33.0); a page written either way reads the same, typed or
    not."""
    import re

    bare = re.sub(r"^(vllm:[a-z_:]+?)_total(\{)", r"\1\2", PAGE, flags=re.M)
    assert bare != PAGE and "spec_decode_num_drafts_total" not in bare
    untyped = "\n".join(line for line in PAGE.splitlines() if not line.startswith("#")) + "\n"
    for page in (bare, untyped):
        assert parse_spec_counters(page) == parse_spec_counters(PAGE)
        mine, want = parse_engine_metrics(page), parse_engine_metrics(PAGE)
        assert (mine.prefix_cache_hits, mine.prefix_cache_queries, mine.generated, mine.running) == (
            want.prefix_cache_hits, want.prefix_cache_queries, want.generated, want.running)


# What vLLM 0.33.0 registers and accepts, extracted from its wheel's source by tests/vllm_names.py (the extract
# names its source); EAGLE31_VLLM_033_SOURCE=<unzipped wheel> extracts it again and compares.
VLLM_033 = json.loads((Path(__file__).parent / "data" / "vllm-0.33.0-names.json").read_text())


def test_the_committed_extract_is_what_the_0_33_source_says():
    site = os.environ.get("EAGLE31_VLLM_033_SOURCE")
    if not site:
        pytest.skip("EAGLE31_VLLM_033_SOURCE names no unzipped vllm 0.33.0 wheel")
    from vllm_names import extract

    assert extract(Path(site)) == {k: v for k, v in VLLM_033.items() if k != "source"}


def test_what_the_client_reads_is_what_vllm_0_33_registers():
    """Every name the client reads is one vLLM 0.33.0 registers, read as the kind it registers (counters
    with `_total` on the page), from the hand-written page above."""
    from eagle31_export.runtime import vllm_client as client

    kinds = {client.RUNNING: "gauge", client.WAITING: "gauge", client.CACHE_HITS: "counter",
             client.CACHE_QUERIES: "counter", client.STEPS: "histogram", client.GENERATED: "counter",
             client.CACHE_INFO: "gauge", client.SPEC_PREFIX + "num_accepted_tokens_per_pos": "counter",
             **{client.SPEC_PREFIX + short: "counter" for short in client._SPEC_FIELDS}}
    registered = VLLM_033["metrics"]
    assert {name: registered.get(name) for name in kinds} == kinds
    for name, kind in kinds.items():
        assert (f"# TYPE {name} {kind}" in PAGE) or (kind == "gauge" and f"\n{name}{{" in PAGE), name


def test_bundles_speculative_config_uses_vllm_0_33_keys(tmp_path, eagle31_dir, llama_target):
    import json

    from eagle31_export.export.vllm import export_vllm
    from eagle31_export.runtime.registry import LoadOptions
    from eagle31_export.runtime.vllm_runtime import engine_args

    bundle = export_vllm(eagle31_dir, llama_target, tmp_path / "b")
    spec = json.loads((bundle / "speculative_config.json").read_text())
    fields = set(VLLM_033["speculative_config_fields"])  # @config forbids any other key
    assert set(spec) <= fields and spec["method"] == "eagle3"
    args = engine_args({**json.loads((bundle / "bundle.json").read_text()), "drafter": str(bundle / "drafter")},
                       LoadOptions(depth=3))
    served = json.loads(args[args.index("--speculative-config") + 1])
    assert set(served) <= fields
