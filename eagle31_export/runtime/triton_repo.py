"""Triton model repositories from a serving bundle.

`trtllm` flavour: TensorRT-LLM's LLM-API repository layout (`tensorrt_llm/config.pbtxt`,
`1/model.py`, `1/model.yaml` with `backend: pytorch`, parallel sizes, `speculative_config`,
`triton_config`). Needs tensorrt_llm and a GPU where it is served.

`cpu` flavour: python-backend models that serve the pair through this package's speculation
loop, on any machine:
    eagle31_speculate/   decoupled: streams one response per round, statistics in the last
    eagle31_generate/    plain request/response front (HTTP or gRPC `infer`), via Triton BLS
Both flavours hold the drafter (the `cpu` flavour in the canonical speculators layout with explicit
taps, the `trtllm` flavour as the bundle has it) and the target next to it: a symlink to the
target the bundle names (default), or a copy (`copy_target`, `--copy-target`): a repository
that can be moved to another machine. Every path in `model.yaml` and `pair.json` is relative to
the folder holding that file (`target`, `drafter`), so the repository can be moved or renamed;
no file in it names the path it was written under.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from eagle31_export.errors import UserError
from eagle31_export.export.bundle import copy_target as copy_checkpoint
from eagle31_export.export.bundle import read_bundle, read_bundle_drafter, write_drafter_files
from eagle31_export.formats.outputs import atomic_output_dir, check_consumed, check_output
from eagle31_export.formats.pair import read_pair
from eagle31_export.formats.safetensors_io import write_json
from eagle31_export.reference.speculate import SAMPLING_RULES
from eagle31_export.runtime.registry import DEFAULT_SERVING_RUNTIME, RUNTIMES, runtime_named
from eagle31_export.runtime.triton_names import GENERATE_MODEL, SPECULATE_MODEL, TRTLLM_MODEL

FLAVORS = ("trtllm", "cpu")
# Code that runs inside Triton: copied into the repository, never imported here.
MODELS = Path(__file__).parent / "triton_models"
STATISTICS = Path(__file__).parents[1] / "reference" / "statistics.py"

# (name, Triton type, dims, optional)
CPU_INPUTS = [
    ("input_ids", "TYPE_INT64", [-1], True),
    ("text_input", "TYPE_STRING", [1], True),
    ("max_tokens", "TYPE_INT32", [1], True),
    ("num_draft_tokens", "TYPE_INT32", [1], True),
    ("stop_token_ids", "TYPE_INT64", [-1], True),
    ("temperature", "TYPE_FP32", [1], True),
    ("seed", "TYPE_INT64", [1], True),
    ("top_p", "TYPE_FP32", [1], True),
    ("top_k", "TYPE_INT32", [1], True),
    ("sampling_rule", "TYPE_STRING", [1], True),
]
CPU_OUTPUTS = [
    ("output_ids", "TYPE_INT64", [-1]),
    ("text_output", "TYPE_STRING", [1]),
    ("accepted_per_step", "TYPE_INT32", [-1]),
    ("acceptance_length", "TYPE_FP32", [1]),
    ("acceptance_rate", "TYPE_FP32", [1]),
    ("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    ("total_draft_tokens", "TYPE_INT32", [1]),
    ("draft_tokens", "TYPE_INT64", [-1, -1]),
    ("batched_calls", "TYPE_INT64", [-1, 4]),  # per batched call the request took part in: id, size, prefill, in flight
]
TRTLLM_INPUTS = [
    ("text_input", "TYPE_STRING", [-1], False),
    ("streaming", "TYPE_BOOL", [1], True),
    ("sampling_param_max_tokens", "TYPE_INT32", [1], True),
    ("sampling_param_temperature", "TYPE_FP32", [1], True),
    ("sampling_param_top_k", "TYPE_INT32", [1], True),
    ("sampling_param_top_p", "TYPE_FP32", [1], True),
    ("sampling_param_seed", "TYPE_UINT64", [1], True),
]
TRTLLM_OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("output_ids", "TYPE_INT32", [-1]),
    ("finish_reason", "TYPE_STRING", [-1]),
    ("acceptance_rate", "TYPE_FP32", [1]),
    ("total_accepted_draft_tokens", "TYPE_INT32", [1]),
    ("total_draft_tokens", "TYPE_INT32", [1]),
    ("acceptance_length", "TYPE_FP32", [1]),
]


def pbtxt(name: str, inputs: list, outputs: list, decoupled: bool | None, max_batch_size: int | None,
          parameters: dict[str, str] | None = None, comment: str = "") -> str:
    """A python-backend config.pbtxt (protobuf text format of inference.ModelConfig)."""
    lines = [f"# {line}" for line in comment.splitlines()] + [f'name: "{name}"', 'backend: "python"']
    if max_batch_size is not None:
        lines.append(f"max_batch_size: {max_batch_size}")
    if decoupled is not None:
        lines.append(f"model_transaction_policy {{ decoupled: {'true' if decoupled else 'false'} }}")

    def tensor(n, t, dims, optional=False):
        opt = " optional: true" if optional else ""
        return f'  {{ name: "{n}" data_type: {t} dims: [ {", ".join(map(str, dims))} ]{opt} }}'

    lines += ["input ["] + [",\n".join(tensor(*i) for i in inputs)] + ["]"]
    lines += ["output ["] + [",\n".join(tensor(*o) for o in outputs)] + ["]"]
    lines.append("instance_group [ { kind: KIND_CPU count: 1 } ]")
    for key, value in (parameters or {}).items():
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


# Where each flavour keeps the drafter and the target, relative to the repository; the file
# naming them (model.yaml, pair.json) sits in the same folder and names them `drafter`, `target`.
CHECKPOINTS = {"trtllm": f"{TRTLLM_MODEL}/1", "cpu": f"{SPECULATE_MODEL}/1/pair"}


def export_triton(bundle: str | os.PathLike, out: str | os.PathLike, flavor: str, force: bool = False,
                  runtime: str = DEFAULT_SERVING_RUNTIME, copy_target: bool = False) -> Path:
    """Write the repository to `out` (atomically). The target is linked into it, or copied with
    `copy_target`."""
    if flavor not in FLAVORS:
        raise UserError(f"unknown --flavor {flavor!r}; choose one of {', '.join(FLAVORS)}")
    record = read_bundle(bundle)
    check_consumed(bundle)  # a changed byte is refused here, never copied under a fresh manifest
    if flavor == "trtllm" and record["kind"] != "trtllm":
        raise UserError(f"--flavor trtllm needs a bundle from `export trtllm`; {bundle} is a {record['kind']} bundle")
    bundle = Path(bundle).resolve()
    inputs = [bundle, record["target"]]
    out = check_output(out, force, inputs)
    target = f"{CHECKPOINTS[flavor]}/target"
    with atomic_output_dir(out, force=force, inputs=inputs, references={"target": target}) as tmp:
        place_target(Path(record["target"]), tmp / target, copy_target)
        if flavor == "trtllm":
            write_trtllm_repo(record, bundle, tmp)
        else:
            write_cpu_repo(record, bundle, tmp, runtime)
    return out


def place_target(target: Path, dest: Path, copy: bool) -> None:
    """The target inside the repository: a copy, or a symlink to the absolute path of the input."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if copy:
        copy_checkpoint(target, dest)
    else:
        dest.symlink_to(target.resolve(), target_is_directory=True)


