"""Outputs: where a command may write, how it replaces an earlier output, and how one is checked.

Every command that writes builds its output in a hidden temporary sibling of the final path
(`.NAME.tmp-XXXXXXXX`, locked with `flock` by the process writing it), writes `manifest.json`
into it, and only then moves it to the final path in one rename:

- a new output: `renameat2(RENAME_NOREPLACE)`;
- `--force` over an earlier output: `renameat2(RENAME_EXCHANGE)`; the earlier output stays in
  place, complete, until the new one is; the two swap in one step; the earlier one is then deleted.

A process killed at any moment leaves at the final path either nothing or a complete output (the
earlier one, or the new one). What it leaves beside it (its temporary sibling, or a half-deleted
earlier output) is no longer locked, and the next run of the same output removes it.

Refused, with or without `--force`: an `--out` equal to, inside, or containing one of the
command's inputs; `--force` over a folder that holds no `manifest.json` of this tool (an empty
folder excepted: nothing is lost).

`manifest.json`: the sha256 and size of every file, plus, for each folder the output uses by path
without holding a copy (a target referenced by path or by a symlink, the checkpoints an ONNX
export came from), the size of each file and the sha256 of each safetensors header: enough to
notice a replaced, re-quantized or truncated checkpoint without hashing hundreds of GB. Relative
reference paths are relative to the output folder.

`verify_output` compares an output with its manifest (`eagle31-export verify`); `check_artifacts`
is the quick check `serve` and `parity` run before they load an output. `check_enclosing_output` is
the same check for a checkpoint folder read directly from inside an output (a bundle's `drafter/`):
the checkpoint readers run it, on the files of that folder only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from eagle31_export.errors import UserError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "eagle31-export/manifest"
# Files of referenced folders up to this size are hashed whole; larger ones by size (and header).
SMALL_FILE_BYTES = 64 << 20
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
PathLike = str | os.PathLike


# ----------------------------------------------------------------------------- where to write


def _siblings(out: Path) -> list[Path]:
    """What runs of `out` leave beside it: `.NAME.tmp-*` (being built) and `.NAME.old-*` (moved aside)."""
    if not out.parent.is_dir():
        return []
    prefixes = (f".{out.name}.tmp-", f".{out.name}.old-")
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(prefixes))


def _lock(path: Path) -> int | None:
    """A descriptor holding an exclusive `flock` on `path`; None when a live process holds it
    (or it vanished). The kernel drops the lock when its holder dies, SIGKILL included."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def clean_stale(out: PathLike) -> None:
    """Remove what killed runs of `out` left beside it (siblings no live process holds). Where a
    run was killed between the two renames of the fallback swap, the earlier output goes back."""
    out = Path(out).absolute()
    for path in _siblings(out):
        fd = _lock(path) if path.is_dir() and not path.is_symlink() else None
        if fd is None and path.is_dir() and not path.is_symlink():
            continue  # a live run is using it
        try:
            if path.name.startswith(f".{out.name}.old-") and not os.path.lexists(out) and is_output(path):
                os.rename(path, out)
            else:
                _remove(path)
        finally:
            if fd is not None:
                os.close(fd)


def is_output(folder: PathLike) -> bool:
    """Whether `folder` holds a manifest.json written by this tool."""
    manifest = Path(folder) / MANIFEST
    try:
        obj = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and isinstance(obj.get("files"), dict) and obj.get("format", MANIFEST_FORMAT) == \
        MANIFEST_FORMAT


def check_output(out: PathLike, force: bool = False, inputs: Iterable[PathLike | None] = ()) -> Path:
    """Refuse an --out that would touch an input or an existing folder that is not ours; returns
    `out` made absolute. Cleans what killed earlier runs of `out` left. Cheap: commands call it
    before slow work, and `atomic_output_dir` calls it again."""
    out = Path(out).absolute()
    real_out = Path(os.path.realpath(out))
    for given in inputs:
        if given is None:
            continue
        real_in = Path(os.path.realpath(given))
        if real_out == real_in:
            raise UserError(f"--out {out} is the input {given}: it already exists, and inputs are never replaced, "
                            "with or without --force; choose another --out")
        if real_in in real_out.parents:
            raise UserError(f"--out {out} is inside the input {given}; inputs are never written: "
                            "choose an --out outside it")
        if real_out in real_in.parents:
            raise UserError(f"--out {out} contains the input {given}; replacing it would delete the input: "
                            "choose another --out")
    clean_stale(out)
    if os.path.lexists(out):
        if not force:
            raise UserError(f"{out} already exists; choose another --out or pass --force to replace it")
        if not replaceable(out):
            raise UserError(f"{out} is not an eagle31-export output (no manifest.json); "
                            "remove it yourself or choose another --out")
    return out


