"""The Triton `cpu` repository under load, on a REAL Triton server (nvidia-pytriton's tritonserver):
`parity --runtime triton --concurrency 4,16` over plain HTTP requests, exact (fp32) for the tiny
pair's EAGLE 3.1 and EAGLE-3 drafters. The speculation model serves the requests in flight together
(batched backend calls with per-sequence positions, cache lengths and padding masks): each response
lists the batched calls the request took part in, the client unions a level's into its batch sizes,
and at C = 16 most calls serve all 16 requests. The server log says how large its calls grew.

The same servers sample: `parity --temperature T --sampling-rule greedy-drafts` sends the rule (and
top_p / top_k) with each request; the server generates, the reference is replayed along its output
(every accepted token the reference drafter's greedy draft, acceptance per position within 3 sigma).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("pytriton", reason="nvidia-pytriton (bundles tritonserver) is not installed")
pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")

from eagle31_export.export.trtllm import export_trtllm  # noqa: E402
from eagle31_export.runtime.triton_repo import export_triton  # noqa: E402
from eagle31_export.runtime.triton_server import TritonServer, free_ports  # noqa: E402

PAIR = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "models"
DRAFTERS = ("drafter-eagle31", "drafter-eagle3")


# real engines or servers, or minutes: `make test` runs it, `make test-quick` does not
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server per drafter (the repositories' model names are the same), started together."""
    started = {}
    try:
        for name in DRAFTERS:
            root = tmp_path_factory.mktemp(name)
            bundle = export_trtllm(PAIR / name, PAIR / "target", root / "bundle", max_draft_len=3)
            http, grpc = free_ports(2)
            started[name] = TritonServer([export_triton(bundle, root / "cpu", "cpu")], http_port=http, grpc_port=grpc,
                                         env={"OMP_NUM_THREADS": "1"}).start()
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_parity_under_load_against_the_batched_cpu_repository(servers, cli, tmp_path, drafter):
    server = servers[drafter]
    code, out, err = cli("parity", "--drafter", PAIR / drafter, "--target", PAIR / "target", "--runtime", "triton",
                         "--url", server.http_url, "--concurrency", "4,16", "--max-new-tokens", "16", "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"], (err, report["failures"])
    rows = {row["concurrency"]: row for row in report["concurrency"]}
    assert sorted(rows) == [1, 4, 16]
    for row in rows.values():
        assert row["same_tokens_as_c1"] == row["same_rounds_as_c1"] == row["same_tokens_as_reference"] == 16
        assert row["accepted_per_position"] == rows[1]["accepted_per_position"]
    assert all(p["drafts_identical"] for p in report["prompts"])
    assert rows[1]["accepted"] > 0
    steady = rows[16]["batching"]
    assert steady["source"] == "backend calls, as the server reported them", steady
    assert steady["in_flight"] == 16 and steady["largest"] == 16 and steady["steady_calls"] > 0, steady
    assert steady["steady_mean"] >= 0.8 * 16, steady  # in step: most calls serve every request in flight
    assert rows[4]["batching"]["largest"] == 4 and rows[4]["batching"]["in_flight"] == 4, rows[4]["batching"]
    grown = [int(m) for line in server.log_lines() for m in re.findall(r"largest batched call so far: (\d+)", line)]
    assert grown and max(grown) >= 4, server.log_lines()[-20:]


# (drafter, temperature, extra options): each drafter once, T = 0.7 plain and T = 1.0 with top-p and top-k
# cuts (tests/test_sampling_parity.py runs both temperatures on ONNX Runtime). At T = 1 fewer drafts are
# accepted: more tokens, so that every draft position is reached often enough for (b).
TOKENS = {0.7: "32", 1.0: "64"}
SAMPLED = [(DRAFTERS[0], 0.7, ()), (DRAFTERS[1], 1.0, ("--top-p", "0.9", "--top-k", "20"))]


@pytest.mark.parametrize("drafter, temperature, cuts", SAMPLED,
                         ids=[f"{d}-T{t}" + ("-cut" if c else "") for d, t, c in SAMPLED])
def test_sampled_parity_under_the_greedy_drafts_rule(servers, cli, drafter, temperature, cuts):
    code, out, err = cli("parity", "--drafter", PAIR / drafter, "--target", PAIR / "target", "--runtime", "triton",
                         "--url", servers[drafter].http_url, "--temperature", str(temperature),
                         "--sampling-rule", "greedy-drafts", *cuts, "--max-new-tokens", TOKENS[temperature], "--json")
    report = json.loads(out)
    assert code == 0 and report["verdict"] == "PASS", (err, report["failures"], report["inconclusive"])
    assert report["sampling"]["rule"] == "greedy-drafts" and report["sampling"]["temperature"] == temperature
    if cuts:
        assert (report["sampling"]["top_p"], report["sampling"]["top_k"]) == (0.9, 20)
    check = report["sampled_check"]
    assert check["drafts_exact"] and check["accepted_checked"] > 0, check
    zs = [p["z"] for p in check["positions"]]
    assert all(z is not None and abs(z) <= 3 for z in zs), (zs, check["tau"])
    print(f"{drafter} T={temperature} {' '.join(cuts)}: tau {check['tau']}, z per position {zs}, "
          f"accepted checked {check['accepted_checked']}, rejections checked {check['rejections_checked']}")
