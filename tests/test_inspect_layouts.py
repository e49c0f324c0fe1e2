"""`inspect` on the layouts the training projects publish: true origin, exact EAGLE variant, defaulted
taps marked, a vocabulary summary, the target's own problems; and exports keep the keys runtimes read."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle31_export.errors import UserError
from eagle31_export.export.vllm import export_vllm
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter, write_drafter
from eagle31_export.formats.drafter.formats import FORMATS
from factories import drafter_config_for, random_drafter


def _inspect(cli, *args):
    code, out, _ = cli("inspect", *args, "--json")
    return code, json.loads(out)


def _edit_config(folder, change):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("flags, variant, version", [
    ({}, "3", "3"),
    ({"norm_output": True}, "3 + post-norm", "3.1"),
    ({"fc_norm": True}, "3 + fc_norm", "3.1"),
    ({"fc_norm": True, "norm_output": True}, "3.1", "3.1"),
    ({"norm_before_fc": True}, "3 + norm_before_fc", "3"),
    # what speculators 0.9.0 trains when neither flag is set, and calls 3.1
    ({"norm_before_fc": True, "norm_output": True}, "3.1, speculators layout: norm_before_fc + norm_output", "3.1"),
])
def test_inspect_names_the_eagle_variant_exactly(cli, tmp_path, llama_info, flags, variant, version):
    layout = "speculators" if flags.get("norm_before_fc") else "eagle"  # the EAGLE layout holds no input_norm
    folder = write_drafter(random_drafter(drafter_config_for(llama_info, **flags)), tmp_path / "d", layout)
    code, report = _inspect(cli, folder)
    assert code == 0
    assert report["eagle_variant"] == variant
    assert report["eagle_version"] == version  # the runtimes' code path: either flag takes the 3.1 one
    assert (report["config"]["fc_norm"], report["config"]["norm_output"], report["config"]["norm_before_fc"]) == (
        flags.get("fc_norm", False), flags.get("norm_output", False), flags.get("norm_before_fc", False))


def test_a_drafter_without_taps_is_a_problem_naming_each_engines_choice(cli, tmp_path, llama_target, llama_info):
    """No eagle_aux_hidden_state_layer_ids: every engine taps its own default, whatever the drafter was trained
    on; inspect lists it as a problem (exit 1) with each engine's pick in its own numbering, for the target."""
    bare = write_drafter(random_drafter(drafter_config_for(llama_info, aux_layer_ids=None)), tmp_path / "bare", "eagle")
    code, alone = _inspect(cli, bare)
    assert code == 1
    assert alone["config"]["aux_layer_ids"] is None and alone["tapped_layers"]["output_of_layer"] is None
    assert alone["taps"].startswith("default ({1, N//2-1, N-4}") and "--target" in alone["taps"]
    [problem] = alone["problems"]
    assert "names no tapped layers" in problem
    assert "vLLM (2, N//2, N-3) before layer i" in problem and "TensorRT-LLM {1, N//2-1, N-4} outputs of layers" in problem
    assert "SGLang [2, N//2, N-3] before layer i" in problem

    code, paired = _inspect(cli, bare, "--target", llama_target)
    n = llama_info.num_hidden_layers  # 8: vLLM and SGLang enter layers 2, 4, 5; TensorRT-LLM outputs of 1, 3, 4
    assert code == 1 and "taps" not in paired
    assert paired["tapped_layers"]["source"] == "default for the target"
    assert paired["tapped_layers"]["output_of_layer"] == [1, n // 2 - 1, n - 4] == [1, 3, 4]
    [problem] = paired["problems"]
    assert ("vLLM [2, 4, 5] (before layer i) = outputs of layers [1, 3, 4], TensorRT-LLM [1, 3, 4] (output of layer i), "
            "SGLang [2, 4, 5] (before layer i) = outputs of layers [1, 3, 4] on this 8-layer target") in problem

    # a drafter that names them reports "config" and no problem
    named = write_drafter(random_drafter(drafter_config_for(llama_info, aux_layer_ids=(0, 2, 6))),
                          tmp_path / "named-taps", "specforge")
    code, report = _inspect(cli, named, "--target", llama_target)
    assert code == 0 and report["tapped_layers"]["source"] == "config" and report["problems"] == []
    assert report["tapped_layers"]["output_of_layer"] == [0, 2, 6] and "taps" not in report


def test_vocabulary_summary(cli, tmp_path, eagle31_dir, eagle31_ckpt, llama_info):
    code, report = _inspect(cli, eagle31_dir)
    d2t = eagle31_ckpt.tensors["d2t"]
    ids = sorted(int(d) + int(o) for d, o in enumerate(d2t.tolist()))
    assert code == 0
    assert report["vocabulary"] == {
        "vocab_size": llama_info.vocab_size, "draft_vocab_size": llama_info.vocab_size // 2,
        "target_ids": {"min": ids[0], "max": ids[-1]}, "d2t": "offsets", "t2d": "agrees with d2t"}

    # the TensorRT-LLM layout stores no t2d, nor a d2t for a full-size draft vocabulary (every id maps to itself)
    full = random_drafter(drafter_config_for(llama_info, draft_vocab_size=llama_info.vocab_size))
    full.tensors["d2t"] = torch.zeros(llama_info.vocab_size, dtype=torch.int64)
    del full.tensors["t2d"]
    code, report = _inspect(cli, write_drafter(full, tmp_path / "full", "trtllm"))
    assert code == 0
    assert report["vocabulary"]["d2t"] == "absent" and report["vocabulary"]["t2d"] == "absent"
    assert report["vocabulary"]["target_ids"] == {"min": 0, "max": llama_info.vocab_size - 1}

    # a t2d marking other target ids than d2t reaches: summarised and listed as a problem
    wrong = dict(eagle31_ckpt.tensors)
    wrong["t2d"] = torch.roll(eagle31_ckpt.tensors["t2d"], 1)
    assert not torch.equal(wrong["t2d"], eagle31_ckpt.tensors["t2d"])
    folder = write_drafter(DrafterCheckpoint(eagle31_ckpt.config, wrong), tmp_path / "wrong", "specforge")
    code, report = _inspect(cli, folder)
    assert code == 1 and report["vocabulary"]["t2d"] == "differs from d2t"
    assert any("t2d" in p for p in report["problems"])


def test_target_problems_are_included_with_target(cli, tmp_path, eagle31_dir, llama_target):
    broken = tmp_path / "target"
    shutil.copytree(llama_target, broken)
    (weights,) = broken.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])
    save_file(tensors, weights, metadata={"format": "pt"})

    code, alone = _inspect(cli, broken)
    assert code == 1 and alone["problems"]
    code, report = _inspect(cli, eagle31_dir, "--target", broken)
    assert code == 1
    assert [p for p in report["problems"] if p.startswith("target: ")] == [f"target: {p}" for p in alone["problems"]]
    with pytest.raises(UserError, match="not servable"):  # the same problem blocks the export
        export_vllm(eagle31_dir, broken, tmp_path / "bundle")

    code, clean = _inspect(cli, eagle31_dir, "--target", llama_target)
    assert code == 0 and clean["problems"] == []