def replaceable(out: Path) -> bool:
    """What --force may replace: an output of this tool, or an empty folder (nothing to lose)."""
    return out.is_dir() and (is_output(out) or not any(out.iterdir()))


# renameat2(2) flags (linux/fs.h)
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """True when done; False when this system or filesystem has no renameat2 with `flags`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _move_into_place(tmp: Path, out: Path, force: bool) -> None:
    if not os.path.lexists(out):
        try:
            if _renameat2(tmp, out, _RENAME_NOREPLACE):
                return
        except FileExistsError:
            pass
        else:
            os.rename(tmp, out)
            return
    if not force:
        raise UserError(f"{out} appeared while this output was being written; it was left as it is: "
                        "pass --force to replace it")
    if not replaceable(out):
        raise UserError(f"{out} is not an eagle31-export output (no manifest.json); "
                        "remove it yourself or choose another --out")
    if _renameat2(tmp, out, _RENAME_EXCHANGE):
        _remove(tmp)  # now the earlier output
        return
    # No atomic exchange here: move the earlier output aside, then the new one in. A kill between
    # the two renames leaves the earlier output at `.NAME.old-*`; the next run puts it back.
    old = out.parent / f".{out.name}.old-{os.urandom(4).hex()}"
    os.rename(out, old)
    os.rename(tmp, out)
    _remove(old)


@contextlib.contextmanager
def atomic_output_dir(out: PathLike, force: bool = False, inputs: Iterable[PathLike | None] = (),
                      references: Mapping[str, PathLike | None] | None = None) -> Iterator[Path]:
    """Yield a temporary sibling folder of `out`; when the block completes, write manifest.json
    into it and move it to `out` in one rename (see the module docstring).

    `inputs`: every file or folder the command reads; `out` may not be, contain or lie inside
    any of them. `references`: role -> folder the output uses by path (absolute, or relative to
    the output folder), fingerprinted in the manifest. On any error, or a kill, `out` is untouched.
    """
    out = check_output(out, force, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    lock = _lock(tmp)  # held until the output is in place: other runs of `out` leave it alone
    try:
        yield tmp
        write_manifest(tmp, references)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the result is an ordinary folder
        _move_into_place(tmp, out, force)
    except BaseException:
        _remove(tmp)
        raise
    finally:
        if lock is not None:
            os.close(lock)


# ----------------------------------------------------------------------------- manifests


def sha256_of(path: PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def header_sha256(path: PathLike) -> str:
    """sha256 of a safetensors file's header (its 8-byte length and the JSON it announces)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        return hashlib.sha256(prefix + f.read(min(length, MAX_HEADER_BYTES))).hexdigest()


def _own_files(folder: Path, skip: Iterable[str] = ()) -> Iterator[tuple[str, Path]]:
    """(relative posix path, path) of every file of an output, without following folder links;
    `skip`: relative paths of referenced folders (links or copies) not listed here."""
    skip = set(skip)
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        dirs[:] = sorted(d for d in dirs if (here / d).relative_to(folder).as_posix() not in skip)
        for name in sorted(files):
            path = here / name
            rel = path.relative_to(folder).as_posix()
            if rel == MANIFEST or rel in skip or not path.is_file():
                continue
            yield rel, path


def _referenced_files(folder: Path) -> Iterator[tuple[str, Path]]:
    """Files of a referenced checkpoint folder (links followed, hidden names skipped)."""
    for root, dirs, files in os.walk(folder, followlinks=True):
        here = Path(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = here / name
            if not name.startswith(".") and path.is_file():
                yield path.relative_to(folder).as_posix(), path


def fingerprint(path: Path) -> dict:
    """What a referenced file is checked by: its size, and its safetensors header hash (weights)
    or its sha256 (small files: configs, tokenizers)."""
    size = path.stat().st_size
    if path.suffix == ".safetensors":
        return {"bytes": size, "header_sha256": header_sha256(path)}
    if size <= SMALL_FILE_BYTES:
        return {"bytes": size, "sha256": sha256_of(path)}
    return {"bytes": size}


def write_manifest(folder: PathLike, references: Mapping[str, PathLike | None] | None = None) -> None:
    """manifest.json: sha256 and size of every file in `folder` (recursively), and the
    fingerprints of each referenced folder (see the module docstring)."""
    folder = Path(folder)
    refs = {role: str(path) for role, path in (references or {}).items() if path is not None}
    inside = [p for p in refs.values() if not os.path.isabs(p)]
    files = {rel: {"sha256": sha256_of(p), "bytes": p.stat().st_size}
             for rel, p in sorted(_own_files(folder, skip=[p for p in inside if (folder / p).is_symlink()]))}
    manifest: dict = {"format": MANIFEST_FORMAT, "files": files}
    if refs:
        manifest["references"] = {
            role: {"path": path, "files": {rel: fingerprint(p) for rel, p in _referenced_files(folder / path)}}
            for role, path in refs.items()}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


# ----------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class Difference:
    """One way an output differs from its manifest. `path`: relative to the output, or the
    path of a file in a folder it references."""

    path: str
    kind: str  # "changed" | "missing" | "extra"
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind:8s}{self.path}" + (f"  ({self.detail})" if self.detail else "")


