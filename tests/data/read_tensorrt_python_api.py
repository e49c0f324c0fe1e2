"""Which TensorRT Python names each release's binding defines, read from NVIDIA/TensorRT's sources
where they are published and from the binding wheel where they are not.

    pip download tensorrt-cu12-bindings==11.2.1.2 --no-deps -d WHEEL_DIR   # each of WHEEL_RELEASES, CHECK_WHEELS
    python tests/data/read_tensorrt_python_api.py TENSORRT_GIT_DIR WHEEL_DIR > tests/data/tensorrt_python_api.json
    python tests/data/read_tensorrt_python_api.py --check-wheel-against-sources TENSORRT_GIT_DIR WHEEL_DIR

TENSORRT_GIT_DIR is a clone (or bare mirror) of github.com/NVIDIA/TensorRT with its `release/X.Y`
branches. For every release in RELEASES the pybind11 sources (`python/src/infer/*.cpp`,
`python/src/parsers/pyOnnx.cpp`) are read at that branch with `git show`, and every
`py::class_` / `py::enum_` scope and its `.def`, `.def_property*`, `.def_readwrite` and `.value`
members are collected; module-level `m.def(...)` functions are top-level names.

NVIDIA/TensorRT has no `release/11.2`, `11.3` or `11.4` branch (its newest is `release/11.1`), so
those releases (WHEEL_RELEASES) are read from PyPI's `tensorrt-cu12-bindings` wheel: the compiled
pybind11 module `tensorrt_bindings/tensorrt.so`. It cannot be imported without libnvinfer, so it is
read as an ELF file (`objdump` and `c++filt` from binutils are needed). Its symbol table is kept,
and pybind11's binding calls are visible in the machine code of `bindCore` / `bindGraph` /
`bindPlugin` / `bindOnnx` / `bindFoundationalTypes` and the template functions they call:

- a class or enum: `generic_type::initialize` (or an out-of-line `class_<T>` / `enum_<T>`
  constructor) with the Python name as a string constant and `class_<T>` symbols (T the C++ type);
- an enum value: `enum_<T>::value` / `enum_base::value` called with the name (T from the callee's
  symbol, or the `typeinfo for T` the inlined cast loads);
- a method or property: `add_class_method` / `def_property_static_impl` (or a `class_<...>::def*`
  template) called with the name, after the `cpp_function` it binds was built: pybind11 stores
  that function's argument types in a static `types` array (`cpp_function::initialize<...>::types`)
  whose first entry, for a method, is `typeid` of the class it is bound on;
- a module function: `module_::add_object` called with the name.

A name counts as bound only with that evidence, tying a member to the C++ type SCOPE_TYPES gives
for its Python scope (facts from the sources: `py::class_<IBuilder>(m, "Builder")`, ...). A bare
string in `.rodata` proves little: `BF16`, `FP8` and `FP4` are `DataType` values too, and
`Builder` or `all_creators` are stored as the tails of `IBuilder` and `get_all_creators` (the
linker merges string suffixes), so `strings` would find names a release lacks and miss names it has.
`--check-wheel-against-sources` reads every source release's wheel (CHECK_WHEELS, the build its
`include/NvInferVersion.h` names) both ways; generating the data refuses to write when they differ
for any name in NAMES.

Only the names in NAMES (what `eagle31_export/export/engine.py` uses, and the alternatives it guards)
are written, so the committed file stays small. Run it again when engine.py uses a new name or a
release is added.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

RELEASES = ("10.0", "10.1", "10.2", "10.3", "10.4", "10.5", "10.6", "10.7", "10.8", "10.9", "10.10", "10.11",
            "10.12", "10.13", "10.14", "10.15", "10.16", "11.0", "11.1")
# Releases without a `release/X.Y` branch: the PyPI wheel read instead (11.2 is published only as 11.2.1).
WHEEL_RELEASES = {"11.2": "11.2.1.2", "11.3": "11.3.0.99", "11.4": "11.4.0.106"}
# Each source release's wheel, the version `include/NvInferVersion.h` on its branch names.
CHECK_WHEELS = {"10.0": "10.0.1", "10.1": "10.1.0", "10.2": "10.2.0", "10.3": "10.3.0", "10.4": "10.4.0",
                "10.5": "10.5.0", "10.6": "10.6.0", "10.7": "10.7.0", "10.8": "10.8.0.43", "10.9": "10.9.0.34",
                "10.10": "10.10.0.31", "10.11": "10.11.0.33", "10.12": "10.12.0.36", "10.13": "10.13.0.35",
                "10.14": "10.14.1.48.post1", "10.15": "10.15.1.29", "10.16": "10.16.0.72",
                "11.0": "11.0.0.114", "11.1": "11.1.0.106"}
WHEEL_PACKAGE = "tensorrt-cu12-bindings"
WHEEL_MODULE = "tensorrt_bindings/tensorrt.so"
FILES = ("python/src/infer/pyCore.cpp", "python/src/infer/pyPlugin.cpp", "python/src/infer/pyGraph.cpp",
         "python/src/infer/pyFoundationalTypes.cpp", "python/src/parsers/pyOnnx.cpp")
# Python classes that inherit members from a bound base (pybind11 class_<Derived, Base>).
BASES = {"Logger": ("ILogger",)}
# The C++ types behind each Python scope in NAMES (the first is the one `class_<T>` / `enum_<T>` is
# created with), as the sources bind them: Logger is `class_<DefaultLogger, ILogger>` and its
# WARNING is `enum_<ILogger::Severity>`'s, exported into ILogger; OnnxParser is `class_<IParser>`.
SCOPE_TYPES = {
    "Logger": ("DefaultLogger", "nvinfer1::ILogger", "nvinfer1::ILogger::Severity"),
    "Builder": ("nvinfer1::IBuilder",),
    "OnnxParser": ("nvonnxparser::IParser",),
    "BuilderFlag": ("nvinfer1::BuilderFlag",),
    "MemoryPoolType": ("nvinfer1::MemoryPoolType",),
    "NetworkDefinitionCreationFlag": ("nvinfer1::NetworkDefinitionCreationFlag",),
    "INetworkDefinition": ("nvinfer1::INetworkDefinition",),
    "ITensor": ("nvinfer1::ITensor",),
    "IBuilderConfig": ("nvinfer1::IBuilderConfig",),
    "IOptimizationProfile": ("nvinfer1::IOptimizationProfile",),
    "IPluginRegistry": ("nvinfer1::IPluginRegistry",),
}
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
EVIDENCE = {
    "source": "a py::class_ / py::enum_ scope, or a .def* / .value member of it, or m.def, in the release branch's "
              "python/src",
    "class": "the .so creates a pybind11 class_/enum_ with this Python name for the C++ type SCOPE_TYPES gives",
    "module_def": "the .so passes this name to pybind11 module_::add_object (m.def)",
    "enum_value": "the .so passes this name to pybind11 enum_<T>::value / enum_base::value, T the scope's C++ enum",
    "method_self_type": "the .so passes this name to add_class_method / def_property_static_impl for a cpp_function "
                        "whose pybind11 types array starts with typeid of the scope's C++ class",
}

_SCOPE = re.compile(r'py::(?:class_|enum_)<[^;]*?>\s*(?:\w+\s*)?[({]\s*(\w+)\s*,\s*"(\w+)"', re.S)
_MEMBER = re.compile(r'\.(?:def|def_property|def_property_readonly|def_readwrite|def_readonly|value|def_static)'
                     r'\(\s*"(\w+)"')
_MODULE_DEF = re.compile(r'\bm\.def\(\s*"(\w+)"')
_LATER_DEF = re.compile(r'\b(\w+)\.def\(\s*"(\w+)"')  # baseLoggerBinding.def("log", ...)


# ---------------------------------------------------------------------------------------------------
# The sources


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


def source_scopes(git_dir: str, release: str) -> dict[str, set[str]]:
    """scope -> members bound at `release/<release>` (a derived class has its bases' members)."""
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
    return merged


def release_names(git_dir: str, release: str) -> list[str]:
    merged = source_scopes(git_dir, release)

    def present(name: str) -> bool:
        scope, _, member = name.rpartition(".")
        return member in merged.get(scope, set())

    return [n for n in NAMES if present(n)]


# ---------------------------------------------------------------------------------------------------
# The binding wheel: an x86-64 ELF shared object, read without importing it


class Elf:
    """Sections, symbols and dynamic relocations of a little-endian ELF64 file."""

    def __init__(self, data: bytes):
        if data[:5] != b"\x7fELF\x02":
            raise ValueError("not an ELF64 file")
        self.data = data
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
        self.headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
        names = self.headers[shstrndx][4]
        self.sections = {self._cstr(names + h[0]): h for h in self.headers}
        self.symbols = self._symbols(".symtab")
        self.dynsym = self._symbols(".dynsym")
        self.relocations: dict[int, tuple[int, int, int]] = {}
        if ".rela.dyn" in self.sections:
            h = self.sections[".rela.dyn"]
            for off in range(h[4], h[4] + h[5], 24):
                r_offset, r_info, r_addend = struct.unpack_from("<QQq", data, off)
                self.relocations[r_offset] = (r_info & 0xFFFFFFFF, r_info >> 32, r_addend)

    def _cstr(self, off: int) -> str:
        return self.data[off:self.data.index(b"\0", off)].decode(errors="replace")

    def _symbols(self, section: str) -> list[tuple[str, int]]:
        if section not in self.sections:
            return []
        h = self.sections[section]
        strings = self.headers[h[6]][4]
        out = []
        for off in range(h[4], h[4] + h[5], 24):
            st_name, _info, _other, _shndx, st_value, _size = struct.unpack_from("<IBBHQQ", self.data, off)
            out.append((self._cstr(strings + st_name), st_value))
        return out

    def string_at(self, addr: int) -> str | None:
        """The NUL-terminated string at addr in .rodata (a merged suffix reads as itself)."""
        h = self.sections.get(".rodata")
        if h is None or not h[3] <= addr < h[3] + h[5]:
            return None
        off = h[4] + addr - h[3]
        try:
            return self.data[off:self.data.index(b"\0", off)].decode()
        except UnicodeDecodeError:
            return None

    def pointer_at(self, addr: int) -> int | str | None:
        """What the pointer stored at addr points to once relocated: an address or a dynamic symbol."""
        reloc = self.relocations.get(addr)
        if reloc is None:
            return None
        rtype, sym, addend = reloc
        if rtype == 8:  # R_X86_64_RELATIVE
            return addend
        if rtype in (1, 6):  # R_X86_64_64, R_X86_64_GLOB_DAT
            name, value = self.dynsym[sym]
            return value + addend if value else name
        return None


_CALLER_SAVED = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11")
_REGISTER = {}
for _r in ("ax", "bx", "cx", "dx"):
    for _form in (f"r{_r}", f"e{_r}", _r, f"{_r[0]}l", f"{_r[0]}h"):
        _REGISTER[_form] = f"r{_r}"
for _r in ("si", "di", "bp", "sp"):
    for _form in (f"r{_r}", f"e{_r}", _r, f"{_r}l"):
        _REGISTER[_form] = f"r{_r}"
for _n in range(8, 16):
    for _suffix in ("", "d", "w", "b"):
        _REGISTER[f"r{_n}{_suffix}"] = f"r{_n}"
_PREFIXES = ("notrack", "bnd", "lock", "rep", "repz", "repnz", "repe", "repne", "data16", "cs", "ds")
_NO_WRITE = ("push", "cmp", "test", "bt", "ucomis", "comis")


def disassemble(path: str):
    """Per function of .text: (address, name, items), items in address order: ('ref', addr) for every
    rip-relative operand, ('call', callee address, callee name, {register: address it holds}) for calls
    and tail jumps. A register holds an address from `lea addr(%rip)` (or a copy of it) until it is
    overwritten; a call clobbers the caller-saved ones. What is known flows along straight-line code and
    forward jumps within the function (at a join, what every way in agrees on); after an unconditional
    jump or a return nothing is known until a forward jump's target."""
    proc = subprocess.Popen(["objdump", "-d", "-C", "--no-show-raw-insn", "-j", ".text", path],
                            stdout=subprocess.PIPE, text=True)
    header = re.compile(r"^([0-9a-f]+) <(.*)>:$")
    insn = re.compile(r"^\s+([0-9a-f]+):\s+(.*)$")
    func, items, regs, incoming, falls_through = None, [], {}, {}, True

    def join(a: dict, b: dict) -> dict:
        return {r: v for r, v in a.items() if b.get(r) == v}

    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        m = header.match(line)
        if m:
            if func is not None:
                yield func[0], func[1], items
            func, items, regs, incoming, falls_through = (int(m.group(1), 16), m.group(2)), [], {}, {}, True
            continue
        m = insn.match(line)
        if not m or func is None:
            continue
        here = int(m.group(1), 16)
        if here in incoming:
            regs = join(regs, incoming.pop(here)) if falls_through else incoming.pop(here)
        elif not falls_through:
            regs = {}
        falls_through = True
        parts = m.group(2).split(None, 1)
        while parts and parts[0] in _PREFIXES:
            parts = parts[1].split(None, 1) if len(parts) > 1 else []
        if not parts:
            continue
        op, args = parts[0], (parts[1] if len(parts) > 1 else "")
        operands, _, comment = args.partition("#")
        operands = operands.strip()
        target = re.fullmatch(r"([0-9a-f]+) <(.*)>", operands)
        conditional = op.startswith("j") and not op.startswith("jmp")
        if target and (conditional or op.startswith("jmp") and "+0x" in target.group(2)):
            to = int(target.group(1), 16)
            if to > here:  # a forward jump within the function carries what is known to its target
                incoming[to] = join(incoming[to], regs) if to in incoming else dict(regs)
            if op.startswith("jmp"):
                falls_through = False
            continue
        if op.startswith("call") or op.startswith("jmp") and target:
            if target:
                items.append(("call", int(target.group(1), 16), target.group(2), dict(regs)))
            regs = {r: v for r, v in regs.items() if r not in _CALLER_SAVED}
            falls_through = not op.startswith("jmp")
            continue
        if op.startswith(("jmp", "ret", "ud2", "hlt")):
            falls_through = False
            continue
        address = None
        if "(%rip)" in operands:
            c = re.match(r"\s*([0-9a-f]+)\b", comment)
            address = int(c.group(1), 16) if c else None
        if address is not None:
            items.append(("ref", address))
        dest = operands.rsplit(",", 1)[-1].strip()
        dest_reg = _REGISTER.get(dest[1:]) if dest.startswith("%") else None
        if dest_reg is None or op.startswith(_NO_WRITE):
            continue
        if op.startswith("lea") and address is not None:
            regs[dest_reg] = address
            continue
        src = operands.split(",")[0].strip()
        if op == "mov" and dest[1:] == dest_reg and src[1:] in regs and src[1:] == _REGISTER.get(src[1:]):
            regs[dest_reg] = regs[src[1:]]
            continue
        regs.pop(dest_reg, None)
    if func is not None:
        yield func[0], func[1], items
    if proc.wait():
        raise RuntimeError(f"objdump failed on {path}")


def _normalize(cpp_type: str) -> str:
    """nvinfer1::v_1_0::ILogger -> nvinfer1::ILogger; a class local to bindCore keeps its own name."""
    cpp_type = re.sub(r"\bv_\d+_\d+::|\s*\[clone [^]]*\]", "", cpp_type)
    return re.sub(r"^tensorrt::bind\w+\(pybind11::module_&\)::", "", cpp_type).strip()


def _is(cpp_type: str, wanted: str) -> bool:
    return cpp_type == wanted or cpp_type.endswith("::" + wanted)


_CLASS_TEMPLATE = re.compile(r"pybind11::(?:class_|enum_)<(.*?)(?:, .*)?>::")
_ENUM_VALUE = re.compile(r"pybind11::enum_<(.*?)>::value\(")
_CTOR = re.compile(r"pybind11::(class_|enum_)<(.*?)>::(class_|enum_)<")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_OUTLINED_DEF = re.compile(r"pybind11::(class_<.*>|module_)::def\w*[<(]")  # class_<T>::def<F>(char const*, ...)


def bindings(so_path: str) -> list[tuple[str, str, frozenset[str]]]:
    """What the pybind11 module binds: (kind, Python name, C++ types it is tied to), kind being
    'class', 'module_def', 'enum_value' or 'member'."""
    elf = Elf(Path(so_path).read_bytes())
    types_arrays = {v for n, v in elf.symbols
                    if v and n.startswith("_ZZN8pybind1112cpp_function") and n.endswith("E5types")}
    typeinfo = {v: n for n, v in elf.symbols if v and n.startswith("_ZTI")}
    first_entry = {}
    for addr in types_arrays:  # types[0]: for a method, typeid of the class it is bound on
        target = elf.pointer_at(addr)
        target = typeinfo.get(target) if isinstance(target, int) else target
        if isinstance(target, str) and target.startswith("_ZTI"):
            first_entry[addr] = target
    mangled = sorted(set(typeinfo.values()) | set(first_entry.values()))
    plain = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True,
                           check=True).stdout.split("\n")
    type_of = {m: _normalize(p[len("typeinfo for "):]) for m, p in zip(mangled, plain) if p.startswith("typeinfo for ")}
    self_type = {a: type_of[s] for a, s in first_entry.items() if s in type_of}
    typeinfo_type = {a: type_of[s] for a, s in typeinfo.items() if s in type_of}

    functions = list(disassemble(so_path))
    by_address = {addr: i for i, (addr, _, _) in enumerate(functions)}
    class_symbol = {}  # address of a class_<T>:: / enum_<T>:: function -> T
    for addr, name, _ in functions:
        m = _CLASS_TEMPLATE.match(name)
        if m:
            class_symbol[addr] = _normalize(m.group(1))
    direct = [{a for kind, a, *_ in items if kind == "ref" and a in types_arrays} for _, _, items in functions]
    callees = [{by_address[c[1]] for c in items if c[0] == "call" and c[1] in by_address} for _, _, items in functions]

    memo: dict[tuple[int, int], set[int]] = {}

    def reached(index: int, depth: int = 3) -> set[int]:
        """types arrays a function references, itself or through its callees (a few calls deep)."""
        key = (index, depth)
        if key not in memo:
            memo[key] = set()
            out = set(direct[index])
            if depth:
                for c in callees[index]:
                    out |= reached(c, depth - 1)
            memo[key] = out
        return memo[key]

    found: list[tuple[str, str, frozenset[str]]] = []
    for _, fname, items in functions:
        enclosing_enum = _ENUM_VALUE.match(fname)
        strings: list[str] = []
        types: set[int] = set()
        infos: set[str] = set()
        classes: set[str] = set()

        def since_last() -> None:  # what was gathered belongs to the binding just made
            strings.clear()
            types.clear()
            infos.clear()
            classes.clear()

        for item in items:
            if item[0] == "ref":
                a = item[1]
                if a in types_arrays:
                    types.add(a)
                elif a in typeinfo_type:
                    infos.add(typeinfo_type[a])
                elif a in class_symbol:
                    classes.add(class_symbol[a])
                else:
                    s = elf.string_at(a)
                    if s is not None:
                        strings.append(s)
                continue
            _, callee_addr, callee, regs = item
            rsi = elf.string_at(regs["rsi"]) if "rsi" in regs else None
            rdx = elf.string_at(regs["rdx"]) if "rdx" in regs else None
            selves = frozenset(self_type[t] for t in types if t in self_type)
            if "add_class_method(" in callee or "def_property_static_impl(" in callee:
                if rsi:
                    found.append(("member", rsi, selves))
                since_last()
            elif "module_::add_object(" in callee:
                if rsi:
                    found.append(("module_def", rsi, frozenset()))
                since_last()
            elif "enum_base::value(" in callee:
                if rsi:
                    owner = {_normalize(enclosing_enum.group(1))} if enclosing_enum else set()
                    found.append(("enum_value", rsi, frozenset(infos | owner)))
                since_last()
            elif _ENUM_VALUE.match(callee):
                if rsi:
                    found.append(("enum_value", rsi, frozenset({_normalize(_ENUM_VALUE.match(callee).group(1))})))
                since_last()
            elif "type_record::type_record()" in callee:
                since_last()
            elif "generic_type::initialize(" in callee:
                for s in strings:
                    if _IDENTIFIER.fullmatch(s):
                        found.append(("class", s, frozenset(classes)))
                since_last()
            elif _CTOR.match(callee) and rdx:
                found.append(("class", rdx, frozenset({class_symbol.get(callee_addr) or
                                                        _normalize(_CLASS_TEMPLATE.match(callee).group(1))})))
                since_last()
            elif _OUTLINED_DEF.search(callee):
                # a whole .def in a function of its own: what it binds is its own, named or not
                index = by_address.get(callee_addr)
                if rsi:
                    selves = frozenset(self_type[t] for t in types | (reached(index) if index is not None else set())
                                       if t in self_type)
                    kind = "module_def" if _OUTLINED_DEF.search(callee).group(1) == "module_" else "member"
                    found.append((kind, rsi, selves))
                since_last()
            else:
                index = by_address.get(callee_addr)
                if index is not None:
                    types |= reached(index)
                if callee_addr in class_symbol:
                    classes.add(class_symbol[callee_addr])
    return found


