"""Parity with the PyTorch runtime over exported drafter checkpoints: a faithful export passes,
each classic export bug fails with exit code 1 and a report naming its symptom."""

import json

import pytest

from eagle31_export.formats.drafter.checkpoint import write_drafter

from sabotage import drop_fc_norm, pre_norm_feedback, shift_aux_ids


PROMPTS = ['{"prompt_ids": [5, 17, 33, 2]}', '{"prompt_ids": [200, 3, 77, 41, 9, 9, 120, 64]}',
           '{"prompt_ids": [8]}']


def _parity(cli, bundle, drafter, target, out):
    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return cli("parity", bundle, "--drafter", drafter, "--target", target, "--runtime", "reference",
               "--depth", "4", "--max-new-tokens", "10", "--prompts", prompts, "--out", out)


def test_faithful_export_passes_in_every_format(cli, tmp_path, eagle31_dir, eagle31_ckpt, llama_target):
    for fmt in ("eagle", "speculators", "modelopt"):
        bundle = write_drafter(eagle31_ckpt, tmp_path / fmt, fmt)
        code, out, _ = _parity(cli, bundle, eagle31_dir, llama_target, tmp_path / f"report-{fmt}")
        report = json.loads((tmp_path / f"report-{fmt}" / "report.json").read_text())
        assert code == 0 and report["passed"], report["failures"]
        assert all(r["drafts_identical"] for r in report["prompts"])
    for png in ("acceptance_by_position.png", "tau_per_prompt.png", "tau_vs_context.png"):
        assert (tmp_path / "report-eagle" / png).stat().st_size > 1000
    assert "PASS" in (tmp_path / "report-eagle" / "report.md").read_text()


@pytest.mark.parametrize("bug,symptom", [
    ("shifted_ids", "first-step draft logits differ"),
    ("pre_norm", "later drafts differ: fed-back state (pre- vs post-norm feedback"),
    ("no_fc_norm", "first-step draft logits differ"),
])
def test_each_broken_export_is_caught(cli, tmp_path, eagle31_dir, eagle31_ckpt, llama_target, bug, symptom):
    broken = {"shifted_ids": lambda c: shift_aux_ids(c, 8), "pre_norm": pre_norm_feedback,
              "no_fc_norm": drop_fc_norm}[bug](eagle31_ckpt)
    bundle = write_drafter(broken, tmp_path / "broken", "specforge")
    code, out, _ = _parity(cli, bundle, eagle31_dir, llama_target, tmp_path / "report")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert code == 1 and report["passed"] is False
    assert any(symptom in f for f in report["failures"]), report["failures"]
    assert "FAIL" in (tmp_path / "report" / "report.md").read_text()


def test_parity_bad_input_is_exit_2(cli, tmp_path, eagle31_dir, llama_target):
    code, _, err = cli("parity", "--drafter", eagle31_dir, "--target", llama_target, "--runtime", "tensorrt")
    assert code == 2 and "unknown --runtime" in err
    code, _, err = cli("parity", "--runtime", "reference")
    assert code == 2 and "--drafter D --target T" in err
    (tmp_path / "p.jsonl").write_text("{not json\n")
    code, _, err = cli("parity", "--drafter", eagle31_dir, "--target", llama_target, "--runtime", "reference",
                       "--prompts", tmp_path / "p.jsonl")
    assert code == 2 and "p.jsonl:1: not JSON" in err
