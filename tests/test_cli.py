"""The CLI's JSON contracts and its one-line errors (exit code 2, no traceback without --debug)."""

import json
import subprocess
import sys

import pytest

from eagle31_export.formats.drafter.checkpoint import write_drafter
from eagle31_export.reference.pair import load_pair
from factories import greedy_decode


def test_inspect_json_contract(cli, eagle31_dir, llama_target):
    code, out, _ = cli("inspect", eagle31_dir, "--target", llama_target, "--json")
    report = json.loads(out)
    assert code == 0
    assert report["kind"] == "drafter" and report["format"] == "specforge" and report["eagle_version"] == "3.1"
    assert report["config"]["aux_layer_ids"] == [1, 3, 4]  # output-of-layer numbering, resolved for N=8
    assert report["tapped_layers"]["before_layer"] == [2, 4, 5]
    assert report["config"]["fc_norm"] is True and report["config"]["norm_output"] is True
    assert report["problems"] == []


def test_inspect_eagle3_without_target(cli, eagle3_dir):
    code, out, _ = cli("inspect", eagle3_dir, "--json")
    report = json.loads(out)
    assert code == 0 and report["format"] == "eagle" and report["eagle_version"] == "3"
    assert report["config"]["aux_layer_ids"] == [1, 3, 4]  # stored before-layer [2, 4, 5], read as outputs of layers


def test_inspect_reports_incompatibility_and_exits_1(cli, tmp_path, eagle31_ckpt, llama_target):
    bad = eagle31_ckpt.config.replace(aux_layer_ids=(1, 3, 12))
    from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint

    folder = write_drafter(DrafterCheckpoint(bad, eagle31_ckpt.tensors), tmp_path / "bad", "modelopt")
    code, out, _ = cli("inspect", folder, "--target", llama_target, "--json")
    assert code == 1
    assert any("[12]" in p and "out of range" in p for p in json.loads(out)["problems"])


def test_speculate_json_contract(cli, eagle31_dir, llama_target):
    code, out, _ = cli("speculate", "--drafter", eagle31_dir, "--target", llama_target,
                       "--prompt-ids", "5,6,7", "--max-new-tokens", "12", "--depth", "3", "--json")
    assert code == 0
    result = json.loads(out)
    pair = load_pair(eagle31_dir, llama_target)
    assert result["tokens"] == greedy_decode(pair.target, [5, 6, 7], 12)
    assert len(result["drafts"]) == len(result["accepted_per_step"])
    assert all(len(d) == 3 for d in result["drafts"])
    assert result["acceptance_length"] == pytest.approx(1 + sum(result["accepted_per_step"]) / len(result["drafts"]))


@pytest.mark.parametrize("args,message", [
    (["speculate", "--drafter", "{d}", "--target", "{t}", "--prompt-ids", "1,x"], "expected comma-separated integers"),
    (["speculate", "--drafter", "{d}", "--target", "{t}"], "exactly one of --prompt"),
    (["speculate", "--drafter", "{d}", "--target", "{t}", "--prompt", "hello"], "no tokenizer"),
    (["speculate", "--drafter", "{t}", "--target", "{t}", "--prompt-ids", "1"], "cannot tell the drafter format"),
    (["inspect", "{missing}"], "no config.json"),
    (["speculate", "--drafter", "{d}", "--target", "{t}", "--prompt-ids", "1", "--dtype", "fp7"], "unknown dtype"),
])
def test_bad_input_is_one_line_and_exit_2(cli, tmp_path, eagle31_dir, llama_target, args, message):
    args = [a.format(d=eagle31_dir, t=llama_target, missing=tmp_path / "nope") for a in args]
    code, _, err = cli(*args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_console_script_error_has_no_traceback_unless_debug(tmp_path):
    exe = [sys.executable, "-m", "eagle31_export.cli.main"]
    plain = subprocess.run([*exe, "inspect", str(tmp_path)], capture_output=True, text=True)
    assert plain.returncode == 2 and plain.stderr.startswith("error: ") and "Traceback" not in plain.stderr
    debug = subprocess.run([*exe, "--debug", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_speculate_with_plugin_kernels_agrees_with_torch(cli, eagle31_dir, llama_target):
    args = ["speculate", "--drafter", eagle31_dir, "--target", llama_target, "--prompt-ids", "9,8,7,6",
            "--max-new-tokens", "10", "--depth", "3", "--json"]
    code_t, out_t, _ = cli(*args, "--kernels", "torch")
    code_p, out_p, err = cli(*args, "--kernels", "plugins")
    assert code_t == code_p == 0, err
    torch_run, plugin_run = json.loads(out_t), json.loads(out_p)
    assert plugin_run["tokens"] == torch_run["tokens"] and plugin_run["drafts"] == torch_run["drafts"]
