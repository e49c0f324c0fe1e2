"""End to end on a REAL Triton server (nvidia-pytriton's tritonserver, 127.0.0.1, free ports):
tiny pair -> TensorRT-LLM bundle -> `cpu` repository -> plain and streaming requests, compared
token for token and statistic for statistic with the reference loop. The `trtllm` repository
is loaded by the same server with a stand-in `tensorrt_llm` module (no GPU here), to prove its
model.py, model.yaml and config.pbtxt work in Triton (Triton's python stub ignores PYTHONPATH;
the stand-in goes in the model's own folder, which is on the stub's sys.path). The server is stopped by the fixture,
also when a test fails."""

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
import torch

pytest.importorskip("pytriton", reason="nvidia-pytriton (bundles tritonserver) is not installed")
pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc,http] is not installed")

from eagle31_export.runtime.triton_repo import export_triton  # noqa: E402
from eagle31_export.export.trtllm import export_trtllm  # noqa: E402
from factories import drafter_config_for, make_target, random_drafter  # noqa: E402
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, write_drafter  # noqa: E402
from eagle31_export.formats.target.checkpoint import load_causal_lm, read_target_info  # noqa: E402
from eagle31_export.reference.pair import load_pair  # noqa: E402
from eagle31_export.reference.speculate import speculate  # noqa: E402
from factories import greedy_decode  # noqa: E402
from eagle31_export.runtime.triton_client import generate, remote_speculate, stream  # noqa: E402
from eagle31_export.runtime.triton_server import TritonServer, free_ports  # noqa: E402

VOCAB = 256


# real engines or servers, or minutes: `make test` runs it, `make test-quick` does not
pytestmark = pytest.mark.engine


