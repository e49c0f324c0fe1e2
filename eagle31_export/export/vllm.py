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
from eagle31_export.formats.drafter_formats import SpeculatorsFormat, consumer_layout
from eagle31_export.formats.safetensors_io import atomic_output_dir, write_json

SPEC_FILE = "speculative_config.json"


def speculative_config(drafter_dir: str, k: int) -> dict[str, Any]:
    # "eagle3" also for EAGLE 3.1: the drafter's config.json carries fc_norm / norm_output.
    return {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": k}


def serve_command(target: str, spec: dict[str, Any], tp: int, pp: int, port: int = 8000) -> str:
    return (f"vllm serve {target} --host 127.0.0.1 --port {port} --tensor-parallel-size {tp} "
            f"--pipeline-parallel-size {pp} --speculative-config '{json.dumps(spec)}'")


def export_vllm(drafter: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, tp: int = 1,
                pp: int = 1, num_speculative_tokens: int = 3, copy: bool = False, force: bool = False) -> Path:
    if num_speculative_tokens < 1:
        raise UserError(f"--num-speculative-tokens must be >= 1 (got {num_speculative_tokens})")
    pair = checked_pair(drafter, target)
    check_parallel(pair.target_info, pair.config, tp, pp)
    out = Path(out).resolve()
    fmt, patch = consumer_layout("vllm", pair.config)
    with atomic_output_dir(out, force=force) as tmp:
        write_drafter_files(pair.checkpoint, tmp / "drafter", fmt, patch)
        target_path = str(out / "target") if copy else str(pair.target)
        if copy:
            copy_target(pair.target, tmp / "target")
        spec = speculative_config(str(out / "drafter"), num_speculative_tokens)
        write_json(tmp / SPEC_FILE, spec)
        write_json(tmp / BUNDLE_FILE, bundle_record("vllm", pair, "target" if copy else target_path,
                                                    num_speculative_tokens, tp, pp, drafter_format=fmt))
        before = list(output_to_before_layer(pair.aux_layer_ids))
        (tmp / "README.md").write_text(f"""# vLLM bundle (EAGLE {pair.config.eagle_version} drafter)

```
{serve_command(target_path, spec, tp, pp)}
```

- drafter: `{out / 'drafter'}` in the {fmt} layout
- tapped target layers: {before} in vLLM's before-layer numbering
  (= outputs of layers {list(pair.aux_layer_ids)})
- `--speculative-config` JSON: `{SPEC_FILE}`
{_speculators_note(fmt, pair.config)}""")
    return out


def _speculators_note(fmt: str, cfg) -> str:
    if fmt != SpeculatorsFormat.name or cfg.eagle_version != "3.1":
        return ""
    return ("- this drafter needs the speculators layout; vLLM read `fc_norm` / `norm_output` on that path "
            "only from PR #46488 on: use a release that includes it.\n")
