"""SGLang bundle: the drafter in the SpecForge layout and the exact `sglang.launch_server` flags.

SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` in OUTPUT-of-layer numbering and
adds one internally (it captures before layer i+1), except on DeepSeek-family targets, which guess
the numbering from the first id (`formats.drafter.engine_taps.sglang_ids` writes what they read
right); `fc_norm` (alias `use_aux_norm`) and `norm_output` at the top level. Chain drafting: topk 1, num_steps K, num_draft_tokens K+1.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

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
from eagle31_export.formats.drafter.engine_taps import sglang_ids
from eagle31_export.formats.drafter.formats import consumer_layout
from eagle31_export.formats.outputs import atomic_output_dir
from eagle31_export.formats.safetensors_io import write_json

ARGS_FILE = "sglang_args.json"


def server_args(target: str, drafter_dir: str, k: int, tp: int, pp: int, port: int = 30000) -> list[str]:
    return ["--model-path", target, "--host", "127.0.0.1", "--port", str(port), "--tp-size", str(tp),
            "--pp-size", str(pp), "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", drafter_dir,
            "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(k + 1)]


def export_sglang(drafter: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, tp: int = 1,
                  pp: int = 1, num_steps: int = 3, copy: bool = False, force: bool = False,
                  runtime_version: str | None = None) -> Path:
    if num_steps < 1:
        raise UserError(f"--num-steps must be >= 1 (got {num_steps})")
    pair = checked_pair(drafter, target)
    cfg = pair.config
    if cfg.norm_before_fc or cfg.num_layers > 1:
        raise UserError("SGLang's Eagle3 drafters have one layer and no norm_before_fc; "
                        "this drafter cannot be served by SGLang as it is (try vLLM)")
    check_parallel(pair.target_info, cfg, tp, pp)
    features = required_features(cfg, target_quant_format(pair.target))
    checked = check_runtime("sglang", features, runtime_version)  # docs/runtime-capabilities.md
    out = Path(out).resolve()
    fmt, patch = consumer_layout("sglang", cfg)
    # SGLang's own numbering for this target (a DeepSeek-family model guesses it from the first id)
    ids = sglang_ids(pair.aux_layer_ids, pair.target_info.model_type)
    if ids != pair.aux_layer_ids:
        patch = {**(patch or {}), "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}}
    # Paths relative to the bundle (the README's command runs from the bundle folder); only a
    # target referenced by path (an input) is absolute.
    target_path = "target" if copy else str(pair.target)
    with atomic_output_dir(out, force=force, inputs=[drafter, pair.target], references={"target": target_path}) as tmp:
        write_drafter_files(pair.checkpoint, tmp / "drafter", fmt, patch)
        kv = bundle_target(pair, "sglang", copy, tmp)
        args = server_args(target_path, "drafter", num_steps, tp, pp)
        write_json(tmp / ARGS_FILE, {"module": "sglang.launch_server", "args": args})
        write_json(tmp / BUNDLE_FILE, bundle_record("sglang", pair, target_path,
                                                    num_steps, tp, pp, drafter_format=fmt,
                                                    kv=kv, runtime_requirements=bundle_requirements("sglang", features, checked)))
        (tmp / "README.md").write_text(f"""# SGLang bundle (EAGLE {cfg.eagle_version} drafter)

From this folder (the drafter{" and the target" if copy else ""} are named relative to it):

```
python -m sglang.launch_server {shlex.join(args)}
```

- drafter: `drafter` in the {fmt} layout
- tapped target layers: outputs of layers {list(pair.aux_layer_ids)}; `eagle_config.eagle_aux_hidden_state_layer_ids`
  holds {list(ids)}, {"read by SGLang as outputs of layers (it adds one)" if ids == pair.aux_layer_ids else
  "before-layer ids: SGLang's " + pair.target_info.model_type + " model reads a list not starting at 1 that way"}
- chain drafting: {num_steps} steps, top-k 1, {num_steps + 1} draft tokens per verification
{readme_section("sglang", features, checked)}""")
    return out