def make_bigram_pair(root):
    """A target whose next token is a function f of the current token (attention and MLP outputs
    zeroed, lm_head rows = permuted embeddings), with a word-level tokenizer, and an EAGLE 3.1
    drafter built to predict f for the part of the vocabulary its draft vocab covers: acceptance
    is then a real mix of hits and misses, unlike random weights, which never agree."""
    target = make_target(root / "target", "llama", seed=5)
    model = load_causal_lm(target)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(emb[torch.randperm(VOCAB, generator=gen)])
        f = model(input_ids=torch.arange(VOCAB).unsqueeze(0)).logits[0].argmax(-1)  # positions are independent
    model.save_pretrained(target, safe_serialization=True)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(target)

    cfg = drafter_config_for(read_target_info(target), fc_norm=True, norm_output=True, draft_vocab_size=160)
    ckpt = random_drafter(cfg, seed=7)
    tensors = dict(ckpt.tensors)
    tensors["layers.0.self_attn.o_proj.weight"] = torch.zeros_like(tensors["layers.0.self_attn.o_proj.weight"])
    tensors["layers.0.mlp.down_proj.weight"] = torch.zeros_like(tensors["layers.0.mlp.down_proj.weight"])
    tensors["fc.weight"] = torch.cat([torch.eye(64), torch.zeros(64, 128)], dim=1)  # g = fc_norm_0(tap_0)
    for name in ("fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "norm.weight"):
        tensors[name] = torch.ones(64)
    # The drafter sees the tap of token x and must name the token after next, f(f(x)).
    ff = f[f]
    inverse = {int(ff[x]): x for x in range(VOCAB)}
    draft_targets = torch.arange(160) + tensors["d2t"]
    rows = [emb[inverse[int(t)]] if int(t) in inverse else torch.zeros(64) for t in draft_targets]
    tensors["lm_head.weight"] = torch.stack(rows).detach().clone()
    drafter = write_drafter(DrafterCheckpoint(cfg, tensors), root / "drafter", "specforge")
    return drafter, target


# TEST DOUBLES, not runtimes: TensorRT-LLM (and the mpi4py it brings) cannot be installed here. These
# stand-ins only let Triton load and drive the trtllm flavour's model.py: they echo what the model
# passes to the LLM API, report fixed acceptance metrics, play MPI rank / world size from
# `stand_in.json`, and write what the model asked of them (LLM built, abort, MPI worker, shutdown)
# to `stand_in_events.log`, both in the model's version folder.
STAND_IN_FILES = {
    "tensorrt_llm/__init__.py": """
import json
import os
import threading
import time
from types import SimpleNamespace as NS

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(event):
    with open(os.path.join(HERE, "stand_in_events.log"), "a") as f:
        f.write(event + "\\n")


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class LLM:
    def __init__(self, **kw):
        self.kw = kw
        record("llm " + json.dumps(sorted(kw)))

    def generate_async(self, prompt, params, streaming=False):
        if prompt == "endless":  # streams until aborted
            return _Endless()
        kw = {k: (vars(v) if k == "_mpi_session" else v) for k, v in self.kw.items()}
        return _Result(json.dumps({"llm": kw, "prompt": prompt, "sampling": params.kw}), streaming)

    def shutdown(self):
        record("shutdown")


class _Result:
    def __init__(self, text, streaming):
        self.parts = [text[:10], text[10:]] if streaming else [text]

    def _output(self, i):
        # 11 tokens: the prefill token, then 4 rounds of accepted drafts + a bonus token (6 accepted);
        # 10 drafted: rounds need not all draft max_draft_len (3) tokens.
        spec = NS(acceptance_rate=0.6, total_accepted_draft_tokens=6, total_draft_tokens=10)
        out = NS(text="".join(self.parts[: i + 1]), text_diff=self.parts[i], token_ids=list(range(11)),
                 token_ids_diff=[i],
                 finish_reason="length" if i == len(self.parts) - 1 else None,
                 request_perf_metrics=NS(speculative_decoding=spec))
        return NS(outputs=[out], finished=i == len(self.parts) - 1)

    def __iter__(self):
        return (self._output(i) for i in range(len(self.parts)))

    def result(self):
        return self._output(len(self.parts) - 1)

    def abort(self):
        record("abort")


class _Endless:
    def __init__(self):
        self.aborted = threading.Event()

    def __iter__(self):
        i = 0
        while not self.aborted.wait(0.05):
            out = NS(text="x" * (i + 1), text_diff="x", token_ids=list(range(i + 1)), token_ids_diff=[i],
                     finish_reason=None, request_perf_metrics=None)
            i += 1
            yield NS(outputs=[out], finished=False)

    def result(self):
        self.aborted.wait(60)
        raise RuntimeError("aborted")

    def abort(self):
        record("abort")
        self.aborted.set()
""",
    "tensorrt_llm/_utils.py": """
import json
import os

with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stand_in.json")) as f:
    _WORLD = json.load(f)


def global_mpi_rank():
    return _WORLD["rank"]


def global_mpi_size():
    return _WORLD["world"]
""",
    "tensorrt_llm/llmapi.py": """
class MpiCommSession:
    def __init__(self, comm=None, n_workers=1):
        self.n_workers = n_workers
""",
    "mpi4py/__init__.py": "",
    "mpi4py/MPI.py": """
from tensorrt_llm._utils import global_mpi_rank, global_mpi_size


class _Comm:
    def Get_rank(self):
        return global_mpi_rank()

    def Get_size(self):
        return global_mpi_size()


COMM_WORLD = _Comm()
""",
    "mpi4py/futures.py": """
import contextlib

from tensorrt_llm import record


@contextlib.contextmanager
def MPICommExecutor(comm):
    record(f"mpi worker rank {comm.Get_rank()}")  # a real worker would run rank 0's tasks until it shuts down
    yield None if comm.Get_rank() != 0 else object()
""",
}


def install_trtllm_stand_in(version_dir, rank=0, world=1):
    """Put the stand-ins into a trtllm model's version folder (on the python stub's sys.path)."""
    for name, source in STAND_IN_FILES.items():
        (version_dir / name).parent.mkdir(exist_ok=True)
        (version_dir / name).write_text(textwrap.dedent(source))
    (version_dir / "stand_in.json").write_text(json.dumps({"rank": rank, "world": world}))
    return version_dir / "stand_in_events.log"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_bigram_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def repos(tmp_path_factory, pair):
    drafter, target = pair
    root = tmp_path_factory.mktemp("repos")
    bundle = export_trtllm(drafter, target, root / "bundle", max_draft_len=3)
    trt = export_triton(bundle, root / "trt", "trtllm")
    # Triton's python stub ignores PYTHONPATH; the model's own folder is on its sys.path.
    install_trtllm_stand_in(trt / "tensorrt_llm" / "1")
    return {"cpu": export_triton(bundle, root / "cpu", "cpu"), "trtllm": trt, "bundle": bundle}


@pytest.fixture(scope="module")
def starting_server(repos):
    """The server process, started early: it loads its models while the reference pair loads."""
    http, grpc = free_ports(2)
    srv = TritonServer([repos["cpu"], repos["trtllm"]], http_port=http, grpc_port=grpc,
                       env={"OMP_NUM_THREADS": "1"})
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()  # whatever happened in the tests


@pytest.fixture(scope="module")
def reference(pair, starting_server):
    drafter, target = pair
    return load_pair(drafter, target)


@pytest.fixture(scope="module")
def server(starting_server, reference):
    starting_server.wait_ready()
    return starting_server


PROMPTS = [[5, 6, 7], [200, 3, 77, 41, 9, 12]]


def test_the_pair_accepts_some_drafts_and_not_others(reference):
    result = speculate(reference.target, reference.drafter, PROMPTS[0], 24, 3)
    assert 0 in result.accepted_per_step and any(a > 0 for a in result.accepted_per_step)


def test_streaming_service_in_process_reports_every_round(pair):
    """The observer sees the loop's own commits: chunk sizes follow accepted_per_step exactly."""
    drafter, target = pair
    from eagle31_export.runtime.registry import LoopSpeculator
    from eagle31_export.runtime.triton_service import SpeculationService as Service

    ref = load_pair(drafter, target)
    service = Service(LoopSpeculator("reference", ref.target, ref.drafter), depth=3)
    chunks = []
    result = service.generate(PROMPTS[0], 20, on_tokens=chunks.append)
    assert sum(chunks, []) + result.tokens[sum(map(len, chunks)):] == result.tokens
    assert [len(c) for c in chunks] == [1] + [a + 1 for a in result.accepted_per_step[:-1]]
    assert result.tokens == speculate(ref.target, ref.drafter, PROMPTS[0], 20, 3).tokens


def test_plain_request_matches_the_reference(server, reference):
    for prompt in PROMPTS:
        ref = speculate(reference.target, reference.drafter, prompt, 20, 3)
        got = generate(server.http_url, prompt, max_tokens=20)
        assert got.tokens == ref.tokens == greedy_decode(reference.target, prompt, 20)
        assert got.accepted_per_step == ref.accepted_per_step
        assert got.acceptance_length == pytest.approx(ref.acceptance_length, rel=1e-6)
        assert got.stats["draft_tokens"] == ref.drafts
        assert got.stats["total_draft_tokens"] == [ref.drafts_proposed]
        assert got.text == " ".join(f"w{t}" for t in ref.tokens)  # detokenised


def test_streaming_request_matches_the_reference(server, reference):
    prompt = PROMPTS[1]
    ref = speculate(reference.target, reference.drafter, prompt, 20, 3)
    chunks = []
    for new, final in stream(server.grpc_url, prompt, max_tokens=20):
        chunks.append((new, set(final.stats)))  # `final` accumulates; its stats arrive with the last response
    assert final.tokens == ref.tokens
    assert final.accepted_per_step == ref.accepted_per_step
    assert final.acceptance_length == pytest.approx(ref.acceptance_length, rel=1e-6)
    # One response per round: the prefill token, then each round's accepted drafts + bonus.
    assert len(chunks) == len(ref.accepted_per_step) + 1
    assert [len(new) for new, _ in chunks[:-1]] == [1] + [a + 1 for a in ref.accepted_per_step[:-1]]
    assert all(not stats for _, stats in chunks[:-1]) and "acceptance_length" in chunks[-1][1]
    assert final.text == " ".join(f"w{t}" for t in ref.tokens)


def test_text_prompt_is_tokenised(server, reference):
    ref = speculate(reference.target, reference.drafter, [5, 6, 7], 10, 2)
    got = generate(server.http_url, "w5 w6 w7", max_tokens=10, depth=2)
    assert got.tokens == ref.tokens and got.accepted_per_step == ref.accepted_per_step


def test_remote_speculate_with_sampling_matches_the_reference(server, reference):
    """Seeded speculative rejection sampling on the server reproduces the reference loop exactly."""
    prompt = PROMPTS[0]
    ref = speculate(reference.target, reference.drafter, prompt, 16, 3, temperature=0.8, seed=11)
    got = remote_speculate(server.http_url, prompt, 16, 3, temperature=0.8, seed=11)
    assert (got.tokens, got.drafts, got.accepted_per_step) == (ref.tokens, ref.drafts, ref.accepted_per_step)
    assert got.acceptance_length == ref.acceptance_length


def test_trtllm_flavour_loads_and_passes_model_yaml_to_the_llm_api(server, repos):
    import numpy as np
    import tritonclient.http as httpclient
    import yaml

    model_yaml = yaml.safe_load((repos["trtllm"] / "tensorrt_llm" / "1" / "model.yaml").read_text())
    with httpclient.InferenceServerClient(server.http_url) as client:
        config = client.get_model_config("tensorrt_llm")
        assert config["model_transaction_policy"]["decoupled"] is True  # from model.yaml triton_config
    texts, last = [], None
    prompt = np.asarray([b"hello"], dtype=np.object_)
    for new, so_far in _stream_trtllm(server.grpc_url, prompt):
        texts.append(new)
        last = so_far
    echoed = json.loads("".join(texts))
    assert echoed["llm"] == {k: v for k, v in model_yaml.items() if k != "triton_config"}
    assert echoed["llm"]["backend"] == "pytorch" and echoed["llm"]["speculative_config"]["decoding_type"] == "Eagle3"
    assert echoed["sampling"] == {"max_tokens": 8}
    assert last["total_accepted_draft_tokens"] == 6 and last["total_draft_tokens"] == 10
    # tau from what the runtime reports: 4 rounds made the 10 tokens after the first, not 10 / max_draft_len
    assert last["acceptance_length"] == pytest.approx(10 / 4)


def _stream_trtllm(grpc_url, prompt):
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    answers = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    inputs = []
    for name, value, dtype in (("text_input", prompt, "BYTES"), ("streaming", np.asarray([True]), "BOOL"),
                               ("sampling_param_max_tokens", np.asarray([8], dtype=np.int32), "INT32")):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("tensorrt_llm", inputs)
        while True:
            result, error = answers.get(timeout=60)
            assert error is None, error
            stats = {n: result.as_numpy(n)[0] for n in ("total_accepted_draft_tokens", "total_draft_tokens",
                                                        "acceptance_length") if result.as_numpy(n) is not None}
            yield result.as_numpy("text_output")[0].decode(), stats
            if result.as_numpy("finish_reason") is not None:
                return
    finally:
        client.stop_stream()
        client.close()


def test_serve_refuses_a_port_in_use(monkeypatch, capsys, repos):
    from eagle31_export.cli.main import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setattr(sys, "argv", ["eagle31-export", "serve", str(repos["cpu"]), "--port", str(port),
                                          "--grpc-port", str(free_ports(1)[0])])
        with pytest.raises(SystemExit) as exit_:
            main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is in use; pick a free one with --port N or stop whatever is listening there"]


def _ctrl_c_as_in_a_terminal() -> None:
    # A job started in the background of a non-interactive shell inherits SIGINT ignored (POSIX), and
    # Python then keeps ignoring it; `serve` run from a terminal has it at the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_serve_stops_cleanly_on_ctrl_c(tmp_path, repos):
    """`serve` on the light trtllm-flavour repository: ready, then SIGINT -> exit 0, server gone."""
    port, grpc = free_ports(2)
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "eagle31_export.cli.main", "serve", str(repos["trtllm"]),
                             "--port", str(port), "--grpc-port", str(grpc)], stdout=log, stderr=log,
                            preexec_fn=_ctrl_c_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.3)
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "tritonserver stopped" in (tmp_path / "serve.log").read_text()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
        log.close()


def test_parity_command_against_the_running_server(server, pair, cli, tmp_path):
    """`eagle31-export parity --runtime triton`: the served pair passes against the reference."""
    drafter, target = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt_ids": {p}}}\n' for p in PROMPTS))
    code, out, err = cli("parity", "--drafter", drafter, "--target", target, "--runtime", "triton",
                         "--url", server.http_url, "--prompts", prompts, "--depth", "3", "--max-new-tokens", "16",
                         "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"], (err, report["failures"])
    assert all(r["drafts_identical"] and r["accepted_identical"] for r in report["prompts"])
    assert report["tau_reference"] > 1.0