def write_trtllm_repo(record: dict[str, Any], bundle: Path, repo: Path) -> None:
    model = repo / TRTLLM_MODEL
    (model / "1").mkdir(parents=True, exist_ok=True)
    options = yaml.safe_load((bundle / record.get("llm_api", "llm_api.yaml")).read_text())
    shutil.copytree(record["drafter"], model / "1" / "drafter", ignore=shutil.ignore_patterns(".*"))
    # Relative to model.yaml's folder: model.py runs the LLM from there.
    options.setdefault("speculative_config", {})["speculative_model"] = "drafter"
    model_yaml = {
        "model": "target",
        "backend": "pytorch",
        "tensor_parallel_size": options.pop("tensor_parallel_size", record["tensor_parallel_size"]),
        "pipeline_parallel_size": options.pop("pipeline_parallel_size", record["pipeline_parallel_size"]),
        **options,  # speculative_config (the drafter next to model.yaml), return_perf_metrics
        # max_batch_size 0: one prompt per request, as TensorRT-LLM's own LLM-API model; batching
        # happens inside the LLM (in-flight batching), not in Triton.
        "triton_config": {"max_batch_size": 0, "decoupled": True},
    }
    (model / "1" / "model.yaml").write_text(yaml.safe_dump(model_yaml, sort_keys=False))
    shutil.copyfile(MODELS / "trtllm_model.py", model / "1" / "model.py")
    shutil.copyfile(STATISTICS, model / "1" / "eagle31_statistics.py")
    (model / "config.pbtxt").write_text(pbtxt(
        TRTLLM_MODEL, TRTLLM_INPUTS, TRTLLM_OUTPUTS, decoupled=None, max_batch_size=None,
        comment="max_batch_size and decoupled come from 1/model.yaml (triton_config) at load time."))
    (repo / "README.md").write_text(_trtllm_readme(record, repo))


