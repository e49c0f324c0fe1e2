"""TensorRT-LLM's LLM-API options (the YAML of `trtllm-serve --config`, a Triton `model.yaml`): the
speculative-decoding switches that turn speculation off while the server keeps answering.

`export trtllm` never writes them; `inspect` and `verify` warn where a YAML has them, because a run
measured after such a switch fired sees no speculation at all (docs/runtimes.md, "Switches that turn
speculation off"). Keys as read in TensorRT-LLM's `tensorrt_llm/llmapi/llm_args.py` (DecodingBaseConfig);
the versions each spelling was read in are in that section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from eagle31_export.errors import CheckpointError

# (window key, threshold key, what the threshold is compared with): speculation is disabled for good once
# the rolling mean over the window falls below the threshold. The first pair is the 1.2 spelling
# (acceptance length over completed requests), the second the later one (acceptance rate over iterations).
PERMANENT_OFF = (
    ("acceptance_window", "acceptance_length_threshold", "mean acceptance length over the last {w} completed requests"),
    ("acceptance_rate_window_size", "acceptance_rate_threshold",
     "mean acceptance rate over the last {w} speculating iterations"),
)
SWITCH_KEYS = tuple(k for window, threshold, _ in PERMANENT_OFF for k in (window, threshold)) + (
    "max_concurrency", "draft_len_schedule")


def read_options(path: Path) -> dict[str, Any]:
    """An LLM-API YAML as a mapping; one line naming the file where it is not one."""
    try:
        options = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise CheckpointError(f"{path}: not a readable YAML file ({str(err).splitlines()[0]})") from None
    if not isinstance(options, dict):
        raise CheckpointError(f"{path}: holds a YAML {type(options).__name__}; expected TensorRT-LLM's LLM-API options")
    return options


def speculation_switch_warnings(options: dict[str, Any], where: str) -> list[str]:
    """One line per switch in `options["speculative_config"]` that can turn speculation off."""
    spec = options.get("speculative_config")
    if not isinstance(spec, dict):
        return []
    warnings = []
    for window_key, threshold_key, measure in PERMANENT_OFF:
        window, threshold = spec.get(window_key), spec.get(threshold_key)
        if window is None and threshold is None:
            continue
        if window and threshold is not None:
            warnings.append(f"{where}: speculative_config sets {window_key} {window} and {threshold_key} {threshold}: "
                            f"TensorRT-LLM turns speculation off for good once the {measure.format(w=window)} falls "
                            "below the threshold; the server keeps answering without drafts, so acceptance measured "
                            f"after that is not the drafter's. Remove both to measure the drafter")
        else:
            warnings.append(f"{where}: speculative_config sets {window_key if window is not None else threshold_key} "
                            f"without {threshold_key if window is not None else window_key} (or a window of 0): no "
                            "effect alone; with both, TensorRT-LLM turns speculation off for good once the "
                            f"{measure.format(w='N')} falls below the threshold")
    if spec.get("max_concurrency") is not None:
        warnings.append(f"{where}: speculative_config sets max_concurrency {spec['max_concurrency']}: TensorRT-LLM "
                        "does not speculate at batch sizes above it")
    if spec.get("draft_len_schedule") is not None:
        warnings.append(f"{where}: speculative_config sets draft_len_schedule: TensorRT-LLM drafts fewer tokens as "
                        "the batch grows and none beyond its largest batch size")
    return warnings


def yaml_switch_warnings(folder: Path) -> list[str]:
    """The switch warnings of every LLM-API YAML in an output folder (a bundle's llm_api.yaml, a Triton
    repository's model.yaml); a YAML that is not a mapping is skipped (not ours to judge here)."""
    warnings = []
    for path in [p for p in (Path(folder) / "llm_api.yaml", *sorted(Path(folder).glob("*/1/model.yaml"))) if p.is_file()]:
        try:
            options = read_options(path)
        except CheckpointError:
            continue
        warnings += speculation_switch_warnings(options, path.relative_to(folder).as_posix())
    return warnings
