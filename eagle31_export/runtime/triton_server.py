"""Start and stop a real Triton Inference Server: the one bundled in nvidia-pytriton (CPU builds run).

Launched directly (not through PyTriton), the binary needs three things PyTriton normally sets up:
- LD_LIBRARY_PATH with the wheel's `nvidia_pytriton.libs` (libtritonserver and friends) and, for
  an interpreter built with a shared libpython outside the system paths (pyenv), its lib folder:
  the python backend stub links libpython;
- a backend directory whose `python/` holds `libtriton_python.so` next to the stub built for THIS
  Python version (the wheel ships one per version; we link the right one into a private folder);
- the environment's `bin` first on PATH: the stub runs the first `python` it finds, and the
  models import this package from its site-packages. The stub's interpreter ignores PYTHONPATH;
  a model's own folder is on its sys.path.
Only 127.0.0.1 is bound. Metrics are off unless a port is given.
"""

from __future__ import annotations

import ctypes.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Sequence

from eagle31_export.errors import MissingRuntimeError, UserError

HOST = "127.0.0.1"
INSTALL_HINT = "Triton Inference Server is not installed: `pip install nvidia-pytriton` (bundles tritonserver)"


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    libs: Path
    python_backend: Path  # folder with libtriton_python.so
    stub: Path  # triton_python_backend_stub for this interpreter


def find_triton() -> TritonInstall:
    try:
        import pytriton  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise MissingRuntimeError(INSTALL_HINT) from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(binary=root / "bin" / "tritonserver", libs=root.parent.parent / "nvidia_pytriton.libs",
                            python_backend=root / "backends" / "python",
                            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub")
    if not install.binary.is_file():
        raise MissingRuntimeError(f"{install.binary} missing: reinstall nvidia-pytriton")
    if not install.stub.is_file():
        raise MissingRuntimeError(f"nvidia-pytriton has no python backend stub for Python {version}")
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") and not ctypes.util.find_library(f"python{version}"):
        raise MissingRuntimeError(f"Triton's python backend links libpython{version}.so, which this interpreter "
                                  "lacks (built without --enable-shared); use a Python with a shared libpython")
    return install


def backend_dir(install: TritonInstall, folder: Path) -> Path:
    """A backend directory with the python backend and the stub for this Python version (symlinks)."""
    python = folder / "backends" / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in (*install.python_backend.iterdir(), install.stub):
        link = python / source.name
        if source.is_file() and not link.exists():
            link.symlink_to(source)
    return python.parent


def server_env(install: TritonInstall, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    libs = [str(install.libs)]
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libs.append(libdir)  # the stub links libpython3.X.so
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra or {})
    return env


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports on 127.0.0.1 (all held open while choosing, so none repeats)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class TritonServer:
    """A tritonserver process on 127.0.0.1; use as a context manager (stopped on exit, also on errors)."""

    repositories: Sequence[str | os.PathLike]
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int | None = None
    env: dict[str, str] | None = None
    process: subprocess.Popen | None = field(default=None, init=False)
    workdir: Path | None = field(default=None, init=False)
    _log_file: IO | None = field(default=None, init=False, repr=False)  # server output; see follow_log

    @property
    def http_url(self) -> str:
        return f"{HOST}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    def command(self, install: TritonInstall, backends: Path) -> list[str]:
        cmd = [str(install.binary), f"--backend-directory={backends}",
               f"--http-address={HOST}", f"--http-port={self.http_port}",
               f"--grpc-address={HOST}", f"--grpc-port={self.grpc_port}",
               "--exit-timeout-secs=10"]
        cmd += [f"--model-repository={Path(r).resolve()}" for r in self.repositories]
        if self.metrics_port is None:
            cmd.append("--allow-metrics=false")
        else:
            cmd += [f"--metrics-address={HOST}", f"--metrics-port={self.metrics_port}"]
        return cmd

    def start(self) -> "TritonServer":
        for repo in self.repositories:
            if not Path(repo).is_dir():
                raise UserError(f"{repo}: no such model repository; write one with `eagle31-export export triton`")
        ports = {"--port": self.http_port, "--grpc-port": self.grpc_port}
        if self.metrics_port is not None:
            ports["--metrics-port"] = self.metrics_port
        for flag, port in ports.items():
            if port_in_use(port):
                raise UserError(f"port {port} on {HOST} is in use; pick a free one with {flag} N "
                                "or stop whatever is listening there")
        install = find_triton()
        self.workdir = Path(tempfile.mkdtemp(prefix="eagle31-triton-"))
        backends = backend_dir(install, self.workdir)
        self._log_file = open(self.workdir / "tritonserver.log", "w")  # noqa: SIM115 - closed in stop()
        # A new session: Ctrl-C in a terminal reaches us, and we stop the server in order.
        self.process = subprocess.Popen(self.command(install, backends), env=server_env(install, self.env),
                                        stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def follow_log(self, stream: IO) -> None:
        """Copy the server log to `stream` as it grows (a daemon thread; ends with the server)."""
        import threading

        def pump() -> None:
            with open(self.workdir / "tritonserver.log", errors="replace") as f:
                while True:
                    line = f.readline()
                    if line:
                        stream.write(line)
                        stream.flush()
                    elif self.process is None or self.process.poll() is not None:
                        return
                    else:
                        time.sleep(0.1)

        threading.Thread(target=pump, daemon=True).start()

    def log_lines(self) -> list[str]:
        path = self.workdir / "tritonserver.log" if self.workdir else None
        if path is None or not path.is_file():
            return []
        return path.read_text(errors="replace").splitlines()

    def failure(self) -> str:
        """The server's first real error line (Triton prefixes them with E), shortened to one line."""
        errors = [line for line in self.log_lines() if line.startswith("E") and "CudaDriverHelper" not in line]
        if not errors:
            return "no error line in its log"
        text = errors[0].split("] ", 1)[-1].replace("\\n", " ").strip('" ')
        return text[:400]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every model is loaded (`/v2/health/ready`), or raise with the server's first error."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UserError(f"tritonserver exited with code {self.process.returncode} while starting: "
                                f"{self.failure()}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise UserError(f"tritonserver not ready after {timeout:.0f}s: {self.failure()}")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGINT (Triton unloads its models and stops their stubs), then SIGKILL of its group if stuck."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # the group we created: server and its stubs
                self.process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        return self.process.returncode

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
