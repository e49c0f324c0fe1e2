"""What a PASS names as not excluded, per precision and view (parity/blind_spots.py), as
docs/runtimes.md "Measured power" measured it: the counts-only blind spot at FP4 is a server whose
drafts are not known, not a runtime (or a local vLLM engine with our plugin) that reports them."""

from eagle31_export.parity.blind_spots import (
    COUNTS_AT_FP4, INPUT_SCALE, INPUT_SCALE_FP32, SMALL_SYSTEMATIC, blind_spots,
)


def test_fp32_names_only_the_input_scale_with_fp4_activations():
    assert blind_spots(True, False, False) == []
    assert blind_spots(True, True, False) == blind_spots(True, True, True) == [INPUT_SCALE_FP32]


def test_half_precision_names_the_small_systematic_error():
    assert blind_spots(False, False, True) == blind_spots(False, False, False) == [SMALL_SYSTEMATIC]


def test_counts_only_at_fp4_adds_taps_and_rope_drafts_do_not():
    assert blind_spots(False, True, True) == [SMALL_SYSTEMATIC, INPUT_SCALE]
    assert blind_spots(False, True, False) == [SMALL_SYSTEMATIC, INPUT_SCALE, COUNTS_AT_FP4]
    assert "rope_theta x4" in COUNTS_AT_FP4 and "tapped layers" in COUNTS_AT_FP4
