"""The served models under bad input, load, tensor-parallel ranks and cancellation, on a REAL Triton
server (nvidia-pytriton's tritonserver on 127.0.0.1), one server for the whole module.

- `cpu` repository: a corpus of malformed requests, each answered 400 (gRPC INVALID_ARGUMENT) with
  one line naming the problem and nothing of ONNX Runtime's or torch's text, the server serving on
  afterwards; concurrent streaming clients, every output equal to the reference loop's.
- `trtllm` repository as two MPI ranks of a tensor_parallel_size 2 job: rank 0 leads (its LLM gets
  the job's MPI session), rank 1 lends itself as a worker and refuses requests; a cancelled stream
  aborts the LLM request. TensorRT-LLM cannot be installed here: `tensorrt_llm` and `mpi4py` are
  the TEST DOUBLES of tests/test_triton_server.py (STAND_IN_FILES), which only record what the
  model asks of them. What they cannot show (a real multi-GPU job, TensorRT-LLM's own abort) is
  not claimed here.
"""

import ast
import json
import queue
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("pytriton", reason="nvidia-pytriton (bundles tritonserver) is not installed")
pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc,http] is not installed")

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from eagle31_export.errors import UserError  # noqa: E402
from eagle31_export.export.trtllm import export_trtllm  # noqa: E402
from eagle31_export.reference.pair import load_pair  # noqa: E402
from eagle31_export.reference.speculate import Sampling, speculate  # noqa: E402
from eagle31_export.runtime.triton_client import stream  # noqa: E402
from eagle31_export.runtime.triton_repo import CPU_INPUTS, GENERATE_MODEL, SPECULATE_MODEL, export_triton  # noqa: E402
from eagle31_export.runtime.triton_server import TritonServer, free_ports  # noqa: E402
from eagle31_export.runtime.triton_service import (  # noqa: E402
    INTERNAL_ERROR, Limits, RequestError, SpeculationService, client_error)
from eagle31_export.runtime.triton_status import tag_status, untag_status  # noqa: E402
from test_triton_server import VOCAB, install_trtllm_stand_in, make_bigram_pair  # noqa: E402

POSITIONS = 512  # the bigram pair's max_position_embeddings: the exported graphs' rope tables
LEAKS = re.compile(r"onnx|Gather|torch|Traceback|File \"|\.py\b|Error:|Exception", re.IGNORECASE)
RANK1_MODEL = "tensorrt_llm_rank1"


# real engines or servers, or minutes: `make test` runs it, `make test-quick` does not
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_bigram_pair(tmp_path_factory.mktemp("pair"))


def _as_rank(repo, model, rank, world):
    """A trtllm repository's model as MPI rank `rank` of a `world`-rank job (tensor_parallel_size = world),
    renamed to `model` so that one server can hold every rank."""
    folder = repo / "tensorrt_llm"
    if model != folder.name:
        folder = folder.rename(repo / model)
        config = folder / "config.pbtxt"
        config.write_text(config.read_text().replace('name: "tensorrt_llm"', f'name: "{model}"'))
    model_yaml = folder / "1" / "model.yaml"
    options = yaml.safe_load(model_yaml.read_text())
    options["tensor_parallel_size"] = world
    model_yaml.write_text(yaml.safe_dump(options, sort_keys=False))
    return install_trtllm_stand_in(folder / "1", rank=rank, world=world)


@pytest.fixture(scope="module")
def repos(tmp_path_factory, pair):
    drafter, target = pair
    root = tmp_path_factory.mktemp("repos")
    bundle = export_trtllm(drafter, target, root / "bundle", max_draft_len=3)
    rank0, rank1 = (export_triton(bundle, root / f"tp2-rank{r}", "trtllm") for r in (0, 1))
    return {"cpu": export_triton(bundle, root / "cpu", "cpu"), "rank0": rank0, "rank1": rank1,
            "events0": _as_rank(rank0, "tensorrt_llm", 0, 2), "events1": _as_rank(rank1, RANK1_MODEL, 1, 2)}


@pytest.fixture(scope="module")
def starting_server(repos):
    http, grpc = free_ports(2)
    srv = TritonServer([repos["cpu"], repos["rank0"], repos["rank1"]], http_port=http, grpc_port=grpc,
                       env={"OMP_NUM_THREADS": "1"})
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(pair, starting_server):  # loads while the server starts
    return load_pair(*pair)


