"""The tiny pair stretched to long context (demo/long_pair.py), with its own drafters stretched or with
the drafters fine-tuned at long context (examples/tiny/models/long, examples/tiny/train_long.py)."""

import json
from pathlib import Path

import pytest

from eagle31_export.demo.long_pair import POSITIONS, long_trained_drafters, write_long_context_pair
from eagle31_export.demo.pair import DRAFTERS, EmbeddedPair
from eagle31_export.errors import UserError
from eagle31_export.inspection import inspect_path

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "models"
LONG = TINY / "long"


def test_the_tiny_pair_has_long_trained_drafters_and_stays_a_demo_pair():
    assert long_trained_drafters(TINY) == LONG
    assert long_trained_drafters(LONG) is None  # no long/ inside long/
    assert EmbeddedPair.open(TINY).drafter("EAGLE 3.1") == TINY / "drafter-eagle31"  # long/ beside, not instead


@pytest.mark.parametrize("drafters", [None, LONG])
def test_long_pair_reads_and_inspects_clean(tmp_path, drafters):
    pair = write_long_context_pair(TINY, tmp_path / "pair", "yarn", drafters)
    target = json.loads((pair / "target" / "config.json").read_text())
    assert target["max_position_embeddings"] == POSITIONS and target["rope_parameters"]["rope_type"] == "yarn"
    for folder in DRAFTERS.values():
        if drafters is not None:  # taken as they are
            weights = (pair / folder / "model.safetensors", drafters / folder / "model.safetensors")
            assert weights[0].read_bytes() == weights[1].read_bytes()
        report = inspect_path(pair / folder, pair / "target")
        assert report["problems"] == [], (folder, report["problems"])
        config = json.loads((pair / folder / "config.json").read_text())
        assert config["max_position_embeddings"] == POSITIONS and config["rope_scaling"]["rope_type"] == "yarn"


def test_long_trained_drafters_are_not_relabelled_with_another_rope(tmp_path):
    with pytest.raises(UserError, match="not the long pair's llama3"):
        write_long_context_pair(TINY, tmp_path / "pair", "llama3", LONG)
