"""`export triton`: repositories for both flavours, every config.pbtxt parsed as Triton's
ModelConfig protobuf, model.yaml checked field by field; bad input refused in one line."""

import json

import pytest
import yaml

pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")

from eagle31_export.export.sglang import export_sglang  # noqa: E402
from eagle31_export.runtime.triton_repo import load_repository_configs  # noqa: E402
from eagle31_export.export.trtllm import export_trtllm  # noqa: E402
from eagle31_export.export.vllm import export_vllm  # noqa: E402
from eagle31_export.formats.drafter.checkpoint import read_drafter  # noqa: E402


@pytest.fixture(scope="module")
def bundles(tmp_path_factory, eagle31_dir, llama_target):
    root = tmp_path_factory.mktemp("bundles")
    return {"trtllm": export_trtllm(eagle31_dir, llama_target, root / "trtllm", tp=2, max_draft_len=4),
            "vllm": export_vllm(eagle31_dir, llama_target, root / "vllm"),
            "sglang": export_sglang(eagle31_dir, llama_target, root / "sglang")}


def names(tensors):
    return [t.name for t in tensors]


def test_trtllm_repository(cli, tmp_path, bundles, llama_target):
    code, out, err = cli("export", "triton", "--bundle", bundles["trtllm"], "--out",
                         tmp_path / "repo", "--flavor", "trtllm")
    assert code == 0, err
    repo = tmp_path / "repo"
    configs = load_repository_configs(repo)
    assert list(configs) == ["tensorrt_llm"]
    config = configs["tensorrt_llm"]
    assert config.name == "tensorrt_llm" and config.backend == "python"
    assert names(config.input)[:2] == ["text_input", "streaming"]
    assert {"text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"} <= set(
        names(config.output))
    model_yaml = yaml.safe_load((repo / "tensorrt_llm" / "1" / "model.yaml").read_text())
    # Relative to model.yaml's folder, where the drafter is copied and the target linked
    assert model_yaml["model"] == "target" and model_yaml["backend"] == "pytorch"
    assert (repo / "tensorrt_llm" / "1" / "target").resolve() == llama_target.resolve()
    assert (repo / "tensorrt_llm" / "1" / "drafter" / "config.json").is_file()
    assert model_yaml["tensor_parallel_size"] == 2 and model_yaml["pipeline_parallel_size"] == 1
    assert model_yaml["speculative_config"] == {
        "decoding_type": "Eagle3", "max_draft_len": 4, "speculative_model": "drafter",
        "eagle3_one_model": True, "eagle3_layers_to_capture": [1, 3, 4]}
    assert model_yaml["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    assert (repo / "tensorrt_llm" / "1" / "model.py").read_text().startswith('"""Triton python-backend model serving')


@pytest.mark.parametrize("kind", ["trtllm", "vllm", "sglang"])
def test_cpu_repository_from_any_bundle(tmp_path, bundles, eagle31_dir, kind):
    from eagle31_export.runtime.triton_repo import export_triton

    repo = export_triton(bundles[kind], tmp_path / "repo", "cpu")
    configs = load_repository_configs(repo)
    assert set(configs) == {"eagle31_speculate", "eagle31_generate"}
    speculate, generate = configs["eagle31_speculate"], configs["eagle31_generate"]
    assert speculate.model_transaction_policy.decoupled is True
    assert generate.model_transaction_policy.decoupled is False
    assert speculate.max_batch_size == 0 and speculate.backend == "python"
    assert "streaming" in names(speculate.input) and "streaming" not in names(generate.input)
    assert all(i.optional for i in speculate.input)
    assert names(speculate.output) == names(generate.output)
    assert {"output_ids", "accepted_per_step", "acceptance_length", "draft_tokens"} <= set(names(speculate.output))
    assert generate.parameters["speculation_model"].string_value == "eagle31_speculate"
    pair = json.loads((repo / "eagle31_speculate" / "1" / "pair" / "pair.json").read_text())
    assert pair["bundle_kind"] == kind
    # The copied drafter is the source drafter, whatever layout the bundle held.
    copied, source = read_drafter(repo / "eagle31_speculate" / "1" / "pair" / "drafter"), read_drafter(eagle31_dir)
    assert copied.config.aux_layer_ids == (1, 3, 4) and copied.config.fc_norm and copied.config.norm_output
    assert set(copied.tensors) == set(source.tensors)
    for name in source.tensors:
        assert (copied.tensors[name] == source.tensors[name]).all(), name


def test_bad_input(cli, tmp_path, bundles):
    base = ("export", "triton", "--out", tmp_path / "repo")
    code, _, err = cli(*base, "--bundle", bundles["vllm"], "--flavor", "trtllm")
    assert code == 2 and "needs a bundle from `export trtllm`" in err and len(err.strip().splitlines()) == 1
    code, _, err = cli(*base, "--bundle", tmp_path, "--flavor", "cpu")
    assert code == 2 and "no bundle.json" in err
    code, _, err = cli(*base, "--bundle", bundles["vllm"], "--flavor", "gpu")
    assert code == 2 and "unknown --flavor 'gpu'" in err
    assert not (tmp_path / "repo").exists()
    assert cli(*base, "--bundle", bundles["vllm"], "--flavor", "cpu")[0] == 0
    code, _, err = cli(*base, "--bundle", bundles["vllm"], "--flavor", "cpu")
    assert code == 2 and "already exists" in err
    assert cli(*base, "--bundle", bundles["vllm"], "--flavor", "cpu", "--force")[0] == 0


def test_repository_files_name_their_final_paths(tmp_path, bundles):
    """No temporary build folder leaks into what a user reads or a server loads."""
    from eagle31_export.runtime.triton_repo import export_triton

    repo = export_triton(bundles["trtllm"], tmp_path / "repo", "cpu")
    for path in repo.rglob("*"):
        if path.suffix in (".json", ".md", ".pbtxt", ".yaml"):
            assert ".tmp-" not in path.read_text(), path
