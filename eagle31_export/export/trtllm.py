"""TensorRT-LLM bundle: the drafter in its Eagle3 layout plus an LLM-API YAML for the PyTorch backend.

EAGLE-3 runs only on TensorRT-LLM's PyTorch backend (LLM API, `trtllm-serve`, `trtllm-bench`),
so the bundle is configuration, not engines:

    OUT/drafter/       config.json + model.safetensors (layout: formats.drafter.formats.TrtllmFormat)
    OUT/llm_api.yaml   for `trtllm-serve --config` and `trtllm-bench --config`
    OUT/README.md      the exact command line
    OUT/bundle.json    what `export triton` reads
    OUT/target/        only with --copy-target; otherwise the target is referenced by path

Paths inside the bundle are relative to it (`drafter`, `target`): the commands in the README run
from the bundle folder, which may be moved. Only a target referenced by path (an input) is absolute.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from eagle31_export.export.bundle import (
    BUNDLE_FILE,
    CheckedPair,
    bundle_record,
    check_parallel,
    checked_pair,
    bundle_target,
)
from eagle31_export.export.capabilities import (
    bundle_requirements,
    check_runtime,
    readme_section,
    required_features,
    target_quant_format,
)
from eagle31_export.export.trtllm_drafter import write_trtllm_drafter
from eagle31_export.errors import UserError
from eagle31_export.formats.drafter.formats import consumer_layout
from eagle31_export.formats.outputs import atomic_output_dir
from eagle31_export.formats.safetensors_io import write_json

LLM_API_FILE = "llm_api.yaml"
RUNTIME = "trtllm"  # the bundle kind, and the consumer whose drafter layout `consumer_layout` gives


def speculative_config(drafter_dir: str, max_draft_len: int, layers: list[int]) -> dict[str, Any]:
    return {
        "decoding_type": "Eagle3",
        "max_draft_len": max_draft_len,
        "speculative_model": drafter_dir,
        "eagle3_one_model": True,
        # Output-of-layer numbering, which is TensorRT-LLM's own: no conversion.
        "eagle3_layers_to_capture": sorted(layers),
    }


def llm_api_options(drafter_dir: str, max_draft_len: int, layers: list[int], tp: int, pp: int) -> dict[str, Any]:
    return {
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "speculative_config": speculative_config(drafter_dir, max_draft_len, layers),
        # Per-request acceptance statistics (acceptance_rate, total_accepted_draft_tokens, ...).
        "return_perf_metrics": True,
    }


def serve_command(target: str, config: str, tp: int, pp: int, port: int = 8000) -> str:
    return (f"trtllm-serve {target} --backend pytorch --host 127.0.0.1 --port {port} "
            f"--tp_size {tp} --pp_size {pp} --config {config}")


def export_trtllm(drafter: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, tp: int = 1,
                  pp: int = 1, max_draft_len: int = 3, copy: bool = False, force: bool = False,
                  runtime_version: str | None = None) -> Path:
    pair = checked_pair(drafter, target)
    check_parallel(pair.target_info, pair.config, tp, pp)
    if max_draft_len < 1:
        raise UserError(f"--max-draft-len must be >= 1 (got {max_draft_len})")
    features = required_features(pair.config, target_quant_format(pair.target))
    checked = check_runtime(RUNTIME, features, runtime_version)  # docs/runtime-capabilities.md
    out = Path(out).resolve()
    # Paths relative to the bundle (trtllm-serve resolves them against its working directory, the
    # bundle folder in the README's commands); only a target referenced by path is absolute.
    target_path = "target" if copy else str(pair.target)
    with atomic_output_dir(out, force=force, inputs=[drafter, pair.target], references={"target": target_path}) as tmp:
        write_trtllm_drafter(pair.checkpoint, tmp / "drafter")
        kv = bundle_target(pair, RUNTIME, copy, tmp)
        options = llm_api_options("drafter", max_draft_len, list(pair.aux_layer_ids), tp, pp)
        (tmp / LLM_API_FILE).write_text(_yaml_header() + yaml.safe_dump(options, sort_keys=False))
        write_json(tmp / BUNDLE_FILE, bundle_record(RUNTIME, pair, target_path,
                                                    max_draft_len, tp, pp, llm_api=LLM_API_FILE,
                                                    drafter_format=consumer_layout(RUNTIME, pair.config)[0],
                                                    kv=kv, runtime_requirements=bundle_requirements(RUNTIME, features, checked)))
        (tmp / "README.md").write_text(_readme(pair, target_path, max_draft_len, tp, pp)
                                       + readme_section(RUNTIME, features, checked))
    return out


def _yaml_header() -> str:
    return ("# TensorRT-LLM LLM-API options (PyTorch backend): trtllm-serve/trtllm-bench --config this file.\n"
            "# eagle3_layers_to_capture uses TensorRT-LLM's output-of-layer numbering.\n")


def _readme(pair: CheckedPair, target: str, k: int, tp: int, pp: int) -> str:
    cfg = pair.config
    config = LLM_API_FILE
    flags = f"fc_norm={cfg.fc_norm}, norm_output={cfg.norm_output}, norm_before_fc={cfg.norm_before_fc}"
    return f"""# TensorRT-LLM bundle (EAGLE {cfg.eagle_version} drafter, PyTorch backend)

Serve (OpenAI-compatible API on 127.0.0.1:8000), from this folder (`{LLM_API_FILE}` names the drafter
relative to it{", and so does the target" if target == "target" else ""}):

```
{serve_command(target, str(config), tp, pp)}
```

Releases before `--config` existed name the same option `--extra_llm_api_options`.

Benchmark acceptance and throughput:

```
trtllm-bench --model {target} throughput --backend pytorch --dataset DATASET.jsonl --tp {tp} --pp {pp} --config {config}
```

- target: `{target}` ({"copied into this bundle" if target == "target" else "referenced by path, not copied"})
- drafter: `drafter` ({flags}); the config sets both `norm_output` and
  `eagle_config.return_hidden_post_norm`, because older releases read only the latter.
- tapped target layers (output of layer): {sorted(pair.aux_layer_ids)}
- max_draft_len: {k}; tensor_parallel_size: {tp}; pipeline_parallel_size: {pp}

Triton: `eagle31-export export triton --bundle BUNDLE --out REPO --flavor trtllm` (BUNDLE: this folder).
"""