def wheel_bindings(wheel: Path) -> list[tuple[str, str, frozenset[str]]]:
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        so = Path(tmp) / "tensorrt.so"
        so.write_bytes(z.read(WHEEL_MODULE))
        return bindings(str(so))


def scope_members(found: list[tuple[str, str, frozenset[str]]], scope: str) -> set[str]:
    """Every member (method, property, enum value) the module binds on the C++ types of `scope`."""
    wanted = SCOPE_TYPES[scope]
    return {n for k, n, ts in found if k in ("member", "enum_value") and any(_is(t, w) for t in ts for w in wanted)}


def wheel_names(found: list[tuple[str, str, frozenset[str]]]) -> tuple[list[str], dict[str, str]]:
    """The names in NAMES the binding module binds, and the evidence for each."""
    evidence = {}

    def tied(kind: str, name: str, wanted: tuple[str, ...]) -> bool:
        return any(k == kind and n == name and any(_is(t, w) for t in ts for w in wanted) for k, n, ts in found)

    for name in NAMES:
        scope, _, member = name.rpartition(".")
        wanted = SCOPE_TYPES.get(scope, ())
        if not scope and name in SCOPE_TYPES:
            if tied("class", name, SCOPE_TYPES[name][:1]):
                evidence[name] = "class"
        elif not scope:
            if any(k == "module_def" and n == name for k, n, _ in found):
                evidence[name] = "module_def"
        elif tied("enum_value", member, wanted):
            evidence[name] = "enum_value"
        elif tied("member", member, wanted):
            evidence[name] = "method_self_type"
    return [n for n in NAMES if n in evidence], evidence


