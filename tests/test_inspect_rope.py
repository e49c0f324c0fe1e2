"""`inspect --target` lists a drafter whose rope or positions fall short of its target's.

The public failures these catch: a converter that drops the drafter's rope_scaling
(vllm-project/speculators PR 574), yarn read as another schedule (NVIDIA-NeMo/Automodel PR 2399),
and a drafter of 2048 positions served at the target's context (sgl-project/sglang issue 6783,
SpecForge issue 271). Each lowers acceptance at long context without an error.
"""

import json
import shutil
from pathlib import Path

import pytest

from eagle31_export.formats.drafter.checkpoint import write_drafter
from factories import drafter_config_for, random_drafter

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "models"

YARN = {"factor": 4.0, "original_max_position_embeddings": 4096}
LONG = 16384  # 4096 * 4
CONSEQUENCE = ("positions beyond 4096 are rotated differently from what the target's hidden states were "
               "trained with, which lowers acceptance at long context")


def _target(llama_target: Path, folder: Path, spelling: str, rope_type: str = "yarn", theta: float = 10000.0,
            scaling: dict | None = None, max_positions: int = LONG) -> Path:
    """The session's tiny Llama target with its config's rope rewritten in one of the spellings that exist."""
    shutil.copytree(llama_target, folder)
    config = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        config.pop(key, None)
    scaling = YARN if scaling is None else scaling
    if spelling == "rope_parameters":  # transformers v5
        config["rope_parameters"] = {"rope_theta": theta, "rope_type": rope_type, **scaling}
    else:  # transformers v4: `type` (older) or `rope_type`
        config["rope_theta"] = theta
        config["rope_scaling"] = {spelling: rope_type, **scaling}
    config["max_position_embeddings"] = max_positions
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _drafter(llama_info, folder: Path, **config) -> Path:
    cfg = drafter_config_for(llama_info, fc_norm=True, norm_output=True, **{"max_position_embeddings": LONG, **config})
    return write_drafter(random_drafter(cfg, seed=3), folder, "specforge")


def _inspect(cli, drafter: Path, target: Path) -> tuple[int, list[str]]:
    code, out, _ = cli("inspect", drafter, "--target", target, "--json")
    return code, json.loads(out)["problems"]


TARGET_YARN = "yarn (factor 4, original_max_position_embeddings 4096)"


@pytest.mark.parametrize("spelling, drafter_scaling, problem", [
    ("rope_parameters", None, f"drafter rope_scaling is none but the target's is {TARGET_YARN}"),  # dropped
    ("type", {"type": "linear", "factor": 4.0},  # yarn read as linear
     f"drafter rope_scaling is linear (factor 4) but the target's is {TARGET_YARN}"),
    ("rope_type", {"rope_type": "yarn", **YARN, "factor": 8.0},  # another yarn factor: the field, both values
     "drafter yarn rope_scaling differs from the target's in factor (drafter 8, target 4)"),
], ids=["scaling-dropped", "yarn-as-linear", "other-yarn-factor"])
def test_a_drafter_rope_scaling_unlike_the_targets_is_a_problem(cli, tmp_path, llama_target, llama_info,
                                                                  spelling, drafter_scaling, problem):
    target = _target(llama_target, tmp_path / "target", spelling)
    drafter = _drafter(llama_info, tmp_path / "drafter", rope_scaling=drafter_scaling)
    code, problems = _inspect(cli, drafter, target)
    assert code == 1
    assert problems == [f"{problem}: {CONSEQUENCE}"]


def test_a_different_rope_theta_is_a_problem_at_every_position(cli, tmp_path, llama_target, llama_info):
    target = _target(llama_target, tmp_path / "target", "rope_parameters", rope_type="default", theta=500000.0,
                     scaling={})
    drafter = _drafter(llama_info, tmp_path / "drafter")  # rope_theta 10000, the LlamaConfig default
    code, problems = _inspect(cli, drafter, target)
    assert code == 1
    assert problems == ["drafter rope_theta is 10000 but the target's is 500000: every position is rotated "
                        "differently from what the target's hidden states were trained with, which lowers "
                        "acceptance at long context"]


def test_a_drafter_with_fewer_positions_than_its_target_is_a_problem(cli, tmp_path, llama_target, llama_info):
    target = _target(llama_target, tmp_path / "target", "rope_parameters")
    drafter = _drafter(llama_info, tmp_path / "drafter", rope_scaling={"rope_type": "yarn", **YARN},
                       max_position_embeddings=2048)
    code, problems = _inspect(cli, drafter, target)
    assert code == 1
    assert problems == ["drafter holds 2048 positions, target 16384: a runtime serving the target's context runs "
                        "the drafter past its positions"]


def test_a_drafter_that_takes_its_positions_from_the_target_is_not_flagged(cli, tmp_path, llama_target, llama_info):
    target = _target(llama_target, tmp_path / "target", "rope_parameters")
    drafter = _drafter(llama_info, tmp_path / "drafter", rope_scaling={"rope_type": "yarn", **YARN})
    config = json.loads((drafter / "config.json").read_text())
    del config["max_position_embeddings"]  # as the Kimi K2.x MLA drafter ships: it serves the target's context
    (drafter / "config.json").write_text(json.dumps(config))
    code, out, _ = cli("inspect", drafter, "--target", target, "--json")
    report = json.loads(out)
    assert code == 0 and report["problems"] == []
    assert report["config"]["max_position_source"] == "target" and report["config"]["max_position_embeddings"] == LONG


@pytest.mark.parametrize("target_spelling, drafter_scaling", [
    ("rope_parameters", {"type": "yarn", **YARN}),
    ("type", {"rope_type": "yarn", **YARN, "beta_fast": 32, "beta_slow": 1}),  # yarn's defaults spelt out
    ("rope_type", {"type": "yarn", "factor": 4, "original_max_position_embeddings": 4096.0}),
])
def test_the_same_yarn_in_another_spelling_is_not_flagged(cli, tmp_path, llama_target, llama_info,
                                                         target_spelling, drafter_scaling):
    target = _target(llama_target, tmp_path / "target", target_spelling)
    drafter = _drafter(llama_info, tmp_path / "drafter", rope_scaling=drafter_scaling)
    assert _inspect(cli, drafter, target) == (0, [])


def test_the_tiny_example_pair_is_not_flagged(cli):
    # the drafter writes rope_theta + rope_scaling null, the target v5's rope_parameters {"rope_type": "default"}
    code, problems = _inspect(cli, TINY / "drafter-eagle31", TINY / "target")
    assert (code, problems) == (0, [])


def test_without_a_target_nothing_is_compared(cli, tmp_path, llama_info):
    drafter = _drafter(llama_info, tmp_path / "drafter", rope_scaling=None, max_position_embeddings=2048)
    code, out, _ = cli("inspect", drafter, "--json")
    assert code == 0 and json.loads(out)["problems"] == []