@pytest.fixture(scope="module")
def server(starting_server, reference):
    starting_server.wait_ready()
    return starting_server


def _tensor(module, name, value, dtype):
    t = module.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def ids(*values):
    return ("input_ids", np.asarray(values, dtype=np.int64), "INT64")


def i32(name, *values):
    return (name, np.asarray(values, dtype=np.int32), "INT32")


def text(value: bytes):
    return ("text_input", np.asarray([value], dtype=np.object_), "BYTES")


def rule(value: bytes):
    return ("sampling_rule", np.asarray([value], dtype=np.object_), "BYTES")


HOT = ("temperature", np.asarray([0.7], np.float32), "FP32")


MAX4 = i32("max_tokens", 4)
# (case, inputs, a word the one-line answer must contain)
MALFORMED = [
    ("negative token id", [ids(-1, 6), MAX4], "token id -1"),
    ("token id == vocabulary size", [ids(5, VOCAB), MAX4], f"token id {VOCAB}"),
    ("token id far past the vocabulary", [ids(2 ** 40), MAX4], "out of range"),
    ("empty input_ids", [("input_ids", np.zeros(0, dtype=np.int64), "INT64"), MAX4], "empty"),
    ("input_ids and text_input", [ids(5), text(b"w5"), MAX4], "not both"),
    ("no prompt at all", [MAX4], "input_ids"),
    ("max_tokens 0", [ids(5), i32("max_tokens", 0)], "max_tokens"),
    ("max_tokens negative", [ids(5), i32("max_tokens", -3)], "max_tokens"),
    ("max_tokens past the rope tables", [ids(5), i32("max_tokens", 100000)], f"{POSITIONS} positions"),
    ("prompt past the rope tables", [ids(*[5] * (POSITIONS + 10)), MAX4], "too long"),
    ("num_draft_tokens 0", [ids(5), MAX4, i32("num_draft_tokens", 0)], "num_draft_tokens"),
    ("num_draft_tokens negative", [ids(5), MAX4, i32("num_draft_tokens", -2)], "num_draft_tokens"),
    ("num_draft_tokens huge", [ids(5), MAX4, i32("num_draft_tokens", 1000)], "num_draft_tokens"),
    ("temperature NaN", [ids(5), MAX4, ("temperature", np.asarray([np.nan], np.float32), "FP32")], "temperature"),
    ("temperature inf", [ids(5), MAX4, ("temperature", np.asarray([np.inf], np.float32), "FP32")], "temperature"),
    ("temperature negative", [ids(5), MAX4, ("temperature", np.asarray([-0.5], np.float32), "FP32")],
     "temperature"),
    ("stop id past the vocabulary", [ids(5), MAX4, ("stop_token_ids", np.asarray([999], np.int64), "INT64")],
     "stop_token_ids"),
    ("stop id negative", [ids(5), MAX4, ("stop_token_ids", np.asarray([-3], np.int64), "INT64")],
     "stop_token_ids"),
    ("text_input not UTF-8", [text(b"\xff\xfe w5"), MAX4], "UTF-8"),
    ("text_input empty", [text(b""), MAX4], "empty"),
    ("unknown sampling_rule", [ids(5), MAX4, HOT, rule(b"nucleus")], "sampling_rule"),
    ("sampling_rule not UTF-8", [ids(5), MAX4, HOT, rule(b"\xff")], "UTF-8"),
    ("top_p 0", [ids(5), MAX4, HOT, ("top_p", np.asarray([0.0], np.float32), "FP32")], "top_p"),
    ("top_p above 1", [ids(5), MAX4, HOT, ("top_p", np.asarray([1.5], np.float32), "FP32")], "top_p"),
    ("top_k negative", [ids(5), MAX4, HOT, i32("top_k", -1)], "top_k"),
    # rejected by Triton itself against config.pbtxt, before the model sees them
    ("input_ids as FP32", [("input_ids", np.asarray([5.0], np.float32), "FP32"), MAX4], "data-type"),
    ("max_tokens with two values", [ids(5), i32("max_tokens", 4, 5)], "shape"),
    ("unknown input", [ids(5), MAX4, ("bogus", np.asarray([1], np.int64), "INT64")], "bogus"),
]