def write_cpu_repo(record: dict[str, Any], bundle: Path, repo: Path, runtime: str = DEFAULT_SERVING_RUNTIME) -> None:
    """A python-backend repository serving the pair through the speculation loop, on ONNX Runtime
    (the exported graphs, written into the repository) or on the PyTorch reference."""
    serving = runtime_named(runtime)
    if not serving.servable:
        servable = [name for name, r in RUNTIMES.items() if r.servable]
        raise UserError(f"--runtime {runtime} cannot run inside the Triton cpu repository; choose one of "
                        f"{', '.join(servable)}")
    ckpt = read_bundle_drafter(record)
    try:
        read_pair(ckpt, record["target"])
    except UserError as err:
        raise UserError(f"bundle {bundle}: {err}") from None
    speculate = repo / SPECULATE_MODEL
    pair = speculate / "1" / "pair"
    write_drafter_files(ckpt, pair / "drafter", "speculators")
    artifacts = serving.prepare_servable(pair, pair / "target")
    # Paths relative to pair.json's folder (runtime/triton_service.py: load_pair_dir).
    write_json(pair / "pair.json", {"target": "target", "drafter": "drafter", "dtype": "fp32",
                                    "runtime": runtime,
                                    "artifacts": artifacts.relative_to(pair).as_posix() if artifacts else None,
                                    "max_draft_len": record["max_draft_len"], "bundle_kind": record["kind"]})
    shutil.copyfile(MODELS / "cpu_model.py", speculate / "1" / "model.py")
    streaming = ("streaming", "TYPE_BOOL", [1], True)
    (speculate / "config.pbtxt").write_text(pbtxt(
        SPECULATE_MODEL, CPU_INPUTS + [streaming], CPU_OUTPUTS, decoupled=True, max_batch_size=0,
        parameters={"pair_dir": "pair", "default_max_tokens": "64"},
        comment=f"EAGLE speculation loop on {runtime}; decoupled: stream with gRPC."))
    generate = repo / GENERATE_MODEL
    (generate / "1").mkdir(parents=True)
    shutil.copyfile(MODELS / "generate_model.py", generate / "1" / "model.py")
    (generate / "config.pbtxt").write_text(pbtxt(
        GENERATE_MODEL, CPU_INPUTS, CPU_OUTPUTS, decoupled=False, max_batch_size=0,
        parameters={"speculation_model": SPECULATE_MODEL},
        comment=f"Plain request/response front for {SPECULATE_MODEL} (Triton BLS)."))
    (repo / "README.md").write_text(_cpu_readme(record, repo, runtime))


