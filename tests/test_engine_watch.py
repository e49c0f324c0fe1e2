"""The suite's own guard: a test outside the `engine` marker that starts an engine fails
(tests/engine_watch.py), so `make test-quick` provably starts none."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from engine_watch import engine_kind

HERE = Path(__file__).resolve().parent

INNER = textwrap.dedent('''
    import shutil, subprocess, time
    import pytest

    def _engine(tmp_path):
        # `sleep` under an engine's name: the guard reads command lines only
        fake = shutil.copy(shutil.which("sleep"), tmp_path / "tritonserver")
        subprocess.run([str(fake), "4"], check=True)  # 4 s: seen by a watch polling every 0.25 s, even under load

    def test_unmarked_starts_one(tmp_path):
        _engine(tmp_path)

    @pytest.mark.engine
    def test_marked_starts_one(tmp_path):
        _engine(tmp_path)

    def test_starts_none():
        time.sleep(0.5)
''')


def test_a_test_outside_the_engine_marker_that_starts_an_engine_fails(tmp_path):
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
                                          "pytest_plugins = ['engine_watch']\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    engine: starts an engine\n")
    (tmp_path / "test_inner.py").write_text(INNER)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ""})
    out = done.stdout
    assert done.returncode == 1, out
    assert "3 passed, 1 error" in out, out  # the guard fails the test at its teardown
    assert "test_unmarked_starts_one" in out and "is not marked `engine`" in out, out
    assert "engines started: 2 (vLLM 0, Triton 2)" in out, out


def test_engine_command_lines_are_recognised():
    assert engine_kind(["/x/.venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--port", "1"]) == "vllm"
    assert engine_kind(["/usr/bin/vllm", "serve", "m"]) == "vllm"
    assert engine_kind(["/opt/tritonserver/bin/tritonserver", "--model-repository", "r"]) == "triton"
    assert engine_kind(["/x/python", "-m", "pytest", "tests/test_vllm_engine.py"]) is None
    assert engine_kind(["/x/python", "-c", "import vllm"]) is None