def bare_string_names(wheel: Path) -> list[str]:
    """What `strings` would say: each name's last part is a whole NUL-terminated string in .rodata."""
    with zipfile.ZipFile(wheel) as z:
        elf = Elf(z.read(WHEEL_MODULE))
    h = elf.sections[".rodata"]
    whole = set(elf.data[h[4]:h[4] + h[5]].split(b"\0"))
    return [n for n in NAMES if n.rpartition(".")[2].encode() in whole]


def find_wheel(wheel_dir: str, version: str) -> Path:
    found = sorted(Path(wheel_dir).glob(f"{WHEEL_PACKAGE.replace('-', '_')}-{version}-*.whl"))
    if not found:
        sys.exit(f"no {WHEEL_PACKAGE} {version} wheel in {wheel_dir}: "
                 f"pip download {WHEEL_PACKAGE}=={version} --no-deps -d {wheel_dir}")
    return found[0]


def check_wheels(git_dir: str, wheel_dir: str) -> dict:
    """Each source release read from its wheel too: the wheel method must find exactly what the sources
    find, for the names in NAMES."""
    out = {}
    for release, version in CHECK_WHEELS.items():
        wheel = find_wheel(wheel_dir, version)
        sources = release_names(git_dir, release)
        found = wheel_bindings(wheel)
        names, _ = wheel_names(found)
        bare = bare_string_names(wheel)
        merged = source_scopes(git_dir, release)
        same, sources_only, wheel_only = 0, {}, {}
        for scope in SCOPE_TYPES:
            from_sources, from_wheel = merged.get(scope, set()), scope_members(found, scope)
            same += len(from_sources & from_wheel)
            if from_sources - from_wheel:
                sources_only[scope] = sorted(from_sources - from_wheel)
            if from_wheel - from_sources:
                wheel_only[scope] = sorted(from_wheel - from_sources)
        out[release] = {
            "wheel": wheel.name,
            "agrees": names == sources,
            "missing_from_wheel_reading": [n for n in sources if n not in names],
            "wheel_reading_only": [n for n in names if n not in sources],
            "bare_strings_would_miss": [n for n in sources if n not in bare],
            "bare_strings_would_add": [n for n in bare if n not in sources],
            "all_members_of_the_scopes": {"both": same, "sources_only": sources_only, "wheel_only": wheel_only},
        }
        print(f"{release}: {wheel.name}: {'agrees' if names == sources else 'DIFFERS'} "
              f"({len(sources)} names from the sources); all members of the {len(SCOPE_TYPES)} scopes: {same} "
              f"both, sources only {sources_only}, wheel only {wheel_only}", file=sys.stderr)
    return out


