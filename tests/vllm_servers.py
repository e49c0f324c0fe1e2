"""The suite's real vLLM engines: each (bundle, dtype, engine options) started once for the whole test run
and handed to every test that needs it, by URL (the `vllm_servers` session fixture, tests/conftest.py).

A test reaches a shared server exactly as a user reaches theirs: `parity --url` with the server's draft log
(`--draft-log`: our plugin logs every draft the engine verified) and its dtype stated. Tests that must start
an engine of their own (a command's local engine, faults, start-up options) do so and say why.

At most MAX_ALIVE servers run at once (each ~1.5 GB resident on the CPU build, its KV cache included): the one used least
recently is stopped to make room and started again if asked for later (`restarts` counts those).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle31_export.export.bundle import read_bundle
from eagle31_export.export.vllm import export_vllm
from eagle31_export.runtime.registry import LoadOptions
from eagle31_export.runtime.vllm_drafts import DRAFT_LOG_ENV
from eagle31_export.runtime.vllm_engine import LocalServer, find_vllm
from eagle31_export.runtime.vllm_runtime import engine_args

MAX_ALIVE = 3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Serving:
    """What one shared server serves, and how: its identity in the pool."""

    drafter: Path
    target: Path
    dtype: str = "fp32"  # fp32 | bf16
    layout: str = "auto"  # export vllm --layout
    depth: int = 3
    max_num_batched_tokens: int | None = None
    env: tuple[tuple[str, str], ...] = ()  # extra environment of the engine (e.g. our plugin's switches)
    max_context: int | None = None


@dataclass
class Served:
    """A running shared server: its URL, the bundle it serves, where our plugin logs its drafts."""

    serving: Serving
    server: LocalServer
    bundle: Path
    draft_log: Path
    uses: int = field(default=0)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def log(self) -> Path:
        return self.server.log

    def runtime_options(self, vllm: str) -> dict:
        """check_parity's runtime options for this server: its dtype stated, its draft log read."""
        return {"vllm": vllm, "dtype": DTYPES[self.serving.dtype], "draft_log": self.draft_log}


class ServerPool:
    def __init__(self, vllm: str, root: Path):
        self.vllm, self.root = vllm, root
        self.alive: OrderedDict[Serving, Served] = OrderedDict()
        self.started: list[Serving] = []

    @property
    def restarts(self) -> int:
        return len(self.started) - len(set(self.started))

    def get(self, serving: Serving) -> Served:
        if serving in self.alive:
            self.alive.move_to_end(serving)
            served = self.alive[serving]
        else:
            while len(self.alive) >= MAX_ALIVE:
                _, oldest = self.alive.popitem(last=False)
                oldest.server.stop()
            served = self.alive[serving] = self._start(serving)
        served.uses += 1
        return served

    def _start(self, serving: Serving) -> Served:
        n = len(self.started)
        self.started.append(serving)
        home = self.root / f"{n:02d}-{serving.drafter.name}-{serving.dtype}"
        home.mkdir(parents=True)
        bundle = export_vllm(serving.drafter, serving.target, home / "bundle", layout=serving.layout)
        drafts = home / "drafts"
        drafts.mkdir()
        options = LoadOptions(depth=serving.depth, dtype=DTYPES[serving.dtype],
                              max_num_batched_tokens=serving.max_num_batched_tokens, max_context=serving.max_context)
        server = LocalServer(find_vllm(self.vllm), engine_args(read_bundle(bundle), options), home,
                             env={DRAFT_LOG_ENV: str(drafts), **dict(serving.env)})
        server.start()
        return Served(serving, server, bundle, drafts)

    def stop(self) -> None:
        while self.alive:
            _, served = self.alive.popitem()
            served.server.stop()


def vllm_environment() -> str | None:
    root = Path(__file__).resolve().parents[1]
    return os.environ.get("EAGLE31_VLLM") or (str(root / ".venv-vllm") if (root / ".venv-vllm").is_dir() else None)
