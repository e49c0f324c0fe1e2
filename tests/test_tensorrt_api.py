"""Every `trt.` name export/engine.py uses exists in the Python binding of every supported TensorRT
release, or is looked up guarded (`getattr(trt.X, "Y", None)` / `hasattr`) where some release lacks it.

The names each release binds are data read from NVIDIA/TensorRT's sources (release/10.0 ... release/11.1,
python/src/infer/pyCore.cpp and its siblings, parsers/pyOnnx.cpp) and, for 11.2, 11.3 and 11.4, which have no
release branch, from the pybind11 module in PyPI's tensorrt-cu12-bindings wheel
(tests/data/read_tensorrt_python_api.py), in tests/data/tensorrt_python_api.json; docs/runtime-capabilities.md
lists them."""

import ast
from pathlib import Path

import pytest

from tensorrt_stand_in import API

ENGINE = Path(__file__).parents[1] / "eagle31_export" / "export" / "engine.py"
RELEASES = API["releases"]


def _chain(node) -> str | None:
    """'BuilderFlag.FP16' for the expression trt.BuilderFlag.FP16; None when it is not rooted at `trt`."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "trt" and parts:
        return ".".join(reversed(parts))
    if isinstance(node, ast.Name) and node.id == "trt":
        return ""
    return None


def trt_names(source: str) -> tuple[set[str], set[str], list[str]]:
    """(names used unguarded, names looked up guarded, problems) in `source`."""
    tree = ast.parse(source)
    unguarded, guarded, problems, inside_lookup = set(), set(), [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            base = _chain(node.args[0]) if node.args else None
            if base is None:
                continue
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                problems.append(f"line {node.lineno}: {node.func.id}(trt{'.' + base if base else ''}, <computed>) "
                                "cannot be checked; name the attribute literally")
                continue
            if not name.value.startswith("__"):
                guarded.add(f"{base}.{name.value}" if base else name.value)
            inside_lookup.add(id(node.args[0]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inside_lookup:
            chain = _chain(node)
            if chain and not isinstance(getattr(node, "parent", None), ast.Attribute):
                unguarded.add(chain)
    # trt.A.B also uses trt.A: keep the longest chains and their prefixes
    unguarded |= {c.rsplit(".", 1)[0] for c in list(unguarded) if "." in c}
    return unguarded, guarded, problems


def check(source: str) -> list[str]:
    unguarded, guarded, problems = trt_names(source)
    for name in sorted(unguarded | guarded):
        if name not in API["names"]:
            problems.append(f"trt.{name} is not in tests/data/tensorrt_python_api.json: add it to "
                            "tests/data/read_tensorrt_python_api.py NAMES and regenerate from NVIDIA/TensorRT")
    for name in sorted(unguarded):
        lacking = [r for r, names in RELEASES.items() if name not in names]
        if lacking and name in API["names"]:
            problems.append(f"trt.{name} is used unguarded but TensorRT {', '.join(lacking)} has no such name")
    for name in sorted(guarded):
        if name in API["names"] and not any(name in names for names in RELEASES.values()):
            problems.append(f"trt.{name} exists in no supported release")
    return problems


def test_engine_uses_only_names_every_release_has_or_guards_them():
    assert check(ENGINE.read_text()) == []


def test_the_recorded_facts_hold_what_engine_py_depends_on():
    """TensorRT 11 removed the precision flags and EXPLICIT_BATCH; every release binds all_creators."""
    assert {"11.0", "11.1", "11.2", "11.3", "11.4"} <= set(RELEASES)
    for release in (r for r in RELEASES if r.startswith("11.")):
        for name in ("BuilderFlag.FP16", "BuilderFlag.BF16", "BuilderFlag.FP8",
                     "NetworkDefinitionCreationFlag.EXPLICIT_BATCH", "IPluginRegistry.plugin_creator_list"):
            assert name not in RELEASES[release]
    assert all("BuilderFlag.FP16" in RELEASES[r] for r in RELEASES if r.startswith("10."))
    assert all("IPluginRegistry.all_creators" in names for names in RELEASES.values())
    assert all("NetworkDefinitionCreationFlag.STRONGLY_TYPED" in names for names in RELEASES.values())


def test_every_release_says_where_its_names_were_read_and_on_what_evidence():
    """A release branch's python/src, or (11.2 - 11.4, no branch published) the binding wheel's pybind11 module,
    where each name rests on a binding call tied to its C++ type, never on a bare string."""
    wheel_releases = API["wheels"]["releases"]
    assert set(API["release_source"]) == set(RELEASES) == set(API["release_evidence"])
    for release, where in API["release_source"].items():
        if release in wheel_releases:
            version = wheel_releases[release]
            assert where.startswith(f"wheel: tensorrt_cu12_bindings-{version}-"), where
            assert "tensorrt_bindings/tensorrt.so" in where
            evidence = API["release_evidence"][release]
            assert set(evidence) == set(RELEASES[release])
            assert set(evidence.values()) <= set(API["evidence_kinds"]) - {"source"}
            for name, kind in evidence.items():  # a member rests on its class, a top-level name on its binding
                assert kind in (("enum_value", "method_self_type") if "." in name else ("class", "module_def"))
        else:
            assert where == f"source: NVIDIA/TensorRT release/{release} python/src"
            assert f"release/{release}" in API["source"]["branches"]
            assert API["release_evidence"][release] == "source"
    assert {"11.2", "11.3", "11.4"} <= set(wheel_releases)


def test_the_wheel_reading_agrees_with_the_sources_wherever_both_exist():
    """Every release read from its branch was also read from its wheel: the same names in NAMES."""
    checked = API["wheel_check"]["releases"]
    assert set(checked) == set(RELEASES) - set(API["wheels"]["releases"])
    for release, result in checked.items():
        assert result["agrees"] and not result["missing_from_wheel_reading"] and not result["wheel_reading_only"]
        assert result["wheel"].startswith("tensorrt_cu12_bindings-" + release + ".")
    # why a bare `strings` match would not do: TensorRT 11's DataType.BF16 is no BuilderFlag.BF16
    assert "BuilderFlag.BF16" in checked["11.1"]["bare_strings_would_add"]


@pytest.mark.parametrize("snippet,found", [
    ("config.set_flag(trt.BuilderFlag.FP16)",
     "trt.BuilderFlag.FP16 is used unguarded but TensorRT 11.0, 11.1, 11.2, 11.3, 11.4 has no such name"),
    ("config.set_flag(getattr(trt.BuilderFlag, flag))", "cannot be checked"),
    ("flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)", "has no such name"),
    ("trt.Refitter(engine, logger)", "trt.Refitter is not in"),
    ("f = getattr(trt.BuilderFlag, 'FP16', None)", None),
    ("if hasattr(trt, 'Builder'):\n    pass", None),
])
def test_the_check_finds_unguarded_and_unchecked_names(snippet, found):
    problems = check(snippet)
    if found is None:
        assert problems == []
    else:
        assert any(found in p for p in problems), problems