def main(git_dir: str, wheel_dir: str) -> None:
    check = check_wheels(git_dir, wheel_dir)
    if not all(c["agrees"] for c in check.values()):
        sys.exit("the wheel reading disagrees with the sources: " + json.dumps(
            {r: c for r, c in check.items() if not c["agrees"]}, indent=1))
    record = {
        "about": "TensorRT Python names used by eagle31_export/export/engine.py, per release, as bound in "
                 "NVIDIA/TensorRT python/src where a release branch is published, else in the pybind11 module of "
                 "the tensorrt-cu12-bindings wheel (see tests/data/read_tensorrt_python_api.py, "
                 "docs/runtime-capabilities.md); release_source says which, per release",
        "source": {"repository": "NVIDIA/TensorRT", "branches": [f"release/{r}" for r in RELEASES],
                   "files": list(FILES)},
        "wheels": {"package": WHEEL_PACKAGE, "module": WHEEL_MODULE, "releases": dict(WHEEL_RELEASES),
                   "scope_types": {k: list(v) for k, v in SCOPE_TYPES.items()}},
        "names": list(NAMES),
        "releases": {},
        "release_source": {},
        "evidence_kinds": EVIDENCE,
        "release_evidence": {},
        "wheel_check": {
            "about": "every release with both a release branch and a wheel, read both ways: the wheel reading "
                     "finds exactly the names in NAMES the sources find (agrees); what a bare `strings` match "
                     "of each name's last part would have got wrong is listed beside it. all_members_of_the_scopes "
                     "compares every member of the SCOPE_TYPES scopes, not only those in NAMES: wheel_only are "
                     "__int__ / __index__ (and up to 10.15 value), which pybind11's enum_ adds to every enum "
                     "itself; sources_only is INetworkDefinition.serialize, whose .def sits in "
                     "#if ENABLE_INETWORK_SERIALIZE and is not compiled into the released module (the source "
                     "reading does not evaluate the preprocessor)",
            "releases": check,
        },
    }
    for release in RELEASES:
        record["releases"][release] = release_names(git_dir, release)
        record["release_source"][release] = f"source: NVIDIA/TensorRT release/{release} python/src"
        record["release_evidence"][release] = "source"
    for release, version in WHEEL_RELEASES.items():
        wheel = find_wheel(wheel_dir, version)
        names, evidence = wheel_names(wheel_bindings(wheel))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        record["releases"][release] = names
        record["release_source"][release] = (f"wheel: {wheel.name} (sha256 {digest}), pybind11 bindings in "
                                             f"{WHEEL_MODULE}")
        record["release_evidence"][release] = evidence
    json.dump(record, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--check-wheel-against-sources":
        result = check_wheels(sys.argv[2], sys.argv[3])
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
        sys.exit(0 if all(c["agrees"] for c in result.values()) else 1)
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
