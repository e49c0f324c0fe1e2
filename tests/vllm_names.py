"""What a vLLM release registers on /metrics and accepts in --speculative-config, read from its source with
`ast` (no vLLM import): `python tests/vllm_names.py SITE` prints the extract for the unzipped wheel at SITE
(`pip download vllm==0.33.0 --no-deps`, unzipped), which tests/data/vllm-0.33.0-names.json holds.

- metrics: every `name="vllm:..."` given to a `_counter_cls` / `_gauge_cls` / `_histogram_cls` call, and every
  "vllm:..." string in a (name, documentation) tuple of a list those calls are built from (counter_specs),
  in vllm/v1/spec_decode/metrics.py and vllm/v1/metrics/loggers.py; the kind from the call (`_counter_cls`
  on the list's loop); `vllm:cache_config_info` is set by `log_metrics_info` as `name = "vllm:..."` before
  a `_gauge_cls` call: read as a gauge.
- speculative_config_fields: the annotated fields of `class SpeculativeConfig` in vllm/config/speculative.py.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

KINDS = {"_counter_cls": "counter", "_gauge_cls": "gauge", "_histogram_cls": "histogram"}
METRIC_FILES = ("vllm/v1/spec_decode/metrics.py", "vllm/v1/metrics/loggers.py")


def metrics(source: str) -> dict[str, str]:
    """name -> kind of every metric the file registers by a literal name."""
    tree, found = ast.parse(source), {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr in KINDS]
        for call in calls:
            kind = KINDS[call.func.attr]
            for kw in call.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant) and str(kw.value.value).startswith("vllm:"):
                    found[kw.value.value] = kind
                elif kw.arg == "name" and isinstance(kw.value, ast.Name):  # name = "vllm:..." assigned before
                    for node in ast.walk(fn):
                        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == kw.value.id
                                                                 for t in node.targets)
                                and isinstance(node.value, ast.Constant)
                                and str(node.value.value).startswith("vllm:")):
                            found[node.value.value] = kind
        spec_kinds = {KINDS[c.func.attr] for c in calls if any(kw.arg == "name" and isinstance(kw.value, ast.Name)
                                                                for kw in c.keywords)}
        for node in ast.walk(fn):  # counter_specs = [("vllm:...", doc), ...]
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
                    and any(isinstance(t, ast.Name) and t.id.endswith("_specs") for t in node.targets)):
                for item in node.value.elts:
                    if (isinstance(item, ast.Tuple) and isinstance(item.elts[0], ast.Constant)
                            and str(item.elts[0].value).startswith("vllm:") and len(spec_kinds) == 1):
                        found[item.elts[0].value] = next(iter(spec_kinds))
    return found


def speculative_fields(source: str) -> list[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == "SpeculativeConfig":
            return sorted(s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return []


def extract(site: Path) -> dict:
    found = {}
    for name in METRIC_FILES:
        found.update(metrics((site / name).read_text()))
    return {"metrics": dict(sorted(found.items())),
            "speculative_config_fields": speculative_fields((site / "vllm/config/speculative.py").read_text())}


if __name__ == "__main__":
    print(json.dumps(extract(Path(sys.argv[1])), indent=1))
