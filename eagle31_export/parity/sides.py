"""Which two speculation setups a parity run compares, and the prompts it runs.

The reference side is always the PyTorch pair (drafter + target checkpoints). The runtime side
comes from the runtime registry (`runtime/registry.py`), given the same checkpoints plus the
exported artifacts (BUNDLE) or a server URL; e.g. `reference` over an exported drafter checks
that the export reads back as the same drafter, `onnxruntime` runs an `export onnx` folder
(exported on the fly when none is given), `triton` asks a running server.
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from eagle31_export.errors import UserError
from eagle31_export.formats.outputs import MANIFEST, check_artifacts, check_consumed
from eagle31_export.formats.drafter.checkpoint import read_drafter
from eagle31_export.formats.prompts import read_prompts
from eagle31_export.formats.target.checkpoint import read_target_info
from eagle31_export.parity.compare import MODES, ParityReport, Thresholds, run_parity, run_parity_in_turn
from eagle31_export.parity.concurrency import check_repeat
from eagle31_export.parity.context import (
    PROMPTS_PER_LENGTH, context_prompts, context_rows, long_context_failure, served_drafter, served_rope_differences,
)
from eagle31_export.parity.prompts import bundle_sources, capture_prompts, default_prompts  # noqa: F401
from eagle31_export.progress import Phases
from eagle31_export.reference.speculate import Sampling
from eagle31_export.runtime.registry import LoadOptions, PairSource, load_speculator, resolve_device, runtime_named


PER_DEPTH_POSITIONS = 8  # positions per prompt of parity's per-depth measurement (parity/diagnose.py)
# runtimes that ask a server at --url what dtype it computes in, where --runtime-dtype is not given
ASKS_SERVER_DTYPE = ("vllm",)


def check_bundle(bundle: Path, drafter: Path | None, target: Path | None) -> None:
    """Refuse exported artifacts that changed since they were written, before loading them: every
    file by sha256, and (by size and header) the checkpoints the record names that this run takes
    from it, i.e. those not given with --drafter / --target. Folders this tool did not write (a
    plain drafter checkpoint) have nothing to check against."""
    ours = any((bundle / name).is_file() for name in (MANIFEST, "graphs.json", "bundle.json"))
    if ours:
        # an ONNX export without a target graph runs on the reference target it was exported for
        # (runtime/onnxruntime.py), whatever --target the reference side takes
        verifies = (bundle / "graphs.json").is_file() and "no_target_graph" in json.loads(
            (bundle / "graphs.json").read_text())
        check_artifacts(bundle, references=[role for role, given in (("drafter", drafter), ("target", target))
                                            if given is None or (role == "target" and verifies)])


def check_parity(runtime: str, bundle: Path | None, drafter: Path | None, target: Path | None, url: str | None,
                 prompts_file: Path | None, depth: int, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 progress=None, mode: str | None = None, capture: Path | None = None,
                 act_quant: bool | None = None, device: str = "cpu", runtime_options: dict | None = None,
                 concurrency: tuple[int, ...] = (1,), repeat: int = 0, top_p: float = 1.0, top_k: int = 0,
                 sampling_rule: str | None = None, context: tuple[int, ...] = (),
                 per_length: int = PROMPTS_PER_LENGTH) -> ParityReport:
    """The whole parity check: both sides from the registry, the prompts, the comparison.
    At `temperature` > 0: `top_p`, `top_k` and `sampling_rule` (reference/speculate.py: SAMPLING_RULES;
    None: the runtime's own) say what both sides sample by.
    `progress(phase, done, total)` hears of each phase (load_reference, load_runtime, compare per
    prompt, per_depth; eagle31_export/progress.py), whose seconds land in `report.timings`. With
    `capture` (instead of `target`) both sides read the target's outputs from it and the prompts are
    the captured ones. `act_quant`: an NVFP4 target computes W4A4 (its inputs NVFP4-quantized too) on
    both sides; None: as the runtime computes where it tells (vllm: `served_activations`), else not. `device` (cpu, cuda, auto): where the reference pair computes, on both sides.
    `runtime_options`: LoadOptions fields for the runtime side only (vllm: `dtype` of the engine, `vllm`,
    `port`, `engine_timeout`); the reference always computes in fp32. `dtype` None: not stated, which
    a vLLM server at `url` is asked (runtime/vllm_runtime.py: served_dtype); everywhere else fp32.
    `concurrency`: the levels C at which the runtime also serves every prompt with C requests in
    flight (parity/concurrency.py); `repeat`: every level sent that many more times, each send
    compared with the first (with the default prompts, each then opens with the same
    REPEAT_OPENING tokens, so that an engine's prefix cache has whole blocks to serve). `context`: prompt
    lengths in tokens (parity/context.py): `per_length` prompts are built to each, and the report
    compares acceptance by length."""
    runtime_named(runtime)  # an unknown name fails before anything loads
    sampling = _sampling_args(temperature, top_p, top_k, sampling_rule)
    resolve_device(device, runtime)  # and so does a device either side cannot use
    check_repeat(repeat)
    runtime_options = dict(runtime_options or {})
    if "dtype" in runtime_options and runtime_options["dtype"] is None and not (url and runtime in ASKS_SERVER_DTYPE):
        runtime_options["dtype"] = torch.float32
    phases = Phases.of(progress)
    if bundle is not None and not bundle.is_dir():
        raise UserError(f"{bundle}: no such bundle folder")
    if bundle is not None:
        check_bundle(bundle, drafter, target or capture)
        check_served_drafter(bundle)
    check_consumed(capture)  # a capture is an output of ours too: a changed byte is refused before it is read
    if context and (capture is not None or prompts_file is not None):
        raise UserError("--context builds its own prompts to each length: drop --prompts and --capture, or --context")
    if capture is not None:
        if act_quant:
            raise UserError("--act-quant changes how the target computes; a capture holds what it computed: "
                            "drop --act-quant, or give --target")
        return _parity_on_capture(runtime, bundle, drafter or (bundle_sources(bundle)[0] if bundle else None), capture,
                                  url, prompts_file, depth, max_new_tokens, temperature, seed, phases, mode,
                                  target, device, runtime_options, concurrency, repeat)
    src_drafter, src_target = bundle_sources(bundle) if bundle else (None, None)
    drafter, target = drafter or src_drafter, target or src_target
    if drafter is None or target is None:
        raise UserError("parity needs the reference pair: pass --drafter D --target T "
                        "(or a bundle that records where it was exported from)")
    info = read_target_info(target)
    vocab = info.vocab_size
    # under load, enough prompts by default that the highest level really has C requests in flight
    count = max(8, *concurrency)
    prompts = read_prompts(prompts_file, target, vocab) if prompts_file else default_prompts(vocab, count)
    if context:
        room = max_new_tokens + depth + 1
        prompts = context_prompts(target, context, vocab, info.max_position_embeddings, room, per_length)
        runtime_options["max_context"] = context[-1] + room
    elif repeat and not prompts_file:
        prompts = _with_opening(prompts, vocab, info.max_position_embeddings,
                                max_new_tokens + depth + 1)
    activations = _activations(runtime, target, url, act_quant, runtime_options)
    # the reference reads NVFP4 scales as the engine compared with does (formats/nvfp4/scheme.py: NVFP4_SEMANTICS)
    options = LoadOptions(dtype=torch.float32, act_quant=bool(activations and activations["fp4"]), device=device,
                          nvfp4_semantics=runtime_named(runtime).nvfp4_semantics)
    # --context: acceptance by length is the measurement; the per-depth one (teacher-forced, both sides)
    # would run again over every long prompt and is left to a parity run at short prompts
    report = _run_sides(runtime, PairSource.of(drafter, target), PairSource.of(drafter, target, bundle, url),
                        options, prompts, depth, max_new_tokens, temperature, seed, mode, phases, runtime_options,
                        concurrency, repeat, sampling, per_depth_positions=0 if context else PER_DEPTH_POSITIONS)
    report.activations = activations
    if context:
        report.context = context_rows(report.rows, context, report.failures)
        failure = long_context_failure(report.context)
        report.failures[:0] = [failure] if failure else []
    if report.failures:
        report.failures[:0] = _served_rope_failures(bundle, drafter)
        report.inspect_names = _inspect_names(bundle)
    return report


def _inspect_names(bundle: Path | None) -> list[str]:
    """A failing serving bundle: what `inspect` (and `verify`) say of the drafter it hands its engine, which
    names a cause the acceptance can only point at (a drafter's own embed_tokens, a sliding window, a flag
    left to each engine's default: docs/silent-bugs.md)."""
    if served_drafter(bundle) is None:
        return []
    from eagle31_export.inspection import bundle_lints

    return bundle_lints(bundle)


def check_served_drafter(bundle: Path) -> None:
    """A serving bundle whose drafter our reader reads but refuses for its values (a smaller draft vocabulary
    without d2t, NaN / Inf weights: formats/drafter/checkpoint.py), which an engine serves without a word:
    refused before either side loads, not after a whole run. What the reader cannot read at all (shapes,
    weights without their flag) is left to the engine, which refuses it in its own words."""
    served = served_drafter(bundle)
    if served is None:
        return
    try:
        problems = read_drafter(served, strict=False).problems
    except UserError:
        return
    if problems:
        more = f" ({len(problems) - 1} more: `eagle31-export inspect {served}`)" if len(problems) > 1 else ""
        raise UserError(f"{served}: {problems[0]}{more}; the bundle's engine would serve this drafter without a word, "
                        "so parity refuses it before loading either side")


def _activations(runtime: str, target: Path, url: str | None, stated: bool | None,
                 runtime_options: dict) -> dict | None:
    """What activation precision both sides compute, and how that is known: as the runtime computes
    where it tells (a vLLM engine: its target's quantization config and NVFP4 kernel), else as stated."""
    if runtime == "vllm":
        from eagle31_export.runtime.vllm_runtime import served_activations

        return served_activations(target, url, stated, runtime_options.get("vllm"))
    if stated:
        return {"fp4": True, "basis": "stated", "how": "--act-quant"}
    return None


def _served_rope_failures(bundle: Path | None, drafter: Path) -> list[str]:
    """A failing bundle whose drafter rotates or bounds positions unlike the reference: said first,
    since tokens differ from the first draft step on and would read as a tapped-layer or fc fault."""
    served = served_drafter(bundle)
    if served is None:
        return []
    try:
        ours = read_drafter(served, strict=False).config
    except UserError:
        return []  # the engine served what our reader cannot read: its rope is not ours to say
    found = served_rope_differences(ours, read_drafter(drafter).config)
    return [f"rope or positions: {d} (the bundle's {served.name}/config.json): the runtime rotates or bounds "
            "positions unlike the reference, which shows most at long context" for d in found]


def _sampling_args(temperature: float, top_p: float, top_k: int, rule: str | None) -> dict:
    """What run_parity samples by; refused in one line where it makes no sense."""
    if temperature == 0 and (top_p != 1 or top_k or rule):
        raise UserError("--top-p, --top-k and --sampling-rule apply to sampling: give --temperature above 0")
    if temperature:
        Sampling(temperature, top_p, top_k, rule or "rejection")  # refuses an unknown rule or a bad cut
    return {"top_p": top_p, "top_k": top_k, "sampling_rule": rule}


# --repeat with the default prompts: each opens with the same seeded tokens, two of the prefix-cache
# blocks of vLLM's CPU build (128 tokens; 16 on its GPU builds), so later sends, and requests in flight
# beside the one that first computed them, are served from cached blocks
REPEAT_OPENING = 256


def _with_opening(prompts: list[list[int]], vocab: int, context: int | None, room: int) -> list[list[int]]:
    """The prompts behind one shared opening of REPEAT_OPENING tokens, where the target's context fits it."""
    if context is not None and REPEAT_OPENING + max(map(len, prompts)) + room > context:
        return prompts
    rng = random.Random(REPEAT_OPENING)
    opening = [rng.randrange(vocab) for _ in range(REPEAT_OPENING)]
    return [opening + p for p in prompts]


def _parity_on_capture(runtime: str, bundle: Path | None, drafter: Path | None, capture_dir: Path, url: str | None,
                       prompts_file: Path | None, depth: int, max_new_tokens: int, temperature: float, seed: int,
                       phases: Phases, mode: str | None, target: Path | None, device: str,
                       runtime_options: dict | None = None, concurrency: tuple[int, ...] = (1,),
                       repeat: int = 0) -> ParityReport:
    from eagle31_export.formats.capture import Capture

    if target is not None:
        raise UserError("pass --target or --capture, not both")
    if temperature != 0:
        raise UserError("a capture holds the target's greedy continuations only: parity from --capture runs at "
                        "--temperature 0 (give --target to compare sampling)")
    if drafter is None:
        raise UserError("parity needs the reference drafter: pass --drafter D")
    capture = Capture.open(capture_dir)
    capture.serves(max_new_tokens, depth)
    prompts = capture_prompts(capture, prompts_file)
    options = LoadOptions(dtype=torch.float32, device=device)
    return _run_sides(runtime, PairSource.of(drafter, capture=capture_dir),
                      PairSource.of(drafter, None, bundle, url, capture=capture_dir), options, prompts, depth,
                      max_new_tokens, temperature, seed, mode, phases, runtime_options, concurrency, repeat)


def _run_sides(runtime: str, reference_source: PairSource, runtime_source: PairSource, options: LoadOptions,
               prompts: list[list[int]], depth: int, max_new_tokens: int, temperature: float, seed: int,
               mode: str | None, phases: Phases, runtime_options: dict | None = None,
               concurrency: tuple[int, ...] = (1,), repeat: int = 0, sampling: dict | None = None,
               per_depth_positions: int = PER_DEPTH_POSITIONS) -> ParityReport:
    """Greedy replay (the default) holds one side at a time, so a target that fits the machine once is
    enough; autoregressive and sampling parity run both sides prompt by prompt."""
    if mode not in (None, *MODES):
        raise UserError(f"unknown parity mode {mode!r}; choose one of {', '.join(MODES)}")
    with tempfile.TemporaryDirectory(prefix="eagle31-parity-") as workdir:  # an on-the-fly export lives here
        runtime_side = replace(options, depth=depth, **(runtime_options or {}))
        seen = {}  # what the runtime says of its dtype; not the runtime itself, which in-turn parity releases

        def load_runtime():
            try:
                speculator = load_speculator(runtime, runtime_source, runtime_side, workdir)
            except UserError as err:  # an engine that refused the bundle: what inspect says of its drafter too
                named = _inspect_names(runtime_source.artifacts)
                if not named:
                    raise
                raise UserError(f"{err}; inspect names, for the bundle's drafter: {'; '.join(named)}") from None
            seen["runtime_dtype"] = getattr(speculator, "runtime_dtype", None)
            seen["engine_sampler"] = getattr(speculator, "engine_sampler", None)
            seen["engine_chunk_tail"] = getattr(speculator, "engine_chunk_tail", None)
            seen["drafts_source"] = getattr(speculator, "drafts_source", None)
            # vllm: a dict the speculator keeps up to date (drafts refused mid-run, what its plugin did not
            # recognise); not the speculator, which in-turn parity releases
            seen["engine_state"] = getattr(speculator, "engine_state", None)
            return speculator

        def load_reference():
            return load_speculator("reference", reference_source, options)

        thresholds = Thresholds(fp4_activations=options.act_quant)
        if temperature == 0 and mode in (None, "replay"):
            report = run_parity_in_turn(load_runtime, load_reference, prompts, depth, max_new_tokens, seed,
                                        thresholds, per_depth_positions, progress=phases, concurrency=concurrency,
                                        repeat=repeat)
        else:
            with phases.phase("load_reference"):
                reference = load_reference()
            with phases.phase("load_runtime"):
                other = load_runtime()
            with other:  # a server the runtime started stops whatever happens
                report = run_parity(reference, other, prompts, depth, max_new_tokens, temperature, seed, other.exact,
                                    mode=mode, thresholds=thresholds, per_depth_positions=per_depth_positions,
                                    progress=phases, concurrency=concurrency,
                                    repeat=repeat, **(sampling or {}))
        report.runtime_dtype = seen.get("runtime_dtype")
        report.engine_sampler = seen.get("engine_sampler")
        report.engine_chunk_tail = seen.get("engine_chunk_tail")
        report.drafts_source = seen.get("drafts_source")
        state = seen.get("engine_state") or {}
        if state:
            report.drafts_source = state.get("drafts_source")
            report.engine_unknown = list(state.get("unknown", []))
        if report.failures and (report.engine_chunk_tail or {}).get("broken"):
            report.failures[:0] = [chunk_tail_failure(report.engine_chunk_tail)]
        if temperature != 0 and (report.engine_sampler or {}).get("broken"):  # said first: it breaks every sample
            report.failures[:0] = [broken_sampler_failure(report.engine_sampler)]
        return report


ENGINE_SAMPLER_BROKEN = ("the engine's sampler: its per-token temperature, top-k and top-p are not the requests' "
                         "(the sampled acceptance and any greedy request batched with sampled ones follow other "
                         "logits), so sampling parity cannot pass on it")


ENGINE_CHUNK_TAIL_BROKEN = ("the engine's EAGLE drafter reads the prompt's last token at the end of every prefill chunk "
                            "that is not a prompt's last, where the next prompt token belongs, so every draft after a "
                            "chunked prefill (a prompt longer than what an engine step had left) attends to a wrong KV "
                            "entry")


def chunk_tail_failure(chunk_tail: dict) -> str:
    """Said first where a run failed on an engine known to feed its drafter the wrong token at a prefill
    chunk's end (vLLM's padded drafter batch as shipped: docs/runtimes.md, "Chunked prefill")."""
    return (f"{ENGINE_CHUNK_TAIL_BROKEN}: {chunk_tail['state']}, as {chunk_tail['how']} says; serve it with our vLLM "
            "plugin's fix (unset EAGLE31_VLLM_KEEP_CHUNK_TAIL), or with --max-num-batched-tokens above the longest "
            "prompts in flight")


def broken_sampler_failure(sampler: dict) -> str:
    """Said first where the engine is known to sample with a broken sampler (vLLM's CPU build with the
    expand shim left as shipped: docs/runtimes.md, "Sampling parity"), whatever the statistics show."""
    return (f"{ENGINE_SAMPLER_BROKEN}: {sampler['state']}, as {sampler['how']} says; serve it with our vLLM plugin's "
            "fix (unset EAGLE31_VLLM_KEEP_SAMPLER)")
