"""What the whole suite needs: under `make test` (EAGLE31_REQUIRE_VLLM=1) a missing piece fails the test, elsewhere
it skips it (a checkout without the real pair's target, `make smollm2-target`, or without vLLM)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REAL_PAIR_TARGET = Path(__file__).resolve().parents[1] / "examples" / "smollm2" / "models" / "target"


def required(what: str) -> None:
    """Missing here: a failure under the suite's EAGLE31_REQUIRE_VLLM=1 (`make test` builds it), else a skip."""
    if os.environ.get("EAGLE31_REQUIRE_VLLM") == "1":
        pytest.fail(f"required here (EAGLE31_REQUIRE_VLLM=1): {what}")
    pytest.skip(what)


def require_real_pair() -> None:
    if not (REAL_PAIR_TARGET / "config.json").is_file():
        required("the real pair's target is made by `make smollm2-target` (make test does)")
