"""Deployable repositories: written with --copy-target, moved to another folder, their inputs
deleted, and served there by a REAL Triton server (nvidia-pytriton's tritonserver). The `cpu`
repository answers exactly as the reference pair does; the `trtllm` repository's model.py hands the
LLM API the drafter and target named in model.yaml relative to its own folder (a stand-in
`tensorrt_llm` refuses to load unless both resolve)."""

import shutil
import textwrap

import pytest

pytest.importorskip("pytriton", reason="nvidia-pytriton (bundles tritonserver) is not installed")
pytest.importorskip("tritonclient.http", reason="tritonclient[grpc,http] is not installed")

from eagle31_export.export.trtllm import export_trtllm  # noqa: E402
from eagle31_export.formats.outputs import check_artifacts, verify_output  # noqa: E402
from eagle31_export.reference.pair import load_pair  # noqa: E402
from eagle31_export.reference.speculate import speculate  # noqa: E402
from eagle31_export.runtime.triton_client import generate  # noqa: E402
from eagle31_export.runtime.triton_server import TritonServer, free_ports  # noqa: E402

# Loads only if the checkpoints model.yaml names exist relative to the working directory model.py chose.
FAKE_TRTLLM = {
    "__init__.py": '''
        import os


        class SamplingParams:
            def __init__(self, **kw):
                self.kw = kw


        class LLM:
            def __init__(self, model, speculative_config, **kw):
                drafter = speculative_config["speculative_model"]
                for what, path in (("model", model), ("speculative_model", drafter)):
                    if os.path.isabs(path) or not os.path.isfile(os.path.join(path, "config.json")):
                        raise RuntimeError(f"{what} {path!r} does not resolve from {os.getcwd()}")

            def shutdown(self):
                pass
    ''',
    "_utils.py": '''
        def global_mpi_rank():
            return 0


        def global_mpi_size():
            return 1
    ''',
}


# real engines or servers, or minutes: `make test` runs it, `make test-quick` does not
pytestmark = pytest.mark.engine


def test_repositories_moved_elsewhere_are_served(cli, tmp_path, eagle31_dir, llama_target):
    inputs = tmp_path / "inputs"
    target = shutil.copytree(llama_target, inputs / "target")
    bundle = export_trtllm(eagle31_dir, target, inputs / "bundle", max_draft_len=3)
    written = {}
    for flavor in ("cpu", "trtllm"):
        written[flavor] = tmp_path / "written" / flavor
        code, _, err = cli("export", "triton", "--bundle", bundle, "--flavor", flavor, "--copy-target",
                           "--out", written[flavor])
        assert code == 0, err
    prompt = [5, 6, 7, 8]
    reference = load_pair(eagle31_dir, target)
    expected = speculate(reference.target, reference.drafter, prompt, 12, 3)

    served = tmp_path / "elsewhere" / "deploy"
    served.mkdir(parents=True)
    for flavor, repo in written.items():
        shutil.move(str(repo), str(served / flavor))
        check_artifacts(served / flavor)  # what `serve` checks first, from the new place
        assert verify_output(served / flavor) == []
    shutil.rmtree(tmp_path / "written")
    shutil.rmtree(inputs)  # nothing it was written from is left
    fake = served / "trtllm" / "tensorrt_llm" / "1" / "tensorrt_llm"  # the model's folder is on its sys.path
    fake.mkdir()
    for name, text in FAKE_TRTLLM.items():
        (fake / name).write_text(textwrap.dedent(text))

    http, grpc = free_ports(2)
    with TritonServer([served / "cpu", served / "trtllm"], http_port=http, grpc_port=grpc,
                      env={"OMP_NUM_THREADS": "1"}) as server:  # ready: every model loaded, tensorrt_llm included
        got = generate(server.http_url, prompt, max_tokens=12)
    assert got.tokens == expected.tokens and got.accepted_per_step == expected.accepted_per_step
