"""The tiny pair made long-context: its trained weights under a rope scaled as real long-context
pairs scale theirs, so `parity --context` has a pair that holds 32768 positions.

Long-context Llama targets stretch a rope trained on a short window: Llama 3.1 with `llama3`
scaling (factor 8 over 8192 positions), DeepSeek V3 / Kimi K2 with `yarn` (factor 32 or 64 over
4096). Their EAGLE drafters carry the same rope (SpecForge and speculators copy the target's). Here
the tiny pair's window of 1024 positions is stretched 32-fold the same two ways, target and both
drafters alike; `max_position_embeddings` becomes 32768.

By default the weights are not fine-tuned at long context (the tiny pair was trained on 256-token
windows), so the pair checks that a runtime rotates and bounds positions as the reference does at
every length; its acceptance at long context is that of a short-context model stretched, not a
trained one's. `drafters` takes the drafters from another folder instead: drafters fine-tuned at
long context under that rope (the tiny pair's `models/long`, examples/tiny/train_long.py), beside
the same stretched target.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eagle31_export.errors import UserError
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
TARGET_FOLDER, DRAFTER_FOLDERS = "target", ("drafter-eagle3", "drafter-eagle31")
FOLDERS = (TARGET_FOLDER, *DRAFTER_FOLDERS)
LONG_DRAFTERS = "long"  # the tiny pair's drafters fine-tuned at long context (yarn), beside its other folders


def write_long_context_pair(tiny: Path, out: Path, rope: str = "yarn", drafters: Path | None = None) -> Path:
    """`out`/{target, drafter-eagle3, drafter-eagle31, held_out_files.json}: the tiny pair at `tiny`
    with rope `rope` (LONG_ROPES) on all three and POSITIONS positions; with `drafters`, the two
    drafters are that folder's, as they are (they must already hold that rope and POSITIONS)."""
    scaling = LONG_ROPES[rope]
    out.mkdir(parents=True, exist_ok=True)
    for name in FOLDERS:
        dst = out / name
        if drafters is not None and name in DRAFTER_FOLDERS:
            _check_long_drafter(drafters / name, rope)
            shutil.copytree(drafters / name, dst, dirs_exist_ok=True)
            continue
        shutil.copytree(tiny / name, dst, dirs_exist_ok=True)
        config = json.loads((dst / "config.json").read_text())
        _set_rope(config, scaling)
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if (dst / "manifest.json").is_file():  # our drafter folders vouch for their files
            write_manifest(dst)
    shutil.copy(tiny / HELD_OUT_FILES, out / HELD_OUT_FILES)
    return out


def long_trained_drafters(tiny: Path) -> Path | None:
    """`tiny`/long when it holds both drafters fine-tuned at long context, else None."""
    folder = tiny / LONG_DRAFTERS
    return folder if all((folder / name / "config.json").is_file() for name in DRAFTER_FOLDERS) else None


def _check_long_drafter(folder: Path, rope: str) -> None:
    """A drafter trained under one rope is not re-labelled with another: refuse a mismatch."""
    config = json.loads((folder / "config.json").read_text())
    held = config.get("rope_scaling") or (config.get("rope_parameters") or {})
    wanted = LONG_ROPES[rope]
    same = all(held.get(key) == value for key, value in wanted.items())
    if not same or config.get("max_position_embeddings") != POSITIONS:
        raise UserError(f"{folder}: its rope ({held.get('rope_type', 'default')}, "
                        f"{config.get('max_position_embeddings')} positions) is not the long pair's "
                        f"{rope} over {POSITIONS} positions; a drafter trained under one rope is not relabelled")


def _set_rope(config: dict, scaling: dict) -> None:
    """In the spelling the config already uses: transformers v5's `rope_parameters` (the tiny
    target) or `rope_theta` + `rope_scaling` (the drafters)."""
    config["max_position_embeddings"] = POSITIONS
    if isinstance(config.get("rope_parameters"), dict):
        theta = config["rope_parameters"]["rope_theta"]
        config["rope_parameters"] = {"rope_theta": theta, **scaling}
    else:
        config["rope_scaling"] = dict(scaling)

