"""Which test started which engine: a pytest plugin that watches this run's child processes.

A thread reads /proc every POLL_S seconds for new processes descended from this pytest process that are
a vLLM API server or a Triton server (an engine takes seconds to import, so none is missed), and counts
each under the test running when it appeared (a session fixture's engine under the test that first asked
for it). A test outside the `engine` marker that started one FAILS: `make test-quick` must start none.
The summary at the end says how many engines the run started and which tests started them.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import Counter
from pathlib import Path

import pytest

POLL_S = 0.25
ENGINE_MARK = "engine"


def engine_kind(argv: list[str]) -> str | None:
    """'vllm' or 'triton' for an engine's command line, else None."""
    if not argv:
        return None
    if "vllm.entrypoints.openai.api_server" in argv or (Path(argv[0]).name == "vllm" and argv[1:2] == ["serve"]):
        return "vllm"
    if Path(argv[0]).name == "tritonserver":
        return "triton"
    return None


def _read(pid: str) -> tuple[list[str], str] | None:
    """(argv, parent pid) of a live process, None once it is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in argv if a], stat.rsplit(")", 1)[1].split()[1]


class EngineWatch:
    def __init__(self) -> None:
        self.root = str(os.getpid())
        self.current: str | None = None  # the test running now
        self.starts: list[tuple[str, str, str]] = []  # (test, kind, pid)
        self._parents: dict[str, str] = {}
        self._argv: dict[str, list[str]] = {}
        self._engines: set[str] = set()
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)

    def start(self) -> None:
        if Path("/proc/self/stat").exists():
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def _descends_from_us(self, pid: str) -> bool:
        """A descendant of this process and of no other pytest run between (a test may run pytest)."""
        seen = 0
        while pid in self._parents and seen < 64:
            pid, seen = self._parents[pid], seen + 1
            if pid == self.root:
                return True
            if "pytest" in self._argv.get(pid, ()):
                return False
        return False

    def poll(self) -> None:
        with self._lock:
            self._poll()

    def _poll(self) -> None:
        live = {p for p in os.listdir("/proc") if p.isdigit()}
        for gone in set(self._parents) - live:
            self._parents.pop(gone, None)
            self._argv.pop(gone, None)
            self._engines.discard(gone)
        fresh = []
        for pid in live - set(self._parents):
            found = _read(pid)
            if found is not None:
                self._parents[pid], self._argv[pid] = found[1], found[0]
                fresh.append((pid, found[0]))
        for pid, argv in fresh:
            kind = engine_kind(argv)
            if kind and self._descends_from_us(pid) and self._parents.get(pid) not in self._engines:
                self._engines.add(pid)
                self.starts.append((self.current or "(between tests)", kind, pid))

    def started_by(self, test: str) -> list[str]:
        return [kind for who, kind, _ in self.starts if who == test]


WATCH = EngineWatch()
# where xdist workers leave what they counted, for the controller's summary (inherited by the workers it starts)
REPORTS_ENV = "EAGLE31_ENGINE_WATCH_DIR"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        os.environ[REPORTS_ENV] = tempfile.mkdtemp(prefix="engine-watch-")


def pytest_sessionstart(session):
    if not session.config.pluginmanager.hasplugin("dsession"):  # xdist's controller runs no test: its workers watch
        WATCH.start()


def pytest_sessionfinish(session):
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is not None and os.environ.get(REPORTS_ENV):
        WATCH.stop()
        Path(os.environ[REPORTS_ENV], f"{workerinput['workerid']}.json").write_text(json.dumps(WATCH.starts))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    WATCH.current = item.nodeid
    yield
    WATCH.current = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "teardown" or item.get_closest_marker(ENGINE_MARK) is not None:
        return
    WATCH.poll()  # an engine that came up during the test's last moments
    started = WATCH.started_by(item.nodeid)
    if started and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started {len(started)} engine(s) ({', '.join(sorted(set(started)))}) "
                           f"but is not marked `{ENGINE_MARK}`: mark it, or `make test-quick` starts engines")


def pytest_terminal_summary(terminalreporter):
    WATCH.stop()
    starts = list(WATCH.starts)
    for worker in sorted(Path(os.environ.get(REPORTS_ENV) or "/nonexistent").glob("*.json")):
        starts += [tuple(start) for start in json.loads(worker.read_text())]
    by_kind = Counter(kind for _, kind, _ in starts)
    by_test = Counter(who for who, _, _ in starts)
    terminalreporter.write_sep("-", f"engines started: {len(starts)} "
                                    f"(vLLM {by_kind.get('vllm', 0)}, Triton {by_kind.get('triton', 0)})")
    for who, count in by_test.most_common():
        terminalreporter.write_line(f"{count:3d}  {who}")
