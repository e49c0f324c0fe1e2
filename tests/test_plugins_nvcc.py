"""The GPU-side sources compile: CUDA kernels with nvcc for Hopper and Blackwell, and the TensorRT
IPluginV3 wrappers against TensorRT's headers (when TENSORRT_ROOT points at them).

Nothing here needs a GPU. Running the kernels is benchmarks/plugins_gpu_check.py's job.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from eagle31_export.kernels import build_plugins, find_nvcc, plugin_source_dir

PLUGINS = plugin_source_dir()
ARCHS = ("90", "100")
NVCC = find_nvcc()
TENSORRT_ROOT = os.environ.get("TENSORRT_ROOT")


def _cuda_include_dir() -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        candidates.insert(0, str(Path(NVCC).resolve().parent.parent))
    for root in filter(None, candidates):
        if (Path(root) / "include" / "cuda_runtime_api.h").is_file():
            return Path(root) / "include"
    return None


def _nvcc_compile(source: Path, out_dir: Path) -> subprocess.CompletedProcess:
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "-I", str(PLUGINS / "include"), "-Xptxas", "-v",
           *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS], str(source), "-o", str(out_dir / f"{source.stem}.o")]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit not installed)")
def test_cuda_kernels_compile_for_sm90_and_sm100(tmp_path):
    sources = sorted((PLUGINS / "src" / "cuda").glob("*.cu"))
    assert {s.name for s in sources} == {"fc_norm.cu", "post_norm_feedback.cu"}
    with ThreadPoolExecutor(len(sources)) as pool:
        results = list(pool.map(lambda s: _nvcc_compile(s, tmp_path), sources))
    for source, proc in zip(sources, results):
        assert proc.returncode == 0, f"{source.name}:\n{proc.stderr[-4000:]}"
        assert (tmp_path / f"{source.stem}.o").stat().st_size > 0
        log = proc.stdout + proc.stderr
        # Every kernel was generated for both architectures ...
        for arch in ARCHS:
            assert f"for 'sm_{arch}'" in log, f"{source.name}: no sm_{arch} code"
        # ... without register spills (a spill in the GEMM main loop would cost bandwidth) ...
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills and all(int(n) == 0 for n in spills), f"{source.name} spills registers"
        # ... and within the 48 KB of static shared memory the launches assume.
        smem = [int(n) for n in re.findall(r"(\d+) bytes smem", log)]
        assert smem and max(smem) <= 48 * 1024


@pytest.mark.skipif(TENSORRT_ROOT is None, reason="TENSORRT_ROOT not set: no TensorRT headers to compile the plugin wrappers against")
def test_tensorrt_wrappers_compile_with_cmake(tmp_path):
    result = build_plugins(tmp_path, cuda=False, tensorrt_root=Path(TENSORRT_ROOT), tensorrt_compile_only=True)
    assert result.parts["tensorrt"].startswith("compiled"), result.parts
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", result.tensorrt_version)
    objects = list(tmp_path.rglob("*plugin*.cpp.o"))
    assert len(objects) >= 3


@pytest.mark.skipif(TENSORRT_ROOT is None, reason="TENSORRT_ROOT not set: no TensorRT headers to compile the plugin wrappers against")
def test_tensorrt_wrappers_pass_the_host_smoke_test(tmp_path):
    """Creators, fields, dtype rules, shape checks and serialization, with stub kernels (no GPU)."""
    cuda_include = _cuda_include_dir()
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cuda_include is None or compiler is None:
        pytest.skip("needs the CUDA toolkit headers (cuda_runtime_api.h) and a C++ compiler")
    trt_include = Path(TENSORRT_ROOT) / "include"
    exe = tmp_path / "plugin_smoke"
    cmd = [compiler, "-std=c++17", "-O1", "-isystem", str(trt_include), "-isystem", str(cuda_include),
           "-I", str(PLUGINS / "include"), *map(str, sorted((PLUGINS / "src" / "tensorrt").glob("*.cpp"))),
           str(PLUGINS / "tests" / "plugin_smoke.cpp"), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and "plugin smoke test: OK" in run.stdout, run.stdout + run.stderr
