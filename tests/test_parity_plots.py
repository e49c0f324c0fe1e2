"""The parity report's per-depth plot reads like its table: the fed-back RMS relative to the reference
at depth 1 (as `diagnose` draws it), on a linear axis without matplotlib's hidden offset."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib
import pytest

matplotlib.use("Agg")

from eagle31_export.parity.report import per_depth_figure  # noqa: E402


def report(runtime_rms):
    return SimpleNamespace(depth=3, runtime="onnxruntime", per_depth={
        "reference": {"agreement": [0.9, 0.7, 0.5], "fed_back_rms": [1.082, 1.081, 1.081]},
        "runtime": {"agreement": [0.9, 0.6, 0.4], "fed_back_rms": runtime_rms}})


def drawn(fig):
    fig.canvas.draw()
    right = fig.axes[1]
    return right, [list(line.get_ydata()) for line in right.lines[:2]]


def test_a_flat_rms_column_is_a_flat_line_with_no_offset():
    right, (ref, run) = drawn(per_depth_figure(report([1.082, 1.081, 1.0811])))
    assert right.yaxis.get_major_formatter().get_offset() == ""  # no offset subtracted from the ticks
    assert ref == pytest.approx([1.0, 1.081 / 1.082, 1.081 / 1.082])
    assert run == pytest.approx([1.0, 1.081 / 1.082, 1.0811 / 1.082])
    low, high = right.get_ylim()
    assert low <= 0.9 and high >= 1.2  # 0.1% of drift does not fill the axis
    assert "relative to the reference at depth 1" in right.get_ylabel()


def test_a_runtime_feeding_back_another_state_stands_apart():
    right, (ref, run) = drawn(per_depth_figure(report([2.164, 3.0, 4.0])))
    assert run == pytest.approx([2.0, 3.0 / 1.082, 4.0 / 1.082]) and ref[0] == 1.0
    assert right.get_ylim()[1] >= max(run)
