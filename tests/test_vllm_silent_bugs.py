"""The silent bugs users have reported (docs/silent-bugs.md), each produced by `sabotage` and served by a real
vLLM engine (vLLM's CPU build, 0.32), greedy fp32 on the tiny pair: parity fails every one of them and names
its cause as far as the evidence allows, or refuses the bundle in one line before a wrong run.

Served classes run on the suite's shared servers (tests/vllm_servers.py: one per sabotaged drafter, exported
by the pool), compared with the faithful reference drafter, with parity's default prompts and 16 new tokens
(each class below still fails at 16; measured in docs/silent-bugs.md). Classes vLLM refuses to start need a
local engine of their own (the refusal is the command's, in one line); the class our reader refuses starts none.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle31_export.export.vllm import export_vllm
from eagle31_export.parity.compare import CONTEXT_DEPENDENT, LATER_POSITIONS, POSITION_1
from eagle31_export.parity.sides import check_parity
from eagle31_export.sabotage import write_sabotaged

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny" / "models"
TARGET, DRAFTER31 = TINY / "target", TINY / "drafter-eagle31"
CLI = Path(sys.executable).parent / "eagle31-export"
sys.path.insert(0, str(ROOT / "tests"))

from vllm_servers import Serving  # noqa: E402

pytestmark = pytest.mark.engine

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """`sabotage`'s copy of the faithful EAGLE 3.1 drafter, broken as the class named (made once)."""
    root = tmp_path_factory.mktemp("silent-bugs")

    def make(name: str) -> Path:
        out = root / name
        if not out.exists():
            write_sabotaged(DRAFTER31, name, out)
        return out
    return make


def served_parity(vllm_env, served, **kw):
    """parity against the shared server `served`, its bundle named (what inspect says of its drafter), the
    faithful drafter as the reference."""
    return check_parity("vllm", served.bundle, DRAFTER31, TARGET, served.url, None, 3, NEW_TOKENS,
                        runtime_options=served.runtime_options(vllm_env), **kw)


