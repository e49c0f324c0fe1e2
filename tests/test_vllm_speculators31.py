"""speculators' own EAGLE 3.1 (norm_before_fc + norm_output) on a real vLLM engine (its CPU build, as in
tests/test_vllm_engine.py, whose helpers and vLLM fixture this file shares): the layout most freshly trained
speculators drafters have, saved by speculators 0.9.0's own classes, inspected, exported and compared."""

from __future__ import annotations

import json

import pytest

from eagle31_export.config import SPECULATORS_31
from eagle31_export.formats.outputs import write_manifest
from eagle31_export.inspection import inspect_path
from eagle31_export.parity.symptoms import POSITION_1
from required import required
from test_vllm_engine import DRAFTER31, TARGET, TINY, assert_exact_pass, bundle_of, parity, vllm  # noqa: F401

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def speculators31(tmp_path_factory):
    """The tiny pair's trained EAGLE 3.1 drafter recast as speculators' 3.1, saved by speculators' classes."""
    try:
        import speculators.models.eagle3  # noqa: F401  (installed in the project environment: Makefile)
    except ImportError as err:
        required(f"speculators is not installed here ({err})")
    from speculators_trained import write_speculators_31

    return write_speculators_31(TINY, DRAFTER31, TARGET, tmp_path_factory.mktemp("speculators31") / "drafter")


# its own engines: the test edits the exported bundle itself and serves each state of it locally
def test_speculators_31_runs_exactly_on_vllm_and_fails_without_norm_before_fc(vllm, tmp_path, speculators31):
    """inspect names the layout; `export vllm` keeps norm_before_fc (and its one norm over fc's input); vLLM
    runs it exactly like the reference. The same bundle with norm_before_fc dropped (flag and weight, as a
    converter that does not know the key writes it) runs without a word in vLLM and fails parity at the
    first draft step, naming fc's input norms."""
    from sabotage import edit_safetensors

    report = inspect_path(speculators31, TARGET)
    assert report["format"] == "speculators" and report["eagle_variant"] == SPECULATORS_31, report["eagle_variant"]
    assert report["problems"] == [] and report["tapped_layers"]["output_of_layer"] == [1, 3, 4]
    bundle = bundle_of(tmp_path, speculators31)
    config_path = bundle / "drafter" / "config.json"
    config = json.loads(config_path.read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert (config["norm_before_fc"], config["norm_output"], config["fc_norm"]) == (True, True, False)
    assert_exact_pass(parity(vllm, bundle, speculators31))

    config["norm_before_fc"] = False
    config_path.write_text(json.dumps(config))
    edit_safetensors(bundle / "drafter", lambda tensors: tensors.pop("input_norm.weight"))
    write_manifest(bundle, references={"target": str(TARGET)})
    broken = parity(vllm, bundle, speculators31)
    assert not broken.passed
    assert all(r.tokens_identical for r in broken.rows)  # lossless: only acceptance shows it
    symptoms = [r.symptom for r in broken.rows if not r.accepted_identical]
    assert symptoms and any(POSITION_1 in s for s in symptoms), symptoms
    assert "norm_before_fc" in POSITION_1 and any("norm_before_fc" in f for f in broken.failures), broken.failures
