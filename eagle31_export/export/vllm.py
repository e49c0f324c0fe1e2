"""vLLM bundle: the drafter in a layout vLLM's `eagle3` method reads, plus `--speculative-config`.

vLLM counts tapped layers "before layer i" and reads them from the drafter's TOP-LEVEL
`eagle_aux_hidden_state_layer_ids` (some releases fall back to `eagle_config`'s list and read
it in the same numbering, which is why no `eagle_config` list is written here). The drafter is
written in the original EAGLE layout (`midlayer.*`, `fc_norm.{i}`, top-level `fc_norm` /
`norm_output` that vLLM's llama_eagle3 reads); drafters that layout cannot hold (several layers,
`norm_before_fc`) go in the speculators layout. MLA drafters get vLLM's
`Eagle3DeepseekV2ForCausalLM` architecture. The choice is `formats.drafter_formats.consumer_layout`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagle31_export.config import output_to_before_layer
from eagle31_export.export.bundle import (
    BUNDLE_FILE,
    bundle_record,
    check_parallel,
    checked_pair,
    copy_target,
    write_drafter_files,
)
from eagle31_export.errors import UserError
from eagle31_export.export.capabilities import (
    bundle_requirements,
    check_runtime,
    readme_section,
    required_features,
    target_quant_format,
)
from eagle31_export.export.speculators_layout import (
    converter_note,
    speculators_checkpoint,
    vllm_layout,
    vllm_runtime_key,
)
from eagle31_export.formats.drafter_formats import SpeculatorsFormat, consumer_layout
from eagle31_export.formats.outputs import atomic_output_dir
from eagle31_export.formats.safetensors_io import write_json

SPEC_FILE = "speculative_config.json"


def speculative_config(drafter_dir: str, k: int) -> dict[str, Any]:
    # "eagle3" also for EAGLE 3.1: the drafter's config.json carries fc_norm / norm_output.
    return {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": k}


def serve_command(target: str, spec: dict[str, Any], tp: int, pp: int, port: int = 8000) -> str:
    return (f"vllm serve {target} --host 127.0.0.1 --port {port} --tensor-parallel-size {tp} "
            f"--pipeline-parallel-size {pp} --speculative-config '{json.dumps(spec)}'")


def export_vllm(drafter: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, tp: int = 1,
                pp: int = 1, num_speculative_tokens: int = 3, copy: bool = False, force: bool = False,
                runtime_version: str | None = None, layout: str = "auto") -> Path:
    if num_speculative_tokens < 1:
        raise UserError(f"--num-speculative-tokens must be >= 1 (got {num_speculative_tokens})")
    pair = checked_pair(drafter, target)
    check_parallel(pair.target_info, pair.config, tp, pp)
    out = Path(out).resolve()
    fmt, patch = vllm_layout(layout, pair.config), consumer_layout("vllm", pair.config)[1]
    runtime = vllm_runtime_key(fmt)
    features = required_features(pair.config, target_quant_format(pair.target))
    checked = check_runtime(runtime, features, runtime_version)  # docs/runtime-capabilities.md
    # speculators' own loader needs the target as verifier and the embeddings in the folder
    ckpt = speculators_checkpoint(pair.checkpoint, pair.target) if fmt == SpeculatorsFormat.name else pair.checkpoint
    # Paths relative to the bundle (the README's command runs from the bundle folder); only a
    # target referenced by path (an input) is absolute.
    target_path = "target" if copy else str(pair.target)
    with atomic_output_dir(out, force=force, inputs=[drafter, pair.target], references={"target": target_path}) as tmp:
        write_drafter_files(ckpt, tmp / "drafter", fmt, patch)
        if copy:
            copy_target(pair.target, tmp / "target")
        spec = speculative_config("drafter", num_speculative_tokens)
        write_json(tmp / SPEC_FILE, spec)
        write_json(tmp / BUNDLE_FILE, bundle_record("vllm", pair, target_path,
                                                    num_speculative_tokens, tp, pp, drafter_format=fmt,
                                                    runtime_requirements=bundle_requirements(runtime, features, checked)))
        before = list(output_to_before_layer(pair.aux_layer_ids))
        (tmp / "README.md").write_text(f"""# vLLM bundle (EAGLE {pair.config.eagle_version} drafter)

From this folder (the drafter{" and the target" if copy else ""} are named relative to it):

```
{serve_command(target_path, spec, tp, pp)}
```

- drafter: `drafter` in the {fmt} layout
- tapped target layers: {before} in vLLM's before-layer numbering
  (= outputs of layers {list(pair.aux_layer_ids)})
- `--speculative-config` JSON: `{SPEC_FILE}`
{_speculators_note(fmt, pair.config)}{readme_section(runtime, features, checked)}{converter_note(pair.config, str(drafter), str(pair.target))}""")
    return out


def _speculators_note(fmt: str, cfg) -> str:
    if fmt != SpeculatorsFormat.name or cfg.eagle_version != "3.1":
        return ""
    return ("- this drafter needs the speculators layout; vLLM read `fc_norm` / `norm_output` on that path "
            "only from PR #46488 on: use a release that includes it.\n")
