"""The sabotage library (eagle31_export/sabotage.py) and `eagle31-export sabotage`: each class makes a copy
that differs from its source exactly as described and in nothing else, the command writes it under the
output rules, and `inspect` / `verify` name what the engines would run differently (docs/silent-bugs.md)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle31_export.export.vllm import export_vllm
from eagle31_export.formats.drafter.checkpoint import write_drafter
from eagle31_export.formats.outputs import verify_output
from eagle31_export.inspection import inspect_path
from eagle31_export.sabotage import SABOTAGES, catalogue, write_sabotaged
from factories import drafter_config_for, random_drafter


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(src: Path, dst: Path) -> tuple[dict, set, set]:
    """(config keys that differ: key -> (before, after), tensors that differ, other files that differ)."""
    a, b = flatten(config_of(src)), flatten(config_of(dst))
    keys = {k: (a.get(k, "<absent>"), b.get(k, "<absent>")) for k in set(a) | set(b) if a.get(k, "<absent>") !=
            b.get(k, "<absent>")}
    ta, tb = tensors_of(src), tensors_of(dst)
    names = {n for n in set(ta) | set(tb) if n not in ta or n not in tb or not torch.equal(ta[n], tb[n])}
    files = {p.name for p in dst.iterdir() if p.is_file() and p.suffix != ".safetensors"
             and p.name not in ("config.json", "manifest.json", "sabotage.json")
             and (not (src / p.name).is_file() or (src / p.name).read_bytes() != p.read_bytes())}
    return keys, names, files


@pytest.fixture(scope="module")
def rope_drafter(tmp_path_factory, llama_info):
    """An EAGLE 3.1 drafter with a yarn rope_scaling (the rope classes need one)."""
    cfg = drafter_config_for(llama_info, fc_norm=True, norm_output=True,
                             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    return write_drafter(random_drafter(cfg, seed=3), tmp_path_factory.mktemp("rope") / "d", "specforge")


@pytest.fixture(scope="module")
def nbfc_drafter(tmp_path_factory, llama_info):
    """A speculators-layout drafter with norm_before_fc (what NVIDIA checkpoints nest in eagle_config)."""
    cfg = drafter_config_for(llama_info, norm_output=True, norm_before_fc=True)
    return write_drafter(random_drafter(cfg, seed=4), tmp_path_factory.mktemp("nbfc") / "d", "speculators")


# class -> (config keys that must change, tensors that must change); nothing else may differ
EXPECTED = {
    "random_embed_tokens": (set(), {"embed_tokens.weight"}),
    "drop_d2t": (set(), {"d2t", "t2d"}),
    "nested_flags": ({"fc_norm", "eagle_config.fc_norm"}, set()),
    "absent_norm_output": ({"norm_output"}, set()),
    "cut_positions": ({"max_position_embeddings"}, set()),
    "sliding_window": ({"sliding_window", "use_sliding_window", "layer_types"}, set()),
    "fc_norm_unapplied": ({"fc_norm"}, set()),
    "pre_norm_feedback": ({"norm_output"}, set()),
    "drop_fc_norm": ({"fc_norm"}, {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}),
    "shift_d2t": (set(), {"d2t"}),
    "scale_fc": (set(), {"fc.weight"}),
    "scale_rope_theta": ({"rope_theta"}, set()),
    "shifted_taps": ({"eagle_config.eagle_aux_hidden_state_layer_ids"}, set()),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_class_changes_exactly_what_it_says(tmp_path, eagle31_dir, name):
    out = write_sabotaged(eagle31_dir, name, tmp_path / name)
    keys, names, files = differences(eagle31_dir, out)
    want_keys, want_tensors = EXPECTED[name]
    assert set(keys) == want_keys, keys
    assert names == want_tensors
    assert not files  # every other file copied byte for byte
    record = json.loads((out / "sabotage.json").read_text())
    assert record["name"] == name and record["description"] == SABOTAGES[name].description
    assert verify_output(out) == []  # a valid output of this tool: its own manifest


def test_the_values_are_the_ones_described(tmp_path, eagle31_dir, llama_target):
    src = tensors_of(eagle31_dir)
    emb = tensors_of(write_sabotaged(eagle31_dir, "random_embed_tokens", tmp_path / "e"))["embed_tokens.weight"]
    target_emb = load_file(next(Path(llama_target).glob("*.safetensors")))["model.embed_tokens.weight"]
    assert emb.shape == target_emb.shape and not torch.equal(emb, target_emb)
    assert abs(float(emb.float().std()) - 0.02) < 0.002
    nested = config_of(write_sabotaged(eagle31_dir, "nested_flags", tmp_path / "n"))
    assert "fc_norm" not in nested and nested["eagle_config"]["fc_norm"] is True
    cut = config_of(write_sabotaged(eagle31_dir, "cut_positions", tmp_path / "c"))
    assert cut["max_position_embeddings"] == config_of(eagle31_dir)["max_position_embeddings"] // 2
    shifted = tensors_of(write_sabotaged(eagle31_dir, "shift_d2t", tmp_path / "s"))["d2t"]
    ids = torch.arange(len(src["d2t"]))
    assert torch.equal(ids + shifted, torch.roll(ids + src["d2t"], -1))


def test_rope_and_speculators_classes(tmp_path, rope_drafter, nbfc_drafter):
    keys, names, _ = differences(rope_drafter, write_sabotaged(rope_drafter, "drop_rope_scaling", tmp_path / "r"))
    assert set(keys) == {"rope_scaling", "rope_scaling.rope_type", "rope_scaling.factor",
                         "rope_scaling.original_max_position_embeddings"} and not names  # the object became null
    assert config_of(tmp_path / "r")["rope_scaling"] is None
    linear = config_of(write_sabotaged(rope_drafter, "yarn_as_linear", tmp_path / "y"))["rope_scaling"]
    assert linear == {"rope_type": "linear", "factor": 4.0}
    # speculators keeps norm_before_fc at the top level; the copy nests it, nothing else moves
    keys, names, _ = differences(nbfc_drafter, write_sabotaged(nbfc_drafter, "nested_flags", tmp_path / "b"))
    assert set(keys) == {"norm_before_fc", "eagle_config.norm_before_fc"} and not names
    keys, _, _ = differences(nbfc_drafter, write_sabotaged(nbfc_drafter, "cut_positions", tmp_path / "p"))
    assert set(keys) == {"transformer_layer_config.max_position_embeddings"}  # where this layout keeps it


def test_a_class_with_nothing_to_break_is_refused_in_one_line(cli, tmp_path, eagle31_dir, eagle3_dir):
    for source, bug, message in ((eagle31_dir, "drop_rope_scaling", "no rope_scaling"),
                                 (eagle3_dir, "nested_flags", "nothing a reader of the top-level key would miss"),
                                 (eagle3_dir, "fc_norm_unapplied", "no fc_norm")):
        code, _, err = cli("sabotage", source, "--bug", bug, "--out", tmp_path / bug)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / bug).exists()


def test_list_names_every_class_with_its_reports(cli):
    code, out, _ = cli("sabotage", "--list")
    assert code == 0
    for entry in catalogue():
        assert entry["name"] in out and entry["description"] in out
    assert len(catalogue()) >= 15
    code, out, _ = cli("sabotage", "--list", "--json")
    listed = json.loads(out)["classes"]
    assert [c["name"] for c in listed] == list(SABOTAGES)
    assert all(c["reports"] for c in listed if c["name"] not in ("scale_fc", "scale_rope_theta"))


def test_cli_round_trip_and_refusals(cli, tmp_path, eagle31_dir):
    code, out, err = cli("sabotage", eagle31_dir, "--bug", "drop_d2t", "--out", tmp_path / "copy")
    assert code == 0 and "never serve it" in out and (tmp_path / "copy" / "manifest.json").is_file()
    refusals = [
        (["sabotage", eagle31_dir, "--bug", "drop_d2t", "--out", tmp_path / "copy"], "already exists"),
        (["sabotage", eagle31_dir, "--bug", "drop_d2t", "--out", Path(eagle31_dir) / "inside"], "inside the input"),
        (["sabotage", eagle31_dir, "--bug", "no_such_bug", "--out", tmp_path / "x"], "unknown sabotage"),
        (["sabotage", eagle31_dir, "--out", tmp_path / "x"], "needs BUNDLE_OR_DRAFTER, --bug NAME and --out"),
        (["sabotage", tmp_path / "nowhere", "--bug", "drop_d2t", "--out", tmp_path / "x"], "neither a serving bundle"),
    ]
    for args, message in refusals:
        code, _, err = cli(*args)
        assert code == 2 and message in err, err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    code, _, _ = cli("sabotage", eagle31_dir, "--bug", "scale_fc", "--out", tmp_path / "copy", "--force")
    assert code == 0 and json.loads((tmp_path / "copy" / "sabotage.json").read_text())["name"] == "scale_fc"


def test_a_bundle_copy_breaks_only_its_drafter(tmp_path, eagle31_dir, llama_target):
    bundle = export_vllm(eagle31_dir, llama_target, tmp_path / "bundle")
    out = write_sabotaged(bundle, "nested_flags", tmp_path / "broken")
    assert verify_output(out) == []
    record, original = (json.loads((p / "bundle.json").read_text()) for p in (out, bundle))
    assert record.pop("sabotage")["name"] == "nested_flags"
    assert record == original  # drafter_source still names the faithful drafter: parity's reference
    keys, names, files = differences(bundle / "drafter", out / "drafter")
    assert set(keys) == {"fc_norm", "eagle_config.fc_norm"} and not names and not files
    for name in ("README.md", "speculative_config.json"):
        assert (out / name).read_bytes() == (bundle / name).read_bytes()
    # verify names what vLLM would run differently in the broken copy, and nothing in the faithful bundle
    from eagle31_export.inspection import bundle_lints
    assert any("fc_norm is set only in eagle_config" in w for w in bundle_lints(out))
    assert not any("only in eagle_config" in w for w in bundle_lints(bundle))


def test_a_changed_bundle_is_refused_before_copying(tmp_path, eagle31_dir, llama_target):
    bundle = export_vllm(eagle31_dir, llama_target, tmp_path / "bundle")
    (bundle / "README.md").write_text("edited")
    with pytest.raises(Exception, match="changed since it was written"):
        write_sabotaged(bundle, "drop_d2t", tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ---- the lints `inspect` runs on each copy
LINTS = {
    "random_embed_tokens": ("problems", "embed_tokens that differ from the target's"),
    "drop_d2t": ("problems", "tensor 'd2t' missing"),
    "nested_flags": ("problems", "fc_norm is set only in eagle_config"),
    "absent_norm_output": ("warnings", "norm_output is absent from config.json"),
    "cut_positions": ("problems", "drafter holds"),
    "sliding_window": ("warnings", "declares a sliding window"),
}


@pytest.mark.parametrize("name", sorted(LINTS))
def test_inspect_names_each_class(tmp_path, eagle31_dir, llama_target, name):
    faithful = inspect_path(eagle31_dir, llama_target)
    kind, words = LINTS[name]
    assert not any(words in line for line in faithful["problems"] + faithful["warnings"])
    report = inspect_path(write_sabotaged(eagle31_dir, name, tmp_path / name), llama_target)
    assert any(words in line for line in report[kind]), report[kind]


def test_inspect_lists_every_readers_default(tmp_path, eagle31_dir):
    report = inspect_path(write_sabotaged(eagle31_dir, "absent_norm_output", tmp_path / "a"))
    row = next(r for r in report["engine_defaults"] if r["flag"] == "norm_output")
    assert not row["stated"] and row["runs_here_as"] is False
    readers = row["readers"]
    assert readers["vLLM 0.32"]["value"] is False and readers["SGLang 0.5.23"]["value"] is False
    assert readers["SpecForge before PR #879"]["value"] is True  # the trainer that meant the opposite
    assert all(r["source"] for r in readers.values())


def test_embed_tokens_equal_to_the_targets_are_not_a_problem(tmp_path, llama_info, llama_target):
    from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint

    ckpt = random_drafter(drafter_config_for(llama_info), seed=5)
    table = load_file(next(Path(llama_target).glob("*.safetensors")))["model.embed_tokens.weight"]
    folder = write_drafter(DrafterCheckpoint(ckpt.config, {**ckpt.tensors, "embed_tokens.weight": table}),
                           tmp_path / "d", "specforge")
    report = inspect_path(folder, llama_target)
    assert not any("embed_tokens" in p for p in report["problems"])
    assert any("carries its own embed_tokens" in w for w in inspect_path(folder)["warnings"])  # no target: a warning


def test_fc_norm_weights_without_the_flag_are_refused_by_name(cli, tmp_path, eagle31_dir):
    out = write_sabotaged(eagle31_dir, "fc_norm_unapplied", tmp_path / "u")
    code, _, err = cli("inspect", out)
    assert code == 2 and "fc_norm is off in config.json" in err and "43482" in err
