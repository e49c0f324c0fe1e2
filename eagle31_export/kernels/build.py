"""Building the plugin libraries with CMake (the sources live in the repository's `plugins/`).

`build_plugins` configures and builds everything the machine allows and reports, part by part,
what was built and why anything was skipped. `ensure_cpu_library` is the cheap path the torch
ops and the tests use: it builds only the CPU library, and only when the sources changed.
Missing tools raise `MissingRuntimeError` with one line saying what to install.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eagle31_export.errors import MissingRuntimeError, UserError

SOURCES_ENV = "EAGLE31_PLUGINS_SRC"
BUILD_DIR_ENV = "EAGLE31_PLUGIN_BUILD_DIR"

CPU_LIBRARY = "libeagle31_kernels_cpu.so"
CUDA_LIBRARY = "libeagle31_kernels_cuda.so"
PLUGIN_LIBRARY = "libeagle31_plugins.so"
_STAMP = "eagle31_cpu_sources.sha256"  # the sources the CPU library was last built from
_INFO = "eagle31_build_info.json"
_LOG = "eagle31_build.log"


@dataclass(frozen=True)
class BuildResult:
    """What one build produced: a status line per part ("built", "skipped: why", ...)."""

    build_dir: Path
    parts: dict[str, str]
    tensorrt_version: str = ""
    libraries: dict[str, Path] = field(default_factory=dict)

    @property
    def cpu_library(self) -> Path | None:
        return self.libraries.get("cpu")

    @property
    def cuda_library(self) -> Path | None:
        return self.libraries.get("cuda")

    @property
    def plugin_library(self) -> Path | None:
        return self.libraries.get("tensorrt")


def plugin_source_dir() -> Path:
    """The `plugins/` folder: next to the package in a checkout, or where EAGLE31_PLUGINS_SRC says."""
    candidates = [os.environ.get(SOURCES_ENV), Path(__file__).resolve().parents[2] / "plugins"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "CMakeLists.txt").is_file():
            return Path(candidate)
    raise UserError(
        f"plugin sources not found: set {SOURCES_ENV} to the repository's plugins/ folder "
        "(it is not part of an installed wheel)"
    )


def default_build_dir() -> Path:
    """EAGLE31_PLUGIN_BUILD_DIR, else plugins/build in a writable checkout, else the user cache."""
    if os.environ.get(BUILD_DIR_ENV):
        return Path(os.environ[BUILD_DIR_ENV])
    source = plugin_source_dir()
    if os.access(source, os.W_OK):
        return source / "build"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "eagle31-export" / f"plugins-{sources_digest(source)[:12]}"


def sources_digest(source: Path | None = None) -> str:
    """sha256 over every file the build reads, so a stale library is never reused."""
    source = source or plugin_source_dir()
    digest = hashlib.sha256()
    files = [source / "CMakeLists.txt", *sorted((source / "include").rglob("*")), *sorted((source / "src").rglob("*"))]
    for path in files:
        if path.is_file():
            digest.update(path.relative_to(source).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def find_cmake() -> str:
    """cmake on PATH, else the one the `cmake` wheel put next to this interpreter."""
    beside_python = Path(sys.executable).parent / "cmake"
    cmake = shutil.which("cmake") or (str(beside_python) if beside_python.is_file() else None)
    if cmake is None:
        raise MissingRuntimeError("cmake not found: install CMake >= 3.18 (e.g. `pip install cmake` or apt-get install cmake)")
    return cmake


def find_cxx_compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise MissingRuntimeError("no C++ compiler found: install g++ or clang++ (or set CXX)")


def find_nvcc() -> str | None:
    """nvcc from CUDACXX, PATH, CUDA_HOME or the default toolkit location; None when absent."""
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(str(Path(home) / "bin" / "nvcc"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _check_tensorrt_root(root: Path) -> None:
    if not any((root / sub / "NvInferRuntime.h").is_file() for sub in ("include", ".")):
        raise UserError(f"TensorRT headers not found under {root} (expected {root}/include/NvInferRuntime.h)")


def _run(cmd: list[str], log: Path, what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise UserError(f"{what} failed: {_first_error(proc.stdout + proc.stderr)} (full log: {log})")


def _first_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def configure(
    build_dir: Path,
    *,
    cuda: bool | None = None,
    tensorrt_root: Path | None = None,
    tensorrt_compile_only: bool = False,
) -> None:
    """Run CMake's configure step. `cuda`: True requires nvcc, False skips, None builds if found."""
    cmake = find_cmake()
    find_cxx_compiler()
    nvcc = find_nvcc()
    if cuda and nvcc is None:
        raise MissingRuntimeError("nvcc not found: install the CUDA toolkit or put nvcc on PATH (or build with --no-cuda)")
    if tensorrt_root is not None:
        _check_tensorrt_root(Path(tensorrt_root))
    build_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        cmake, "-S", str(plugin_source_dir()), "-B", str(build_dir),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DEAGLE31_CUDA={'OFF' if cuda is False else ('ON' if cuda else 'AUTO')}",
        f"-DTENSORRT_ROOT={Path(tensorrt_root).resolve() if tensorrt_root else ''}",
        f"-DEAGLE31_TRT_COMPILE_ONLY={'ON' if tensorrt_compile_only else 'OFF'}",
    ]
    if nvcc and cuda is not False:
        cmd.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    (build_dir / _LOG).write_text("")
    _run(cmd, build_dir / _LOG, "CMake configure")


