"""The speculators layout as `export vllm --layout speculators` writes it (no speculators install needed)."""

import json

import pytest
import torch

from factories import drafter_config_for, random_drafter
from eagle31_export.errors import CheckpointError
from eagle31_export.export.speculators_layout import (
    converter_note,
    speculators_checkpoint,
    speculators_library_problems,
    vllm_layout,
    vllm_runtime_key,
)
from eagle31_export.formats.drafter.checkpoint import read_drafter, write_drafter
from eagle31_export.formats.safetensors_io import SafetensorsDir


@pytest.fixture(scope="module")
def eagle31(llama_info):
    return random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True, aux_layer_ids=(1, 3, 4)),
                          seed=2)


def _verifier(folder):
    return json.loads((folder / "config.json").read_text())["speculators_config"]["verifier"]


def test_the_target_is_written_as_verifier_with_its_embeddings(tmp_path, llama_target, eagle31):
    out = write_drafter(speculators_checkpoint(eagle31, llama_target), tmp_path / "spec", "speculators")
    assert _verifier(out) == {"name_or_path": str(llama_target.resolve()), "architectures": ["LlamaForCausalLM"]}
    stored = SafetensorsDir(out)
    torch.testing.assert_close(stored["embed_tokens.weight"], SafetensorsDir(llama_target)["model.embed_tokens.weight"],
                               rtol=0, atol=0)
    # read back: the same drafter, now with the target's embeddings and the verifier kept
    back = read_drafter(out)
    assert back.config == eagle31.config
    assert back.config.extras["speculators_config"]["verifier"]["name_or_path"] == str(llama_target.resolve())
    for name, tensor in eagle31.tensors.items():
        torch.testing.assert_close(back.tensors[name], tensor, rtol=0, atol=0)


def test_a_verifier_survives_a_round_trip_and_stays_null_when_unknown(tmp_path, llama_target, eagle31):
    plain = write_drafter(eagle31, tmp_path / "plain", "speculators")
    assert _verifier(plain)["name_or_path"] is None  # no target known: nothing speculators could resolve
    first = write_drafter(speculators_checkpoint(eagle31, llama_target), tmp_path / "a", "speculators")
    again = write_drafter(read_drafter(first), tmp_path / "b", "speculators")
    assert _verifier(again)["name_or_path"] == str(llama_target.resolve())


def test_a_drafter_with_its_own_embeddings_keeps_them(tmp_path, llama_target, llama_info):
    own = random_drafter(drafter_config_for(llama_info, fc_norm=True), seed=5, with_embeddings=True)
    out = write_drafter(speculators_checkpoint(own, llama_target), tmp_path / "own", "speculators")
    torch.testing.assert_close(SafetensorsDir(out)["embed_tokens.weight"], own.tensors["embed_tokens.weight"])


def test_a_target_without_matching_embeddings_is_refused(tmp_path, llama_target, llama_info):
    narrow = random_drafter(drafter_config_for(llama_info, hidden_size=32, head_dim=8, target_hidden_size=64), seed=5)
    with pytest.raises(CheckpointError, match="embed_tokens"):
        speculators_checkpoint(narrow, llama_target)


def test_layout_choice_and_its_capability_rows(llama_info):
    eagle3 = drafter_config_for(llama_info)
    assert vllm_layout("auto", eagle3) == "eagle"
    assert vllm_layout("speculators", eagle3) == "speculators"
    assert vllm_runtime_key("speculators") == "vllm-speculators" and vllm_runtime_key("eagle") == "vllm"
    with pytest.raises(CheckpointError, match="--layout"):
        vllm_layout("modelopt", eagle3)


def test_readme_warns_about_the_converter_only_for_fc_norm(llama_info):
    note = converter_note(drafter_config_for(llama_info, fc_norm=True), "D", "T")
    assert "speculators convert" in note and "--layout speculators" in note and "fc_norm" in note
    assert converter_note(drafter_config_for(llama_info, norm_output=True), "D", "T") == ""


def test_what_the_speculators_library_itself_cannot_load(llama_info):
    assert speculators_library_problems(drafter_config_for(llama_info, fc_norm=True)) == []
    assert "MLA" in speculators_library_problems(drafter_config_for(llama_info, mla=True))[0]
