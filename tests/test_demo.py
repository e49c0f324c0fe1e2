"""The README's main job: `eagle31-export demo` on the embedded tiny pair, end to end."""

import importlib.util
import json
import os

import pytest


# real engines or servers, or minutes: `make test` runs it, `make test-quick` does not
pytestmark = pytest.mark.engine


# its own engines: the demo starts and stops what it runs on (vLLM, Triton) as a user runs it
def test_demo_writes_every_artifact_and_a_passing_parity_report(cli, tmp_path):
    out = tmp_path / "demo"
    code, stdout, err = cli("demo", "--out", out)
    assert code == 0, err
    for folder in ("onnx", "trtllm", "vllm", "sglang", "triton-cpu", "triton-trtllm", "parity"):
        assert (out / folder).is_dir(), folder
    assert json.loads((out / "parity" / "report.json").read_text())["verdict"] == "PASS"
    if os.environ.get("EAGLE31_REQUIRE_VLLM") == "1":  # `make test`: a demo without vLLM is a failure here
        assert os.environ.get("EAGLE31_VLLM"), "EAGLE31_REQUIRE_VLLM=1 but EAGLE31_VLLM names no vLLM environment"
    if os.environ.get("EAGLE31_VLLM"):  # `make test`: the demo also runs parity on a real vLLM engine
        vllm = json.loads((out / "parity-vllm" / "report.json").read_text())
        assert vllm["verdict"] == "PASS" and vllm["runtime"] == "vllm" and vllm["exact_comparison"] is True
        assert "parity, vLLM (a real engine) vs PyTorch reference" in stdout and "PASS" in stdout
    else:
        assert "parity, vLLM vs PyTorch reference: skipped: no vLLM found" in " ".join(stdout.split())
    for png in ("tau_by_depth.png", "parity/acceptance_by_position.png", "parity/tau_vs_context.png",
                "tau_by_context.png"):
        assert (out / png).stat().st_size > 5000, png
    context = json.loads((out / "tau_by_context.json").read_text())
    by_context = context["tau_by_context"]
    assert sorted(by_context) == ["EAGLE 3.1", "EAGLE-3"]
    # the drafters fine-tuned at long context (examples/tiny/models/long), several prompts a length
    assert context["drafters"].startswith("fine-tuned at long context") and context["depth"] == 3
    assert all(len(taus) == context["prompts_per_length"] == 3
               for per_length in context["tau_per_prompt"].values() for taus in per_length.values())
    assert all(sorted(map(int, v)) == [1024, 2048, 4096, 8192] and all(t >= 1 for t in v.values())
               for v in by_context.values())
    assert "tau by context length" in " ".join(stdout.split())
    rows = {(r["target"], r["drafter"]): r for r in json.loads((out / "tau.json").read_text())}
    assert rows[("target", "EAGLE 3.1")]["tau_by_depth"]["3"] >= 2.2
    assert len(rows[("target-nvfp4", "EAGLE-3")]["teacher_forced_agreement"]) == 6
    exports = json.loads((out / "exports.json").read_text())
    if importlib.util.find_spec("tensorrt") is None:  # CPU machines: said, not faked
        assert exports["engines"].startswith("skipped: TensorRT is not installed")
        assert not (out / "engines").exists()
    assert (out / "manifest.json").is_file()
    texts = [p.read_text() for p in out.rglob("*") if p.suffix in (".json", ".yaml", ".md", ".pbtxt")]
    assert not any(".tmp-" in t for t in texts)  # no temporary folder names leak into artifacts
    # built whole beside the final path, then moved there: it matches its manifest and no file names
    # the path it was written under (nor its temporary sibling's)
    from eagle31_export.formats.outputs import verify_output

    assert verify_output(out) == []
    needles = (str(out).encode(), str(out.resolve()).encode(), b"/.demo.tmp-")
    assert [p for p in out.rglob("*")
            if p.is_file() and not p.is_symlink() and any(n in p.read_bytes() for n in needles)] == []