def build_plugins(
    build_dir: Path | None = None,
    *,
    cuda: bool | None = None,
    tensorrt_root: Path | None = None,
    tensorrt_compile_only: bool = False,
    jobs: int | None = None,
) -> BuildResult:
    """Configure and build every part; returns what was built and why anything was skipped."""
    build_dir = Path(build_dir or default_build_dir())
    configure(build_dir, cuda=cuda, tensorrt_root=tensorrt_root, tensorrt_compile_only=tensorrt_compile_only)
    _run([find_cmake(), "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 2)], build_dir / _LOG, "build")
    (build_dir / _STAMP).write_text(sources_digest())
    return read_build_result(build_dir)


def read_build_result(build_dir: Path) -> BuildResult:
    info = json.loads((build_dir / _INFO).read_text())
    parts = {name: info[name] for name in ("cpu", "cuda", "tensorrt")}
    libraries = {}
    for part, name in (("cpu", CPU_LIBRARY), ("cuda", CUDA_LIBRARY), ("tensorrt", PLUGIN_LIBRARY)):
        path = build_dir / "lib" / name
        if parts[part] == "built":
            if not path.is_file():
                raise UserError(f"the build reported {part} built but {path} is missing (see {build_dir / _LOG})")
            libraries[part] = path
    return BuildResult(build_dir, parts, info.get("tensorrt_version", ""), libraries)


def ensure_cpu_library(build_dir: Path | None = None) -> Path:
    """Path of an up-to-date CPU kernel library, building (only that target) when needed."""
    build_dir = Path(build_dir or default_build_dir())
    library = build_dir / "lib" / CPU_LIBRARY
    stamp = build_dir / _STAMP
    digest = sources_digest()
    if library.is_file() and stamp.is_file() and stamp.read_text() == digest:
        return library
    if not (build_dir / "CMakeCache.txt").is_file():
        configure(build_dir, cuda=False)
    _run([find_cmake(), "--build", str(build_dir), "--target", "eagle31_kernels_cpu", "-j", str(os.cpu_count() or 2)],
         build_dir / _LOG, "build of the CPU kernels")
    if not library.is_file():
        raise UserError(f"the CPU kernel build produced no {library} (see {build_dir / _LOG})")
    stamp.write_text(digest)
    return library
