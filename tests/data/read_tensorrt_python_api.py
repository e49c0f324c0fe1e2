"""Which TensorRT Python names each release's binding defines, read from NVIDIA/TensorRT's sources.

    python tests/data/read_tensorrt_python_api.py TENSORRT_GIT_DIR > tests/data/tensorrt_python_api.json

TENSORRT_GIT_DIR is a clone (or bare mirror) of github.com/NVIDIA/TensorRT with its `release/X.Y`
branches. For every release in RELEASES the pybind11 sources (`python/src/infer/*.cpp`,
`python/src/parsers/pyOnnx.cpp`) are read at that branch with `git show`, and every
`py::class_` / `py::enum_` scope and its `.def`, `.def_property*`, `.def_readwrite` and `.value`
members are collected; module-level `m.def(...)` functions are top-level names. Only the names in
NAMES (what `eagle31_export/export/engine.py` uses, and the alternatives it guards) are written, so
the committed file stays small. Run it again when engine.py uses a new name or a release is added.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

RELEASES = ("10.0", "10.1", "10.2", "10.3", "10.4", "10.5", "10.6", "10.7", "10.8", "10.9", "10.10", "10.11",
            "10.12", "10.13", "10.14", "10.15", "10.16", "11.0", "11.1")
FILES = ("python/src/infer/pyCore.cpp", "python/src/infer/pyPlugin.cpp", "python/src/infer/pyGraph.cpp",
         "python/src/infer/pyFoundationalTypes.cpp", "python/src/parsers/pyOnnx.cpp")
# Python classes that inherit members from a bound base (pybind11 class_<Derived, Base>).
BASES = {"Logger": ("ILogger",)}
NAMES = (
    "Logger", "Logger.WARNING", "Builder", "OnnxParser", "init_libnvinfer_plugins", "get_plugin_registry",
    "BuilderFlag", "MemoryPoolType", "NetworkDefinitionCreationFlag",
    "NetworkDefinitionCreationFlag.EXPLICIT_BATCH", "NetworkDefinitionCreationFlag.STRONGLY_TYPED",
    "BuilderFlag.FP16", "BuilderFlag.BF16", "BuilderFlag.FP8", "BuilderFlag.FP4", "MemoryPoolType.WORKSPACE",
    "Builder.create_network", "Builder.create_builder_config", "Builder.create_optimization_profile",
    "Builder.build_serialized_network",
    "INetworkDefinition.num_inputs", "INetworkDefinition.get_input", "ITensor.name", "ITensor.shape",
    "IBuilderConfig.set_memory_pool_limit", "IBuilderConfig.set_flag", "IBuilderConfig.add_optimization_profile",
    "IOptimizationProfile.set_shape",
    "OnnxParser.parse_from_file", "OnnxParser.num_errors", "OnnxParser.get_error",
    "IPluginRegistry.load_library", "IPluginRegistry.all_creators", "IPluginRegistry.plugin_creator_list",
)

_SCOPE = re.compile(r'py::(?:class_|enum_)<[^;]*?>\s*(?:\w+\s*)?[({]\s*(\w+)\s*,\s*"(\w+)"', re.S)
_MEMBER = re.compile(r'\.(?:def|def_property|def_property_readonly|def_readwrite|def_readonly|value|def_static)'
                     r'\(\s*"(\w+)"')
_MODULE_DEF = re.compile(r'\bm\.def\(\s*"(\w+)"')
_LATER_DEF = re.compile(r'\b(\w+)\.def\(\s*"(\w+)"')  # baseLoggerBinding.def("log", ...)


def scopes(source: str) -> dict[str, set[str]]:
    """scope name -> members; '' holds module-level functions and classes."""
    found: dict[str, set[str]] = {"": set()}
    variables: dict[str, str] = {}
    marks = [(m.start(), m.group(2), m.group(1)) for m in _SCOPE.finditer(source)]
    for i, (start, name, parent) in enumerate(marks):
        end = marks[i + 1][0] if i + 1 < len(marks) else len(source)
        body = source[start:end]
        members = found.setdefault(name, set())
        members.update(_MEMBER.findall(body))
        if parent == "m":
            found[""].add(name)
        else:  # an enum nested in a class: with export_values its members are the class's too
            owner = variables.get(parent, parent)
            if "export_values" in body:
                found.setdefault(owner, set()).update(members)
        var = re.match(r'py::class_<[^;]*?>\s*(\w+)\s*[({]', body)
        if var:
            variables[var.group(1)] = name
    found[""].update(_MODULE_DEF.findall(source))
    for var, member in _LATER_DEF.findall(source):
        if var in variables:
            found.setdefault(variables[var], set()).add(member)
    return found


def release_names(git_dir: str, release: str) -> list[str]:
    merged: dict[str, set[str]] = {}
    for path in FILES:
        shown = subprocess.run(["git", "--git-dir", git_dir, "show", f"release/{release}:{path}"],
                               capture_output=True, text=True)
        if shown.returncode:
            continue
        for scope, members in scopes(shown.stdout).items():
            merged.setdefault(scope, set()).update(members)
    for derived, bases in BASES.items():
        for base in bases:
            merged.setdefault(derived, set()).update(merged.get(base, set()))

    def present(name: str) -> bool:
        scope, _, member = name.rpartition(".")
        return member in merged.get(scope, set())

    return [n for n in NAMES if present(n)]


def main(git_dir: str) -> None:
    record = {
        "about": "TensorRT Python names used by eagle31_export/export/engine.py, per release, as bound in "
                 "NVIDIA/TensorRT python/src (see tests/data/read_tensorrt_python_api.py, docs/runtime-capabilities.md)",
        "source": {"repository": "NVIDIA/TensorRT", "branches": [f"release/{r}" for r in RELEASES],
                   "files": list(FILES)},
        "names": list(NAMES),
        "releases": {},
    }
    for release in RELEASES:
        record["releases"][release] = release_names(git_dir, release)
    json.dump(record, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