def read_manifest(folder: PathLike) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder")
    path = folder / MANIFEST
    if not path.is_file():
        raise UserError(f"{folder}: no {MANIFEST}; not an eagle31-export output (or one written before manifests): "
                        "nothing to check it against")
    if not is_output(folder):
        raise UserError(f"{path}: not an eagle31-export manifest (unreadable, or no 'files' object)")
    return json.loads(path.read_text(encoding="utf-8"))


def _compare(path: Path, label: str, want: dict, deep: bool) -> Difference | None:
    if not path.is_file():
        return Difference(label, "missing")
    size = path.stat().st_size
    if size != want.get("bytes", size):
        return Difference(label, "changed", f"{size} bytes, {want['bytes']} when written")
    if "header_sha256" in want and header_sha256(path) != want["header_sha256"]:
        return Difference(label, "changed", "safetensors header differs")
    if "sha256" in want and deep and sha256_of(path) != want["sha256"]:
        return Difference(label, "changed", "sha256 differs")
    return None


def _within(rel: str, folder: str) -> bool:
    """Whether the relative path `rel` is `folder` or lies under it (both relative to one output)."""
    return folder in ("", ".") or rel == folder or rel.startswith(folder.rstrip("/") + "/")


def verify_output(folder: PathLike, deep: bool = True, extras: bool = True,
                  references: Iterable[str] | None = None, under: str | None = None) -> list[Difference]:
    """Every difference between `folder` and its manifest.json, in path order.

    `deep`: sha256 of every file of the output (`eagle31-export verify`); otherwise (the check
    before loading) files under a referenced folder copied into the output are checked like any
    referenced folder: by size and header. `extras`: also report files the manifest does not list.
    `references`: the roles of referenced folders to check (None: all). `under`: a folder relative
    to the output (`drafter`): only what lies under it is checked, its own files and those of the
    referenced folders at or under it (or, for a folder inside a referenced one, that part of it).
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    refs = {role: ref for role, ref in (manifest.get("references") or {}).items()
            if references is None or role in references}
    inside = [ref["path"] for ref in (manifest.get("references") or {}).values() if not os.path.isabs(ref["path"])]
    linked = [p for p in inside if (folder / p).is_symlink()]
    quick = [] if deep else inside
    found: list[Difference] = []
    for rel, want in sorted(manifest["files"].items()):
        if any(rel == p or rel.startswith(p.rstrip("/") + "/") for p in quick):
            continue
        if under is not None and not _within(rel, under):
            continue
        diff = _compare(folder / rel, rel, want, deep=True)
        if diff:
            found.append(diff)
    if extras:
        listed = set(manifest["files"])
        found += [Difference(rel, "extra") for rel, _ in _own_files(folder, skip=linked) if rel not in listed]
    for role, ref in sorted(refs.items()):
        base = folder / ref["path"]
        shown = ref["path"]
        if deep and ref["path"] in inside and ref["path"] not in linked:
            continue  # a copy inside the output: its files were just checked by sha256
        part = ""  # with `under` inside this referenced folder: the part of it that is checked
        if under is not None:
            if os.path.isabs(ref["path"]):
                continue  # outside the output
            if not _within(ref["path"], under):
                if not _within(under, ref["path"]):
                    continue
                part = under[len(ref["path"].rstrip("/")) + 1:]
        if not base.is_dir():
            found.append(Difference(shown, "missing", f"the {role} this output references"))
            continue
        for rel, want in sorted(ref["files"].items()):
            if part and not _within(rel, part):
                continue
            diff = _compare(base / rel, f"{shown.rstrip('/')}/{rel}", want, deep=True)
            if diff:
                found.append(Difference(diff.path, diff.kind, f"{role}: {diff.detail}" if diff.detail else role))
        if extras:
            found += [Difference(f"{shown.rstrip('/')}/{rel}", "extra", role)
                      for rel, _ in _referenced_files(base) if rel not in ref["files"]]
    return found


def check_artifacts(folder: PathLike, references: Iterable[str] | None = None) -> None:
    """Refuse, in one line naming the file, an output that changed since it was written: its own
    files by sha256 (a copied target by size and header), the folders it references by size and
    header. Files added beside them are not an error here (`eagle31-export verify` lists them)."""
    folder = Path(folder)
    diffs = verify_output(folder, deep=False, extras=False, references=references)
    if diffs:
        d = diffs[0]
        what = "is missing" if d.kind == "missing" else "changed since it was written"
        more = f" ({d.detail})" if d.detail else ""
        raise UserError(f"{folder}: {d.path} {what}{more}; restore it or export again "
                        f"(`eagle31-export verify {folder}` lists every difference)")


# How far up from a checkpoint folder its enclosing output is looked for: a Triton repository
# holds the pair three folders down (eagle31_speculate/1/pair/drafter).
ENCLOSING_LEVELS = 6


def enclosing_output(folder: PathLike, levels: int = ENCLOSING_LEVELS) -> tuple[Path, str] | None:
    """(the nearest output of this tool that `folder` lies inside, `folder` relative to it), looked
    for in up to `levels` parent folders (the folder as given: a link into an output counts as inside
    it); None for a folder inside none."""
    here = Path(os.path.abspath(folder))
    for parent in list(here.parents)[:levels]:
        if is_output(parent):
            return parent, here.relative_to(parent).as_posix()
    return None


def check_enclosing_output(folder: PathLike) -> None:
    """Refuse, in one line naming the file, a checkpoint folder read from inside an output of this
    tool (a bundle's `drafter/`, a Triton repository's `pair/drafter/`) whose files changed since the
    output was written: the files of that folder the manifest lists, by sha256 (a referenced target
    by size and header, as `check_artifacts`). Nothing else of the output is read. A folder inside no
    output (a plain checkpoint, one `convert` or `quantize` wrote) has nothing to check against."""
    found = enclosing_output(folder)
    if found is None:
        return
    output, rel = found
    diffs = verify_output(output, deep=False, extras=False, under=rel)
    if diffs:
        d = diffs[0]
        what = "is missing" if d.kind == "missing" else "changed since it was written"
        more = f" ({d.detail})" if d.detail else ""
        shown = d.path if os.path.isabs(d.path) else (output / d.path).as_posix()
        raise UserError(f"{shown} {what}{more}; {folder} is part of the eagle31-export output {output}: "
                        f"export it again, or restore the file (`eagle31-export verify {output}` lists every "
                        "difference)")


# Files only this tool's outputs hold (a serving bundle, an ONNX export, a capture), so that such
# a folder without its manifest is not taken for a plain checkpoint.
OUTPUT_MARKERS = ("bundle.json", "graphs.json", "capture.json")


def check_consumed(folder: PathLike | None, given: Iterable[str] = ()) -> None:
    """The check every command runs on an output of this tool that it reads (a bundle, an ONNX
    export, a repository, a capture) before loading anything from it: `check_artifacts`, so that a
    changed byte is refused in one line naming the file and never gets a new manifest downstream.
    `given`: roles of referenced folders the command takes from its own options instead (`target`
    with --target), not checked; an ONNX export without a target graph still runs on its recorded
    target. Checkpoints are not outputs in this sense: their readers check what they hold (and, for a
    folder inside an output, its files against that output's manifest: `check_enclosing_output`)."""
    if folder is None:
        return
    folder = Path(folder)
    if not any((folder / m).is_file() for m in OUTPUT_MARKERS):
        return  # a checkpoint (also one `convert` or `quantize` wrote): read and checked for what it holds
    manifest = read_manifest(folder)  # refuses a marked folder whose manifest is gone
    graphs = folder / "graphs.json"
    needs_target = graphs.is_file() and "no_target_graph" in graphs.read_text(encoding="utf-8", errors="replace")
    skip = {role for role in given if not (role == "target" and needs_target)}
    roles = [role for role in (manifest.get("references") or {}) if role not in skip]
    check_artifacts(folder, references=roles)