def cli(*argv, timeout=900):
    done = subprocess.run([str(CLI), *map(str, argv)], capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def assert_one_line(code, out, err, *needles):
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_faithful_drafter_passes_at_16_tokens(vllm_env, vllm_servers):
    """The control: the suite's faithful server, the same prompts and length as every class here."""
    report = served_parity(vllm_env, vllm_servers.get(Serving(DRAFTER31, TARGET)))
    assert report.passed and report.exact, report.failures
    assert all(r.drafts_identical and r.accepted_identical and r.tokens_identical for r in report.rows)
    assert report.context_dependence is None and report.inspect_names == []


def _absent_norm_output(report):
    # vLLM reads the absent key as false (pre-norm feedback), the reference as trained (true): position 1 intact
    assert all(LATER_POSITIONS in f for f in report.failures), report.failures
    assert report.rows and all(r.accepted_per_position_runtime[0] == r.accepted_per_position_reference[0]
                               for r in report.rows)
    assert any("norm_output is absent from config.json" in line for line in report.inspect_names), report.inspect_names


def _random_embed_tokens(report):
    # vLLM keeps the drafter's own table (it differs from the target's); position 1's causes name the embeddings
    assert "embed_tokens" in POSITION_1 and any(POSITION_1 in f for f in report.failures), report.failures
    assert report.tau("runtime") < report.tau("reference")
    assert any("embed_tokens that differ from the target's" in line for line in report.inspect_names)


def _sliding_window(report):
    # vLLM applies the 16-token window, the reference attends over everything: only prompts long enough differ,
    # and the verdict says positions first, not the fed-back state or what the first step reads
    assert report.failures[0].endswith(CONTEXT_DEPENDENT), report.failures
    assert report.context_dependence["agree_before"] > 0
    assert not any(LATER_POSITIONS in f or POSITION_1 in f for f in report.failures), report.failures
    assert any("declares a sliding window (sliding_window 16" in line for line in report.inspect_names)


def _scale_rope_theta(report):
    # the served drafter's rope read from its config against the reference's: said first
    assert report.failures[0].startswith("rope or positions: the runtime's drafter has rope scaling none, theta 40000 "
                                         "where the reference drafter has scaling none, theta 10000"), report.failures


SERVED = {"absent_norm_output": _absent_norm_output, "random_embed_tokens": _random_embed_tokens,
          "sliding_window": _sliding_window, "scale_rope_theta": _scale_rope_theta}


@pytest.mark.parametrize("bug", list(SERVED))
def test_served_silent_bug_fails_naming_its_cause(vllm_env, vllm_servers, broken, bug):
    """vLLM serves each of these without a word; parity fails it in fp32, every token still the target's
    (speculation is lossless: only the drafts and the acceptance show it)."""
    report = served_parity(vllm_env, vllm_servers.get(Serving(broken(bug), TARGET)))
    print(bug, report.verdict, f"tau {report.tau('reference'):.3f} vs {report.tau('runtime'):.3f}", report.failures[:2],
          report.inspect_names)
    assert report.verdict == "FAIL" and report.exact
    assert all(r.tokens_identical for r in report.rows)
    SERVED[bug](report)


def test_cut_positions_fail_past_the_drafters_positions(vllm_env, vllm_servers, broken):
    """max_position_embeddings halved (512 of the target's 1024): vLLM serves it without a word. At --context
    256 every round agrees; at 768 the engine's drafter keeps nothing, and the verdict names the positions
    first. The faithful server at the same lengths passes."""
    lengths = dict(context=(256, 768), per_length=1)
    faithful = served_parity(vllm_env, vllm_servers.get(Serving(DRAFTER31, TARGET)), **lengths)
    assert faithful.passed, faithful.failures
    report = served_parity(vllm_env, vllm_servers.get(Serving(broken("cut_positions"), TARGET)), **lengths)
    print(report.verdict, report.failures[:2])
    assert report.verdict == "FAIL"
    assert report.failures[0].startswith("rope or positions: the runtime's drafter holds 512 positions where the "
                                         "reference drafter holds 1024"), report.failures
    assert report.failures[1].startswith("context: exact up to 256 tokens, failing from 768 on"), report.failures
    short, long = report.context
    assert not short.failing_prompts and long.failing_prompts
    assert sum(long.accepted_per_position_runtime) == 0 < sum(long.accepted_per_position_reference)


@pytest.fixture(scope="module")
def faithful_bundle(tmp_path_factory):
    return export_vllm(DRAFTER31, TARGET, tmp_path_factory.mktemp("silent-bugs-bundle") / "bundle")


def test_drop_d2t_is_refused_before_anything_loads(vllm_env, faithful_bundle, tmp_path):
    """The bundle's drafter lost d2t with a draft vocabulary half the target's: vLLM would read draft id i as
    target id i without a word. parity refuses it in one line, before either side loads (no engine starts)."""
    copy = write_sabotaged(faithful_bundle, "drop_d2t", tmp_path / "broken")
    assert_one_line(*cli("parity", copy, "--runtime", "vllm", "--vllm", vllm_env), "tensor 'd2t' missing",
                    "reads draft id i as target id i", "refuses it before loading either side")


# own engines: what is tested is the command's local engine refusing to start
@pytest.mark.parametrize("bug", ["nested_flags", "fc_norm_unapplied"])
def test_vllm_refuses_to_start_and_inspect_names_why(vllm_env, faithful_bundle, tmp_path, bug):
    """fc_norm moved into eagle_config (vLLM 0.32 reads it only at the top level), or set false with its weights
    kept: vLLM refuses to load the weights it has no module for. A local engine (the command's own start is
    what fails), one line: vLLM's reason, then what inspect names of the bundle's drafter."""
    copy = write_sabotaged(faithful_bundle, bug, tmp_path / "broken")
    expected = ("fc_norm is set only in eagle_config and read here as true, but vLLM 0.32 runs it as false"
                if bug == "nested_flags" else "fc_norm weights, but fc_norm is off in config.json")
    assert_one_line(*cli("parity", copy, "--runtime", "vllm", "--vllm", vllm_env), "exited",
                    "There is no module or parameter named 'fc_norm'", "inspect names, for the bundle's drafter",
                    f"this bundle is a broken copy on purpose ({bug})", expected)
