"""The tiny pair made long-context: its trained weights under a rope scaled as real long-context
pairs scale theirs, so `parity --context` has a pair that holds 32768 positions.

Long-context Llama targets stretch a rope trained on a short window: Llama 3.1 with `llama3`
scaling (factor 8 over 8192 positions), DeepSeek V3 / Kimi K2 with `yarn` (factor 32 or 64 over
4096). Their EAGLE drafters carry the same rope (SpecForge and speculators copy the target's). Here
the tiny pair's window of 1024 positions is stretched 32-fold the same two ways, target and both
drafters alike; `max_position_embeddings` becomes 32768.

The weights are not fine-tuned at long context (the tiny pair was trained on 256-token windows), so
the pair checks that a runtime rotates and bounds positions as the reference does at every length;
its acceptance at long context is that of a short-context model stretched, not a trained one's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eagle31_export.formats.outputs import write_manifest
from eagle31_export.parity.context import HELD_OUT_FILES

POSITIONS = 32768
ORIGINAL_POSITIONS = 1024  # the tiny pair's max_position_embeddings
LONG_ROPES = {
    # Llama 3.1's schedule (its low/high frequency factors), over the tiny window
    "llama3": {"rope_type": "llama3", "factor": 32.0, "original_max_position_embeddings": ORIGINAL_POSITIONS,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    # YaRN as transformers and vLLM default it (beta_fast 32, beta_slow 1, attention scaled by 0.1 ln(s) + 1)
    "yarn": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": ORIGINAL_POSITIONS},
}
FOLDERS = ("target", "drafter-eagle3", "drafter-eagle31")


def write_long_context_pair(tiny: Path, out: Path, rope: str = "yarn") -> Path:
    """`out`/{target, drafter-eagle3, drafter-eagle31, held_out_files.json}: the tiny pair at `tiny`
    with rope `rope` (LONG_ROPES) on all three and POSITIONS positions."""
    scaling = LONG_ROPES[rope]
    out.mkdir(parents=True, exist_ok=True)
    for name in FOLDERS:
        dst = out / name
        shutil.copytree(tiny / name, dst, dirs_exist_ok=True)
        config = json.loads((dst / "config.json").read_text())
        _set_rope(config, scaling)
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if (dst / "manifest.json").is_file():  # our drafter folders vouch for their files
            write_manifest(dst)
    shutil.copy(tiny / HELD_OUT_FILES, out / HELD_OUT_FILES)
    return out


def _set_rope(config: dict, scaling: dict) -> None:
    """In the spelling the config already uses: transformers v5's `rope_parameters` (the tiny
    target) or `rope_theta` + `rope_scaling` (the drafters)."""
    config["max_position_embeddings"] = POSITIONS
    if isinstance(config.get("rope_parameters"), dict):
        theta = config["rope_parameters"]["rope_theta"]
        config["rope_parameters"] = {"rope_theta": theta, **scaling}
    else:
        config["rope_scaling"] = dict(scaling)

