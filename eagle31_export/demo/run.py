"""The demo: an embedded pair through inspect, NVFP4, every export that runs here, parity on
ONNX Runtime, EAGLE-3 vs EAGLE 3.1 acceptance at depths 1..6 (every depth from one greedy text a
prompt: parity/chains.py), and (a pair with text) by context length over the pair stretched to long
context (demo/long_pair.py); a pair with CLAIMS_FILE (the real pair) also by context length and by
prompt format on its own prompts.

The library only computes and writes files; `cli/demo_cmd.py` draws the progress and tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from eagle31_export.demo.long_pair import POSITIONS, long_trained_drafters, write_long_context_pair
from eagle31_export.demo.pair import DRAFTERS, TARGET, TARGET_NVFP4, EmbeddedPair
from eagle31_export.errors import MissingRuntimeError
from eagle31_export.formats.outputs import atomic_output_dir
from eagle31_export.inspection import inspect_path
from eagle31_export.parity.acceptance import teacher_forced_agreement
from eagle31_export.parity.claims import SetResult, measure_sets, plot_sets
from eagle31_export.parity.compare import ParityReport, run_parity
from eagle31_export.parity.context import context_prompts
from eagle31_export.parity.report import write_report
from eagle31_export.reference.statistics import acceptance_length
from eagle31_export.runtime.registry import PairSource, load_speculator

DEPTHS = range(1, 7)
PROMPTS = 8
NEW_TOKENS = 32
CONTEXT = (1024, 2048, 4096, 8192)  # tau by context: CONTEXT_PROMPTS held-out prompts a length
CONTEXT_PROMPTS = 3
CONTEXT_DEPTH = 3
CLAIMS_FILE = "claims_prompts.json"  # a pair's prompt sets for the seed's claims: {"context": {length: [ids]}, ...}
CLAIMS_TABLES = ("context", "template")
CLAIMS_DEPTH = 3
STEPS = 8  # progress units: inspect, exports, parity, vLLM, one per measured (target, drafter), context


@dataclass
class DemoResult:
    out: Path
    reports: dict
    exports: dict[str, str]
    parity: ParityReport
    vllm: ParityReport | str  # parity against a real vLLM engine, or why it did not run
    taus: dict[tuple[str, str], dict[int, float]]
    agreement: dict[tuple[str, str], list[float]]
    context_taus: dict[str, dict[int, float]]  # drafter -> context length -> tau ({}: a pair without text)
    context_drafters: str = ""  # which drafters tau by context measured (long-trained, or stretched)
    claims: dict = field(default_factory=dict)  # table -> [SetResult]: the pair's own claims prompts, if any


def run_demo(out: Path, pair_dir: Path, force: bool = True,
             progress: Callable[[str, float], None] | None = None) -> DemoResult:
    """`progress(step, amount)` is called as the demo advances (`STEPS` units in all)."""
    advance = progress or (lambda step, amount: None)
    pair = EmbeddedPair.open(pair_dir)
    drafter31 = pair.drafter("EAGLE 3.1")
    prompts = pair.prompts(64)[:PROMPTS]
    with atomic_output_dir(out, force=force, inputs=[pair_dir]) as tmp:
        reports = {path.name: inspect_path(path, None if path.name.startswith("target") else pair.target)
                   for path in (pair.target, pair.target_nvfp4, *map(pair.drafter, DRAFTERS))}
        (tmp / "inspect.json").write_text(json.dumps(reports, indent=2) + "\n")
        advance("inspect", 1)
        exports = _exports(drafter31, pair.target, tmp)
        (tmp / "exports.json").write_text(json.dumps(exports, indent=2) + "\n")
        advance("exports", 1)
        reference = load_speculator("reference", PairSource.of(drafter31, pair.target))
        ort = load_speculator("onnxruntime", PairSource.of(drafter31, pair.target, tmp / "onnx"))
        parity = run_parity(reference, ort, pair.mixed_length_prompts(), 3, NEW_TOKENS)
        write_report(parity, tmp / "parity")
        advance("parity", 1)
        vllm = _vllm_parity(reference, drafter31, pair.target, tmp / "vllm", pair.mixed_length_prompts())
        if isinstance(vllm, ParityReport):
            write_report(vllm, tmp / "parity-vllm")
        advance("vLLM", 1)
        taus, agreement = {}, {}
        windows = pair.agreement_windows(256 + max(DEPTHS))
        for target in (TARGET, TARGET_NVFP4):
            pairs = reference_pairs(pair, pair.folder / target)
            [by_depth] = measure_sets(pairs, {"demo": prompts}, DEPTHS, NEW_TOKENS)  # every depth from one text
            for label, reference_pair in pairs.items():
                taus[(target, label)] = {d: by_depth.tau(label, d).mean for d in DEPTHS}
                agreement[(target, label)] = teacher_forced_agreement(reference_pair, windows, max(DEPTHS)).per_position
                advance(f"{label} on {target}", 0.75)
        (tmp / "tau.json").write_text(json.dumps([{"target": t, "drafter": d, "tau_by_depth": v,
                                                   "teacher_forced_agreement": agreement[(t, d)]}
                                                  for (t, d), v in taus.items()], indent=2) + "\n")
        _plot_taus(taus, tmp / "tau_by_depth.png",
                   f"{pair.name} pair, {'held-out text' if pair.has_text else 'its prompts'}, greedy")
        context = _tau_by_context(pair, tmp) if pair.has_text else {"tau_by_context": {}, "drafters": ""}
        claims = _claims(pair, tmp)
        advance("context", 1)
    return DemoResult(out, reports, exports, parity, vllm, taus, agreement, context["tau_by_context"],
                      context["drafters"], claims)


def reference_pairs(pair: EmbeddedPair, target: Path) -> dict:
    """Each drafter of the pair with `target`, as the reference runtime loads them."""
    return {label: load_speculator("reference", PairSource.of(pair.drafter(label), target)).pair for label in DRAFTERS}


def _claims(pair: EmbeddedPair, tmp: Path) -> dict[str, list[SetResult]]:
    """The seed's robustness claims on the pair's own prompt sets (CLAIMS_FILE, where it has one: a few
    prompts of each row of its full evaluation, e.g. examples/smollm2/evaluate.py), both drafters on the
    target, greedy: {table: [one SetResult a row]}, written to claims.json and drawn."""
    path = pair.folder / CLAIMS_FILE
    if not path.is_file():
        return {}
    sets = json.loads(path.read_text())
    pairs = reference_pairs(pair, pair.target)
    results = {table: measure_sets(pairs, sets[table], DEPTHS, NEW_TOKENS) for table in CLAIMS_TABLES}
    (tmp / "claims.json").write_text(json.dumps({"depth": CLAIMS_DEPTH, "new_tokens": NEW_TOKENS, "source": sets["source"],
                                                 **{t: [r.to_json(DEPTHS) for r in rs] for t, rs in results.items()}},
                                                indent=1) + "\n")
    plot_sets(results["context"], CLAIMS_DEPTH, tmp / "tau_by_context.png",
              f"{pair.name}: tau by context", "context (positions: prompt + answer)", log2_x=True)
    plot_sets(results["template"], CLAIMS_DEPTH, tmp / "tau_by_template.png",
              f"{pair.name}: tau by prompt format", "the same user turn")
    return results


def _tau_by_context(pair: EmbeddedPair, tmp: Path) -> dict:
    """Each drafter's tau at each CONTEXT length over the pair stretched to long context (yarn), at depth
    CONTEXT_DEPTH: CONTEXT_PROMPTS held-out prompts a length, tau pooled over them (all their tokens per
    all their target forwards: accepted drafts plus one bonus token a round, over the rounds). The
    drafters are those fine-tuned at long context beside the pair (`long/`, examples/tiny/train_long.py)
    where it has them, else its own, stretched and not fine-tuned (demo/long_pair.py). Written to
    tau_by_context.json (returned) and drawn."""
    import tempfile

    trained = long_trained_drafters(pair.folder)
    with tempfile.TemporaryDirectory(prefix="eagle31-long-pair-") as work:
        long = write_long_context_pair(pair.folder, Path(work), "yarn", trained)
        runs = context_runs(long, CONTEXT, CONTEXT_PROMPTS, CONTEXT_DEPTH)
    taus = {label: {n: pooled_tau(rs) for n, rs in by_length.items()} for label, by_length in runs.items()}
    per_prompt = {label: {n: [r.acceptance_length for r in rs] for n, rs in by_length.items()}
                  for label, by_length in runs.items()}
    drafters = ("fine-tuned at long context (long/, examples/tiny/train_long.py)" if trained
                else "the pair's own, stretched, not fine-tuned at long context")
    record = {"rope": "yarn, factor 32 over 1024 positions", "positions": POSITIONS, "drafters": drafters,
              "depth": CONTEXT_DEPTH, "new_tokens": NEW_TOKENS, "prompts_per_length": CONTEXT_PROMPTS,
              "tau": "pooled over a length's prompts: (accepted drafts + rounds) / rounds",
              "tau_by_context": taus, "tau_per_prompt": per_prompt}
    (tmp / "tau_by_context.json").write_text(json.dumps(record, indent=2) + "\n")
    _plot_context(taus, tmp / "tau_by_context.png", "long-trained drafters" if trained else "stretched drafters")
    return record


def context_runs(long: Path, lengths: tuple[int, ...], count: int, depth: int,
                 new_tokens: int = NEW_TOKENS) -> dict[str, dict[int, list]]:
    """Over a long-context pair folder (write_long_context_pair): each drafter's greedy speculation
    (SpecResult) on `count` held-out prompts of each length, at `depth`."""
    vocab = json.loads((long / TARGET / "config.json").read_text())["vocab_size"]
    prompts = context_prompts(long / TARGET, lengths, vocab, POSITIONS, new_tokens + depth + 1, count=count)
    runs = {}
    for label, folder in DRAFTERS.items():
        speculator = load_speculator("reference", PairSource.of(long / folder, long / TARGET))
        results = [speculator.run(p, new_tokens, depth) for p in prompts]
        runs[label] = {n: [r for p, r in zip(prompts, results) if len(p) == n] for n in lengths}
    return runs


def pooled_tau(results: list) -> float:
    """Tokens per target forward over several runs: all their accepted drafts plus one bonus token a
    round, over all their rounds."""
    return acceptance_length(sum(sum(r.accepted_per_step) for r in results),
                             sum(len(r.accepted_per_step) for r in results))


def _vllm_parity(reference, drafter: Path, target: Path, bundle: Path, prompts) -> ParityReport | str:
    """Parity against a real vLLM engine over the `export vllm` bundle, where a vLLM environment is
    found ($EAGLE31_VLLM, or this one); else why not. vLLM's CPU MoE kernels take no fp32 weights, so
    an MoE target runs in bf16 (docs/runtimes.md, "--runtime vllm")."""
    import torch

    from eagle31_export.runtime.registry import LoadOptions
    from eagle31_export.runtime.vllm_engine import find_vllm

    try:
        find_vllm()
    except MissingRuntimeError as err:
        return f"skipped: {err}"
    config = json.loads((target / "config.json").read_text())
    dtype = torch.bfloat16 if config.get("n_routed_experts") else torch.float32
    with load_speculator("vllm", PairSource.of(drafter, target, bundle), LoadOptions(dtype=dtype, depth=3)) as vllm:
        return run_parity(reference, vllm, prompts, 3, NEW_TOKENS)


def _exports(drafter: Path, target: Path, tmp: Path) -> dict[str, str]:
    """Every export that can run on this machine; the rest say why not."""
    from eagle31_export.export.engine import build_engines
    from eagle31_export.export.onnx_export import export_onnx
    from eagle31_export.export.sglang import export_sglang
    from eagle31_export.export.trtllm import export_trtllm
    from eagle31_export.export.vllm import export_vllm
    from eagle31_export.runtime.triton_repo import export_triton

    done = {}
    export_onnx(drafter, tmp / "onnx", target)
    if "no_target_graph" in json.loads((tmp / "onnx" / "graphs.json").read_text()):
        done["onnx"] = ("drafter step graphs with Eagle31 plugin nodes; no target graph (an MoE target: "
                        "ONNX Runtime verifies with the reference target, below)")
    else:
        done["onnx"] = "drafter step graphs + target graph with Eagle31 plugin nodes (ONNX Runtime verified below)"
    export_trtllm(drafter, target, tmp / "trtllm", max_draft_len=3)
    done["trtllm"] = "TensorRT-LLM drafter folder + LLM-API YAML (trtllm-serve --config)"
    export_vllm(drafter, target, tmp / "vllm")
    done["vllm"] = "vLLM drafter + --speculative-config"
    export_sglang(drafter, target, tmp / "sglang")
    done["sglang"] = "SGLang drafter + server flags"
    export_triton(tmp / "trtllm", tmp / "triton-trtllm", "trtllm")
    done["triton-trtllm"] = "Triton LLM-API repository (TensorRT-LLM PyTorch backend)"
    export_triton(tmp / "trtllm", tmp / "triton-cpu", "cpu")
    done["triton-cpu"] = "Triton python-backend repository on ONNX Runtime (eagle31-export serve)"
    try:
        build_engines(tmp / "onnx", tmp / "engines")
        done["engines"] = "TensorRT engines"
    except MissingRuntimeError as err:
        done["engines"] = f"skipped: {err}"
    return done


def _plot_context(taus: dict[str, dict[int, float]], path: Path, drafters: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, by_length in taus.items():
        ax.plot(list(by_length), list(by_length.values()), "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context (prompt tokens)", ylabel="tau (tokens per target forward)", xticks=list(CONTEXT),
           xticklabels=[str(n) for n in CONTEXT],
           title=f"Acceptance by context (tiny pair, yarn x32)\n{drafters}, depth {CONTEXT_DEPTH}, "
                 f"{CONTEXT_PROMPTS} prompts a length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_taus(taus: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (target, label), by_depth in taus.items():
        style = "-" if target == TARGET else ":"
        ax.plot(list(by_depth), list(by_depth.values()), "o" + style, label=f"{label} ({target})")
    ax.set(xlabel="draft depth", ylabel="tau (tokens per target forward)",
           title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