def test_standard_keys_are_not_unknown(cli, tmp_path, llama_info):
    ckpt = random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True))
    specforge = _edit_config(write_drafter(ckpt, tmp_path / "specforge", "specforge"),
                             lambda c: c.update(auto_map={"AutoConfig": "configuration.Config"}))
    modelopt = _edit_config(write_drafter(ckpt, tmp_path / "modelopt", "modelopt"),
                            lambda c: c["eagle_config"].update(parallel_draft_heads_num_layers=1, parallel_draft_step=1))
    for folder, fmt in ((specforge, "specforge"), (modelopt, "modelopt")):
        code, report = _inspect(cli, folder)
        assert code == 0 and report["unknown_config_keys"] == [] and report["origin"] == fmt
    # a key nobody defines is still reported
    _edit_config(modelopt, lambda c: c.update(made_up_key=1))
    assert _inspect(cli, modelopt)[1]["unknown_config_keys"] == ["made_up_key"]


def test_torchspec_is_named_as_origin(cli, tmp_path, llama_info):
    # TorchSpec's SpecForge-layout export carries its version key
    ckpt = random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True))
    midlayer = _edit_config(write_drafter(ckpt, tmp_path / "ts", "specforge"),
                            lambda c: c.update(_torchspec_version="0.1.0"))
    code, report = _inspect(cli, midlayer)
    assert code == 0 and (report["format"], report["origin"]) == ("specforge", "torchspec")
    assert report["unknown_config_keys"] == []

    # TorchSpec's MLA drafter config (configs/draft_models/kimi_k25_eagle3_mla.json): layers.0.* names,
    # Eagle3DeepseekV2ForCausalLM and an eagle_config without ModelOpt's export flags
    mla = random_drafter(drafter_config_for(llama_info, mla=True, fc_norm=True, norm_output=True,
                                            aux_layer_ids=(1, 3, 5)))
    written = write_drafter(mla, tmp_path / "modelopt-mla", "modelopt")
    code, report = _inspect(cli, written)
    assert code == 0 and (report["format"], report["origin"]) == ("modelopt", "modelopt")

    def torchspec_shape(c):
        c.update(architectures=["Eagle3DeepseekV2ForCausalLM"], model_type="kimi_k2")
        c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True,
                             "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                             "use_mtp_layernorm": False}
    torchspec = _edit_config(shutil.copytree(written, tmp_path / "torchspec-mla"), torchspec_shape)
    code, report = _inspect(cli, torchspec)
    assert code == 0 and (report["format"], report["origin"]) == ("modelopt", "torchspec")
    assert report["eagle_variant"] == "3.1" and report["config"]["attention"] == "mla"


WINDOW = {"sliding_window": 64, "use_sliding_window": False, "max_window_layers": 1,
          "layer_types": ["full_attention"]}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_runtime_keys_round_trip_through_every_format(tmp_path, llama_info, fmt):
    ckpt = random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True))
    first = write_drafter(ckpt, tmp_path / "a", fmt)
    layer_config = (lambda c: c["transformer_layer_config"]) if fmt == "speculators" else (lambda c: c)
    _edit_config(first, lambda c: layer_config(c).update(WINDOW))
    back = read_drafter(first)
    assert back.unknown_config_keys == []
    second = write_drafter(back, tmp_path / "b", fmt)
    written = layer_config(json.loads((second / "config.json").read_text()))
    assert {k: written.get(k) for k in WINDOW} == WINDOW


def test_export_vllm_keeps_the_attention_window_keys(tmp_path, llama_info, llama_target):
    ckpt = random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True))
    for fmt in ("specforge", "eagle"):
        src = _edit_config(write_drafter(ckpt, tmp_path / fmt, fmt), lambda c: c.update(WINDOW))
        bundle = export_vllm(src, llama_target, tmp_path / f"vllm-{fmt}")
        written = json.loads((bundle / "drafter" / "config.json").read_text())
        assert {k: written.get(k) for k in WINDOW} == WINDOW