def _http_error(server, inputs):
    with httpclient.InferenceServerClient(server.http_url) as client:
        try:
            client.infer(GENERATE_MODEL, [_tensor(httpclient, *i) for i in inputs])
        except InferenceServerException as err:
            return err.status(), err.message()
    return "200", ""


@pytest.mark.parametrize("case, inputs, word", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_request_is_a_400_with_one_line(server, case, inputs, word):
    status, message = _http_error(server, inputs)
    assert status == "400", (case, status, message)
    assert "\n" not in message.strip() and word in message, message
    assert not LEAKS.search(message), message


def test_the_same_answers_over_grpc_and_the_stream(server):
    """gRPC `infer` (generate front): INVALID_ARGUMENT; the decoupled model's stream: the same line,
    without the status tag the front uses internally."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for case, inputs, word in MALFORMED[:3] + MALFORMED[10:15]:
        with pytest.raises(InferenceServerException) as err:
            client.infer(GENERATE_MODEL, [_tensor(grpcclient, *i) for i in inputs])
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT", (case, err.value.status())
        http_status, http_message = _http_error(server, inputs)
        assert err.value.message() == http_message
        answers = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer(SPECULATE_MODEL, [_tensor(grpcclient, *i) for i in inputs])
            result, error = answers.get(timeout=60)
        finally:
            client.stop_stream()
        assert result is None and error is not None, case
        assert error.message() == http_message and "|" not in error.message(), error.message()
    client.close()


def test_the_server_serves_on_after_the_corpus(server, reference):
    for _, inputs, _ in MALFORMED:
        _http_error(server, inputs)
    prompt = [200, 3, 77]
    ref = speculate(reference.target, reference.drafter, prompt, 12, 3)
    *_, (_, got) = stream(server.grpc_url, prompt, max_tokens=12)
    assert (got.tokens, got.accepted_per_step) == (ref.tokens, ref.accepted_per_step)
    # client errors are not server failures: nothing of them in the server's error log
    assert not [line for line in server.log_lines() if "eagle31_speculate: Traceback" in line]


def test_concurrent_streaming_clients_match_the_reference(server, reference):
    """8 clients x 3 requests at once, gRPC streaming: every output equals the reference loop's.
    (benchmarks/triton_load.py runs 32 x 10 on the tiny trained pair.)"""
    clients, per_client = 8, 3
    rng = random.Random(0)
    jobs = [[([rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))], rng.randint(8, 20))
             for _ in range(per_client)] for _ in range(clients)]
    expected = {(tuple(p), n): speculate(reference.target, reference.drafter, p, n, 3)
                for job in jobs for p, n in job}

    def client(job):
        outcomes = []
        for prompt, n in job:
            try:
                *_, (_, got) = stream(server.grpc_url, prompt, max_tokens=n)
                ref = expected[(tuple(prompt), n)]
                outcomes.append("ok" if (got.tokens, got.accepted_per_step) == (ref.tokens, ref.accepted_per_step)
                                else "mismatch")
            except Exception as err:  # counted, and shown if any
                outcomes.append(f"error: {err}")
        return outcomes

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        outcomes = [o for result in pool.map(client, jobs) for o in result]
    wall = time.perf_counter() - start
    errors = [o for o in outcomes if o.startswith("error")]
    mismatches = outcomes.count("mismatch")
    print(f"\n{clients} clients x {per_client} requests: {len(errors)} errors, {mismatches} mismatches, "
          f"{wall:.1f} s, {len(outcomes) / wall:.1f} requests/s")
    assert len(outcomes) == clients * per_client
    assert not errors and mismatches == 0, (errors[:3], mismatches)


def test_internal_failures_reach_the_client_as_one_generic_line(repos):
    """Only our own request checks reach the client verbatim; a real ONNX Runtime failure does not."""
    import torch

    from eagle31_export.runtime.onnxruntime import load_backends

    target, _ = load_backends(repos["cpu"] / SPECULATE_MODEL / "1" / "pair" / "onnx")
    with pytest.raises(Exception) as failure:  # what an unchecked id past the vocabulary used to reach
        target.forward(torch.tensor([[VOCAB]]))
    assert "ONNXRuntimeError" in str(failure.value) and "Gather" in str(failure.value)  # the raw text
    for err in (failure.value, UserError("position 600 is past the target graph's rope table"), KeyError("x")):
        assert client_error(err) == (INTERNAL_ERROR, False)
    assert client_error(RequestError("max_tokens must be >= 1 (got 0)\nmore")) == ("max_tokens must be >= 1 (got 0)",
                                                                                  True)
    assert untag_status(tag_status("bad id", True)) == ("bad id", True)
    assert untag_status(tag_status(INTERNAL_ERROR, False)) == (INTERNAL_ERROR, False)
    assert untag_status("Stub process is not healthy.") == ("Stub process is not healthy.", None)
    assert untag_status("a|b") == ("a|b", None)


def test_the_position_limit_is_what_the_graphs_hold(repos):
    """At the limit the exported graphs run to the end; one token more is refused before running (and,
    run unchecked, would have reached past the rope tables)."""
    service = SpeculationService.from_dir(repos["cpu"] / SPECULATE_MODEL / "1" / "pair")
    assert (service.limits.vocab_size, service.limits.max_positions) == (VOCAB, POSITIONS)
    prompt, depth = [random.Random(1).randrange(VOCAB) for _ in range(400)], 2  # a long prompt: few rounds to run
    room = POSITIONS - len(prompt) - depth + 1
    result = service.generate(prompt, room, depth)
    assert len(result.tokens) == room
    with pytest.raises(RequestError, match=f"at most {room}"):
        service.generate(prompt, room + 1, depth)
    with pytest.raises(UserError, match="rope table"):  # and the limit is tight: unchecked, this one fails
        service.speculator.run(prompt, room + 1, depth)
    parsed = service.parse({"input_ids": np.asarray(prompt[:3]), "max_tokens": np.asarray([7], np.int32),
                            "streaming": np.asarray([True])})
    assert (parsed.prompt, parsed.max_tokens, parsed.depth, parsed.streaming) == (prompt[:3], 7, 3, True)


def test_cpu_readme_documents_the_checks_and_status_codes(repos):
    readme = (repos["cpu"] / "README.md").read_text()
    for fact in ("INVALID_ARG", "HTTP 400", "HTTP 500", "0..vocab_size-1", "num_draft_tokens` from 1", "finite",
                 "`top_p` in (0, 1]", "`top_k` >= 0", "`greedy-drafts`", "default 0 = all"):
        assert fact in readme, fact


@pytest.mark.parametrize("inputs, word", [
    ({"sampling_rule": np.asarray([b"nucleus"], dtype=np.object_)}, "sampling_rule must be one of"),
    ({"sampling_rule": np.asarray([b"a", b"b"], dtype=np.object_)}, "exactly one string"),
    ({"top_p": np.asarray([0.0], np.float32)}, "top_p must be in (0, 1]"),
    ({"top_p": np.asarray([np.nan], np.float32)}, "top_p must be in (0, 1]"),
    ({"top_p": np.asarray([1.01], np.float32)}, "top_p must be in (0, 1]"),
    ({"top_k": np.asarray([-1], np.int32)}, "top_k must be >= 0"),
    ({"top_k": np.asarray([1.5], np.float32)}, "top_k must be an integer"),
])
def test_bad_sampling_settings_are_refused_in_one_line(inputs, word):
    """Parsed without a server (or a pair): the sampling settings are checked with the rest."""
    service = SpeculationService(None, limits=Limits(vocab_size=VOCAB))
    base = {"input_ids": np.asarray([5, 6]), "temperature": np.asarray([0.7], np.float32)}
    with pytest.raises(RequestError) as refused:
        service.parse({**base, **inputs})
    assert word in str(refused.value) and len(str(refused.value).splitlines()) == 1, refused.value


def test_sampling_settings_reach_the_speculator():
    """What parse reads is what the speculator is asked to sample by: a `Sampling` when sampling, a bare
    temperature at 0; the model forwards every input config.pbtxt declares."""
    service = SpeculationService(None, limits=Limits(vocab_size=VOCAB))
    parsed = service.parse({"input_ids": np.asarray([5]), "temperature": np.asarray([0.5], np.float32),
                            "top_p": np.asarray([0.75], np.float32), "top_k": np.asarray([20], np.int32),
                            "sampling_rule": np.asarray([b"greedy-drafts"], dtype=np.object_)})
    assert parsed.sampling == Sampling(0.5, 0.75, 20, "greedy-drafts")
    plain = service.parse({"input_ids": np.asarray([5]), "temperature": np.asarray([0.5], np.float32)})
    assert plain.sampling == Sampling(0.5) and service.parse({"input_ids": np.asarray([5])}).sampling == 0.0
    source = (Path(__file__).parents[1] / "eagle31_export" / "runtime" / "triton_models" / "cpu_model.py").read_text()
    forwarded = next(ast.literal_eval(node.value) for node in ast.parse(source).body
                     if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "INPUTS")
    assert set(forwarded) == {name for name, *_ in CPU_INPUTS} | {"streaming"}


def _trtllm_stream(server, model, prompt, extra=(), cancel_after=None):
    """(responses, error) of one streamed request; with `cancel_after` N the stream is closed with
    cancel_requests after N responses."""
    answers = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = [("text_input", np.asarray([prompt.encode()], dtype=np.object_), "BYTES"),
              ("streaming", np.asarray([True]), "BOOL"), *extra]
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    got, error = [], None
    try:
        client.async_stream_infer(model, [_tensor(grpcclient, *i) for i in inputs])
        while True:
            result, error = answers.get(timeout=60)
            if error is not None:
                break
            got.append(result)
            if cancel_after is not None and len(got) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                break
            if result.as_numpy("finish_reason") is not None:
                break
    finally:
        client.stop_stream()
        client.close()
    return got, error


def _events(path):
    return path.read_text().splitlines() if path.exists() else []


def test_trtllm_rank_0_leads_the_whole_mpi_job(server, repos):
    got, error = _trtllm_stream(server, "tensorrt_llm", "hello")
    assert error is None, error
    echoed = json.loads("".join(r.as_numpy("text_output")[0].decode() for r in got))
    assert echoed["llm"]["tensor_parallel_size"] == 2  # from model.yaml
    assert echoed["llm"]["_mpi_session"] == {"n_workers": 2}  # the job's ranks are the LLM's workers
    assert [e for e in _events(repos["events0"]) if e.startswith(("llm", "mpi"))] == [
        'llm ' + json.dumps(sorted(echoed["llm"]))]


def test_trtllm_rank_1_works_for_rank_0_and_serves_nothing(server, repos):
    events = _events(repos["events1"])
    assert events == ["mpi worker rank 1"]  # lent to rank 0's session; no LLM of its own
    got, error = _trtllm_stream(server, RANK1_MODEL, "hello")
    assert got == [] and "MPI rank 1" in error.message() and "rank 0" in error.message()
    assert _events(repos["events1"]) == events


def test_trtllm_cancelled_stream_aborts_the_llm_request(server, repos):
    before = _events(repos["events0"]).count("abort")
    got, error = _trtllm_stream(server, "tensorrt_llm", "endless", cancel_after=2)
    assert len(got) == 2 and error is None
    deadline = time.monotonic() + 10
    while _events(repos["events0"]).count("abort") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _events(repos["events0"]).count("abort") == before + 1
    got, error = _trtllm_stream(server, "tensorrt_llm", "hello")  # and it serves on
    assert error is None and got[-1].as_numpy("finish_reason") is not None


@pytest.mark.parametrize("name, value, dtype", [("sampling_param_max_tokens", 0, np.int32),
                                                ("sampling_param_temperature", np.nan, np.float32),
                                                ("sampling_param_top_p", 1.5, np.float32),
                                                ("sampling_param_top_k", -1, np.int32)])
def test_trtllm_bad_sampling_values_are_one_line_errors(server, name, value, dtype):
    triton_type = "INT32" if dtype == np.int32 else "FP32"
    got, error = _trtllm_stream(server, "tensorrt_llm", "hello",
                                extra=[(name, np.asarray([value], dtype=dtype), triton_type)])
    assert got == [] and error.message().startswith(name) and "\n" not in error.message(), error.message()