def _cpu_readme(record: dict[str, Any], repo: Path, runtime: str) -> str:
    return f"""# Triton repository (cpu flavour): EAGLE speculation loop on {runtime}

Serve (REPO: this folder): `eagle31-export serve REPO --port 8000 --grpc-port 8001` (Triton's python backend runs the
interpreter first on PATH and ignores PYTHONPATH; `serve` puts this environment's first, so the installed
`eagle31_export` is importable). On a small CPU machine set `OMP_NUM_THREADS` to the cores you give the model.

- `{SPECULATE_MODEL}`: decoupled; with `streaming` true one response per speculation round
  (`output_ids` = the tokens that round committed), the last one with the statistics.
  Streaming needs gRPC (`tritonclient.grpc`, `start_stream` / `async_stream_infer`).
- `{GENERATE_MODEL}`: plain `infer` over HTTP or gRPC; one response with everything.

Inputs: `input_ids` INT64 [-1] or `text_input` STRING [1] (only with a tokenizer next to the target),
`max_tokens` INT32, `num_draft_tokens` INT32 (default {record['max_draft_len']}), `stop_token_ids` INT64 [-1],
`temperature` FP32 (0: greedy, the default; else sampling, by `sampling_rule`), `seed` INT64, and, when
sampling: `top_p` FP32 (keep the smallest set of tokens holding this much of the mass; default 1.0),
`top_k` INT32 (keep the K most likely tokens; default 0 = all), `sampling_rule` STRING (default
`rejection`; {_rules()}).
Outputs: `output_ids`, `text_output` (with a tokenizer), `accepted_per_step`, `acceptance_length` (tau),
`acceptance_rate`, `total_accepted_draft_tokens`, `total_draft_tokens`, `draft_tokens` [rounds, depth],
and, where the runtime batches the requests in flight, `batched_calls` [calls, 4]: each batched backend
call the request took part in (id, size, prefill 0/1, sequences in flight).
Greedy decoding: the tokens equal the target's own greedy output. Sampling with a seed is reproducible:
the same seed gives the same tokens as `eagle31-export speculate --temperature T --seed S` (at the default
`top_p`, `top_k` and `sampling_rule`; the same loop otherwise, `reference/speculate.py: Sampling`).

Every request is checked before anything runs. It must send exactly one of `input_ids` (at least one
id, each in 0..vocab_size-1 of the target) and `text_input` (UTF-8); `max_tokens` >= 1 (default 64),
with prompt length + `max_tokens` + `num_draft_tokens` - 1 within the positions the exported graphs'
rope tables hold (the target's `max_position_embeddings` unless exported with `--max-positions`);
`num_draft_tokens` from 1 to max(16, the default); `temperature` finite and >= 0; `seed` an integer;
`top_p` in (0, 1]; `top_k` >= 0; `sampling_rule` one of {_rule_names()};
every `stop_token_ids` id in the vocabulary.
Errors: a request that breaks a rule gets status INVALID_ARG (HTTP 400, gRPC INVALID_ARGUMENT) with
one line naming the input and the allowed range; wrong types, shapes or unknown inputs are refused
by Triton itself, also with 400. Any other failure is HTTP 500 (gRPC INTERNAL) with one generic
line; its detail (e.g. an ONNX Runtime message) is only in the server log. On a gRPC stream an
error arrives as the stream's error message (streams carry no status code). The server keeps
serving after either.

Checkpoints: the drafter is copied into `{SPECULATE_MODEL}/1/pair/drafter` (speculators layout, tapped
layers explicit); the target is `{SPECULATE_MODEL}/1/pair/target` ({_target_note(repo / CHECKPOINTS['cpu'])}).
`pair/pair.json` names both relative to its folder: the repository can be moved or renamed.
Runtime: `{runtime}` ({RUNTIMES[runtime].help}); `pair/pair.json` names it and the artifacts it runs
(`export triton --runtime {'|'.join(n for n, r in RUNTIMES.items() if r.servable)}`).
"""


def _rules() -> str:
    return "; ".join(f"`{name}`: {text}" for name, text in SAMPLING_RULES.items())


def _rule_names() -> str:
    return ", ".join(f"`{name}`" for name in SAMPLING_RULES)


def _trtllm_readme(record: dict[str, Any], repo: Path) -> str:
    return f"""# Triton repository (trtllm flavour): TensorRT-LLM LLM API, PyTorch backend, EAGLE-3 speculation

Needs a GPU machine with `tensorrt_llm` (e.g. NVIDIA's `tritonserver:<xx.yy>-trtllm-python-py3` container);
REPO is this folder:

```
tritonserver --model-repository REPO --http-address 127.0.0.1 --grpc-address 127.0.0.1
```

`{TRTLLM_MODEL}/1/model.yaml` holds the LLM arguments (`model: target`, `backend: pytorch`,
tensor/pipeline parallel sizes, `speculative_config` with the drafter and the tapped layers) and
`triton_config` (decoupled: stream with gRPC). Tensor names follow TensorRT-LLM's own LLM-API model:
`text_input`, `streaming`, `sampling_param_*` in; `text_output`, `acceptance_rate`,
`total_accepted_draft_tokens`, `total_draft_tokens` (and `acceptance_length`) out.

Checkpoints: `{TRTLLM_MODEL}/1/drafter` (copied from the bundle) and `{TRTLLM_MODEL}/1/target`
({_target_note(repo / CHECKPOINTS['trtllm'])}). `model.yaml` names them relative to its own folder,
and `model.py` runs the LLM from that folder: the repository can be moved or renamed.
"""


def _target_note(folder: Path) -> str:
    link = folder / "target"
    if link.is_symlink():
        return (f"a symlink to `{os.readlink(link)}`; on another machine, point it at the target there, "
                "or export with --copy-target")
    return "a copy of the bundle's target: the repository is self-contained"


def load_repository_configs(repo: str | os.PathLike) -> dict[str, Any]:
    """Every model's config.pbtxt parsed as Triton's ModelConfig protobuf (needs tritonclient)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    configs = {}
    for path in sorted(Path(repo).glob("*/config.pbtxt")):
        configs[path.parent.name] = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    return configs
