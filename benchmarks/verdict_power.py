"""Verdict power: how often parity fails a sabotaged pair (detection) and passes a faithful one (false
alarms), per precision, greedy and sampled, under the measured tie rule (parity/numerics.py,
parity/ties.py) and, beside it, under the old constant tie gaps (1e-4 fp32, 0.25 bf16, 1.0 bf16 with
FP4 activations; no tie budget).

    .venv/bin/python benchmarks/verdict_power.py --quick          # a few minutes on 2 cores
    .venv/bin/python benchmarks/verdict_power.py --runs 300 --sampled-runs 100   # full counts: hours

One invocation prints the whole table and the distributions below it from the same records: every
cell it measured, and every run `--records` already held for the cells asked.

The runtime is our own: the reference pair's loop (`--runtime reference`) computing at the precision
(fp32; bf16; bf16 or fp32 with FP4 activations on the NVFP4 target; the last also without the
float64 measurement's FP4 rounding band, parity/numerics.py: FP4_ROUNDING_BAND, as the verdict was
before it), over the faithful drafter or a sabotaged one (tests/parity/sabotage.py). It generates
autoregressively, one verification forward a round, while parity's reference replays the whole
sequence in one forward: at bf16 the two round differently, which is what a faithful engine's
numerics look like to parity.

A run is what `parity` does by default: 8 prompts, 32 new tokens each, depth 3. Its prompts are
windows of the tiny pair's held-out text that overlap no other run's (prompt and generated text
included), so runs are independent draws; run r of every cell gets the same ones. Past the 324
runs the held-out text holds, windows of standard-library text the pair never trained on follow
(`unseen_texts`). Every run is judged twice: as our runtimes and a local vLLM engine with our
plugin's draft log are (every draft compared), and as a vLLM server at --url is (accepted counts
only, `reports_drafts` False). A run stops early once all four verdicts (measured and old rule, drafts
and counts) have failed for good: an untied difference fails a report whatever its other prompts
hold, and the old rule has no budget, so the verdicts are the whole run's. Detection and false
alarms are counted per cell, with the exact one-sided 95 % binomial bound: 300 runs without a miss
show a rate of at least 0.99, 300 without a false alarm at most 0.01.

`--records FOLDER` keeps every run (one JSON line, one file per process): a stopped measurement
resumes where it stopped, several processes (one per precision) share the folder, and `--table`
prints the table from it. Every record keeps its K and its largest difference in measured errors;
`--k` judges at another tie factor, reusing a record measured at a larger one only where its verdict
provably stands (`at_k`). The distribution that K comes from is printed last: z = |top-2 margin
shift| / measured error over every faithful decision, and each faithful difference's margin in
units of its measured error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from eagle31_export.demo.pair import DRAFTERS, TARGET, TARGET_NVFP4, EmbeddedPair
from eagle31_export.formats.drafter.checkpoint import read_drafter, write_drafter
from eagle31_export.formats.nvfp4.model import NVFP4Linear
from eagle31_export.parity.compare import (
    ParityReport, Thresholds, _failures, _greedy_drafts, _judge_with, _replayed_sampled, _summarize, compare_prompt,
)
from eagle31_export.parity.mixed_batches import check_mixed_batches
from eagle31_export.parity.numerics import TIE_ERRORS, measurer_for
from eagle31_export.parity.sampling import GreedyDrafts, check_sampled
from eagle31_export.parity.ties import divergences
from eagle31_export.progress import Phases
from eagle31_export.reference.speculate import Sampling
from eagle31_export.runtime.registry import LoadOptions, PairSource, load_speculator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "parity"))
from sabotage import (  # noqa: E402
    drop_fc_norm, pre_norm_feedback, random_embed_tokens, scale_fc, scale_rope_theta, shift_aux_ids, shift_d2t,
)

PAIR = EmbeddedPair.open(ROOT / "examples" / "tiny" / "models")
EAGLE31 = PAIR.folder / DRAFTERS["EAGLE 3.1"]
NO_BAND = "fp32+FP4, no band"  # the float64 measurement without FP4_ROUNDING_BAND, as it was before it
PRECISIONS = {"fp32": (torch.float32, False, TARGET), "bf16": (torch.bfloat16, False, TARGET),
              "bf16+FP4 act": (torch.bfloat16, True, TARGET_NVFP4), "fp32+FP4 act": (torch.float32, True, TARGET_NVFP4),
              NO_BAND: (torch.float32, True, TARGET_NVFP4)}
SABOTAGES = {"faithful": lambda c: c, "taps shifted": lambda c: shift_aux_ids(c, 8), "fc_norm dropped": drop_fc_norm,
             "norm_output dropped": pre_norm_feedback, "d2t off by one": shift_d2t,
             "rope_theta x4": scale_rope_theta, "fc x 1.05": scale_fc,
             # the drafter's own random embed_tokens: our runtime, like vLLM 0.32, keeps a drafter's own table. The
             # engine classes our loop cannot run as the engine does (a sliding window it never applies, flags the
             # engine reads elsewhere, positions past --context) are measured on vLLM (tests/test_vllm_silent_bugs.py)
             "embed_tokens random": random_embed_tokens}


def ignore_input_scale(target: torch.nn.Module) -> None:
    """A runtime quantizing activations under global scale 1, not 1 / input_scale."""
    for module in target.modules():
        if getattr(module, "input_global_scale", None) is not None:
            module.input_global_scale = 1.0


def reciprocal_global_scale(target: torch.nn.Module) -> None:
    """A runtime reading each weight's global scale as its reciprocal (compressed-tensors' convention
    for ModelOpt's, or the other way)."""
    for module in target.modules():
        if isinstance(module, NVFP4Linear):
            module.weight_scale_2 = 1.0 / module.weight_scale_2


# the one-sided NVFP4 scale conventions: the runtime's target reads the checkpoint otherwise (NVFP4 targets only)
TARGET_SABOTAGES = {"input scale ignored": ignore_input_scale, "global scale reciprocal": reciprocal_global_scale}
SABOTAGES.update({name: SABOTAGES["faithful"] for name in TARGET_SABOTAGES})  # the drafter as it is
OLD_GAPS = {"fp32": 1e-4, "bf16": 0.25, "bf16+FP4 act": 1.0, "fp32+FP4 act": 1e-4, NO_BAND: 1e-4}
DEPTH = 3

# Sampled runs (greedy-drafts, as vLLM samples) and mixed batches (greedy requests among sampled ones, C = 8),
# in bf16 on the BF16 target, where the old constant gap was 0.25: their cells and sabotages.
SAMPLING = Sampling(0.7, rule="greedy-drafts")
MIXED_C = 8
SAMPLED = {"bf16 sampled": "sampled", "bf16 mixed C 8": "mixed"}
FOLLOWS = "greedy follows sampled"  # the engine samples a mixed batch's greedy requests by the others' parameters
SAMPLED_SABOTAGES = {"sampled": ("faithful", "taps shifted", "fc x 1.05"), "mixed": ("faithful", FOLLOWS, "fc x 1.05")}
SABOTAGES[FOLLOWS] = SABOTAGES["faithful"]  # the drafter as it is; the engine's batch sampling is sabotaged
for _name in SAMPLED:
    PRECISIONS[_name] = (torch.bfloat16, False, TARGET)
    OLD_GAPS[_name] = OLD_GAPS["bf16"]


def old_rule_fails(ref, run, gap: float, drafts_reported: bool) -> bool:
    """The constant rule this replaces: a difference is a tie when the reference's token gap or top-2
    draft margin there is within `gap`; no rank, no budget."""
    found = {i: g for i, (a, b, g) in enumerate(zip(ref.tokens, run.tokens, ref.token_gaps)) if a != b}
    if any(g > gap for g in found.values()):
        return True
    done = 1
    for r, (a, b) in enumerate(zip(ref.accepted_per_step, run.accepted_per_step)):
        step = min(a, b) + 1 if a != b else (
            next((j + 1 for j, (x, y) in enumerate(zip(ref.drafts[r], run.drafts[r])) if x != y), None)
            if drafts_reported else None)
        decided_by_token = step is not None and any(done + j in found for j in range(step))
        if (step is not None and not decided_by_token and step <= len(ref.draft_margins[r])
                and ref.draft_margins[r][step - 1] > gap):
            return True
        done += b + 1
    return False


def follow_sampled(runtime, sampling: Sampling) -> None:
    """A runtime whose batch sampling applies the sampled requests' parameters to every request (vLLM's
    CPU build as shipped, vllm#55005): a greedy request among sampled ones samples too."""
    inner = runtime.run_concurrently

    def run_concurrently(prompts, max_new_tokens, depth, concurrency, temperature=0.0, seed=0):
        every = [sampling] * len(temperature) if isinstance(temperature, list) else temperature
        return inner(prompts, max_new_tokens, depth, concurrency, every, seed)
    runtime.run_concurrently = run_concurrently


def sampled_run(reference, runtime, measurer, prompts, tokens: int, name: str, seed: int, tie_errors: float):
    """One sampled run (parity/compare.py: compare_sampled's steps): ([new fails, None, old fails, None],
    prompts, ties) under the measured rule and under the old constant gap (no budget)."""
    thresholds = Thresholds(tie_errors=tie_errors)
    replays, errors = [], []
    for i, prompt in enumerate(prompts):
        run = runtime.run(prompt, tokens, DEPTH, SAMPLING, seed + i)
        rounds, measured = _replayed_sampled(reference, measurer, prompt, run, SAMPLING)
        replays.append(rounds)
        errors.append(measured)
    judged = _judge_with(reference, prompts, measurer, True, tie_errors)
    new = check_sampled(replays, DEPTH, errors, tie_errors, thresholds.sampled_alpha, SAMPLING.rule,
                        precision=measurer.precision)
    old = check_sampled(replays, DEPTH, [[[OLD_GAPS[name] / tie_errors] * len(r.margins) for r in rounds]
                                         for rounds in replays], tie_errors, thresholds.sampled_alpha, SAMPLING.rule)
    old.budget.observed = 0  # the old rule had no budget
    if new.wants_greedy or old.wants_greedy:
        greedy = _greedy_drafts(runtime, prompts, DEPTH, tokens, seed, judged, Phases.of(None))
        new.greedy = greedy if new.wants_greedy else None
        if old.wants_greedy:
            old.greedy = _old_greedy(reference, runtime, prompts, tokens, seed, OLD_GAPS[name])
    return [bool(new.failures()), None, bool(old.failures()), None], len(prompts), new.budget.observed


def _old_greedy(reference, runtime, prompts, tokens: int, seed: int, gap: float) -> GreedyDrafts:
    """The greedy check as the old rule judged it: drafts and tokens within the constant gap."""
    untied = []
    for i, prompt in enumerate(prompts):
        run = runtime.run(prompt, tokens, DEPTH, 0.0, seed + i)
        if old_rule_fails(reference.replay(prompt, run), run, gap, True):
            untied.append(f"prompt {i}")
    return GreedyDrafts(len(prompts), 1, 0, untied)


def mixed_run(reference, runtime, measurer, prompts, tokens: int, name: str, seed: int, tie_errors: float):
    """One mixed-batch run at C = MIXED_C (parity/mixed_batches.py): ([new fails, None, old fails, None],
    prompts, ties); the old rule judged each greedy request within the constant gap, on accepted counts."""
    judged = _judge_with(reference, prompts, measurer, False, tie_errors)
    results = {}

    def keep(i, run):  # the runs the verdict judged, for the old rule
        results[i] = run
        return judged(i, run)
    rows, failures = check_mixed_batches(runtime, prompts, DEPTH, tokens, SAMPLING, seed, (1, MIXED_C), keep)
    old = any(old_rule_fails(reference.replay(prompts[i], run), run, OLD_GAPS[name], False)
              for i, run in results.items())
    return [bool(failures), None, old, None], len(prompts), sum(len(r.ties) for r in rows)


def one_run(reference, runtime, measurer, prompts, tokens: int, fp4: bool, name: str, ratios: list, k: float):
    """(new verdict fails with drafts, new fails on counts only, old fails with drafts, old on counts), and
    the prompts it compared. The run stops early once all four have failed for good: an untied
    difference fails a report whatever its other prompts hold (parity/compare.py: _failures), and the
    old rule has no budget, so the verdicts are those of the whole run."""
    thresholds = Thresholds(fp4_activations=fp4, tie_errors=k)
    reports = {seen: ParityReport("reference", DEPTH, 0.0, reference.exact and runtime.exact, thresholds, "replay",
                                  drafts_reported=seen) for seen in (True, False)}
    old = {True: False, False: False}
    for i, prompt in enumerate(prompts):
        run = runtime.run(prompt, tokens, DEPTH)
        ref, measured = measurer.replay(reference, prompt, run)
        for seen, report in reports.items():
            shown = run if seen else type(run)(run.tokens, [], run.accepted_per_step, run.depth)
            report.rows.append(compare_prompt(i, prompt, ref, shown, None, 1.0, seen, measured=measured,
                                              tie_errors=k))
            old[seen] |= old_rule_fails(ref, shown, OLD_GAPS[name], seen)
            if seen:
                ratios += [d.gap / d.error for d in divergences(ref, shown, measured, k, shown.drafts) or []
                           if d.error and math.isfinite(d.gap) and d.gap > 0]
        if all(old.values()) and all(any(row.untied for row in r.rows) for r in reports.values()):
            break
    out = []
    for seen, report in reports.items():
        report.failures = _failures(report)
        _summarize(report, measurer)
        out.append(bool(report.failures))
    return out + [old[True], old[False]], len(reports[True].rows)


def bound(hits: int, n: int, detection: bool) -> str:
    """The one-sided 95 % bound on the rate: lower for detection, upper for false alarms (exact binomial)."""
    if n == 0 or hits is None:
        return "-"
    target = hits if detection else n - hits  # count the "good" outcomes
    lo = 0.0 if target == 0 else _clopper_lower(target, n)
    return f"{lo:.3f}" if detection else f"{1 - lo:.3f}"


def _clopper_lower(k: int, n: int, alpha: float = 0.05) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection on P(X >= k | p) = alpha
        mid = (lo + hi) / 2
        tail = sum(math.comb(n, j) * mid ** j * (1 - mid) ** (n - j) for j in range(k, n + 1))
        lo, hi = (mid, hi) if tail < alpha else (lo, mid)
    return lo


CONTEXT = 48  # prompt tokens: a window of held-out text


def prompt_windows(tokens: int, needed: int = 0) -> list[list[int]]:
    """Every held-out text cut into windows that do not overlap, prompt and generated text included
    (CONTEXT + tokens apart), in a fixed shuffled order: runs draw distinct prompts from all over the
    texts, and run r of every cell the same ones. Where `needed` is more, windows of `unseen_texts`
    follow, shuffled apart, so the first runs keep their prompts."""
    out = _windows(PAIR.held_out_texts(), tokens)
    if needed > len(out):
        out += _windows(unseen_texts(), tokens)
    return out


def _windows(texts: list[str], tokens: int) -> list[list[int]]:
    tokenizer, stride, out = PAIR.tokenizer(), CONTEXT + tokens, []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        out += [ids[i:i + CONTEXT] for i in range(0, len(ids) - stride + 1, stride)]
    random.Random(0).shuffle(out)
    return out


def unseen_texts() -> list[str]:
    """The standard library's files below its top level, which the tiny pair never trained on (its
    corpus is the top-level files, examples/tiny/corpus.py), less installed packages and test suites."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(f for f in stdlib.rglob("*.py") if f.parent != stdlib and not skipped & set(f.parts))
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def read_records(folder: Path, k: float = TIE_ERRORS) -> list[dict]:
    """The runs judged at tie factor `k`: those measured at it, and those measured at a larger one whose
    verdicts provably stand at `k` (`at_k`); per run, one measured at `k` itself first."""
    found: dict[tuple, dict] = {}
    for f in sorted(folder.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            record = at_tie_errors(json.loads(line), k) if line else None
            key = record and (record["precision"], record["sabotage"], record["prompts"], record["tokens"],
                              record["run"])
            if record is not None and (key not in found or "carried_from" in found[key]):
                found[key] = record
    return list(found.values())


def at_tie_errors(record: dict, k: float) -> dict | None:
    """`record` judged at tie factor `k` (TIE_ERRORS), or None where only running it again tells. Lowering it only
    turns ties into failures (parity/ties.py), never the other way, and the tie budget does not read it:
    a verdict that failed at the record's K fails at `k`, and one that passed stands where no difference
    of the run lay beyond `k` measured errors (`max_ratio`, from the run's drafts-compared judgement,
    whose gaps bound the counts-only judgement's: that one's runner-up stands below the runtime's own
    draft). The old rule does not read K."""
    was = record.get("tie_errors", record.get("k", 6.0))  # the runs before it was recorded were judged at 6
    if was == k:
        return record
    if record["precision"] in SAMPLED:
        return None  # sampled runs' verdicts are not carried: judged again
    largest = record.get("max_ratio", max(record["ratios"], default=0.0) if "ratios" in record else None)
    if was < k or (not all(record["verdicts"][:2]) and (largest is None or largest > k)):
        return None
    return {**record, "tie_errors": k, "carried_from": was}


def measure_cell(name: str, sabotage: str, runs: int, args, prompts, done: set, out_file: Path, tmp: Path) -> None:
    dtype, fp4, target_name = PRECISIONS[name]
    mode = SAMPLED.get(name)
    if mode is not None:
        runs = args.sampled_runs
        if sabotage not in SAMPLED_SABOTAGES[mode]:
            return
    elif sabotage == FOLLOWS:
        return
    todo = [r for r in range(runs) if (name, sabotage, args.prompts, args.tokens, r) not in done]
    if not todo or (sabotage in TARGET_SABOTAGES and target_name != TARGET_NVFP4):
        return
    target = PAIR.folder / target_name
    reference = load_speculator("reference", PairSource.of(EAGLE31, target), LoadOptions(act_quant=fp4))
    measurer = measurer_for(reference, dtype == torch.float32, dtype, fp4)
    if name == NO_BAND:
        measurer.fp4_band = None
    drafter = write_drafter(SABOTAGES[sabotage](read_drafter(EAGLE31)), tmp / f"{name}-{sabotage}".replace(" ", "_"),
                            "specforge")
    if sabotage in TARGET_SABOTAGES:  # a copy: the loaded model is the runtime's alone, not shared by key
        target = Path(shutil.copytree(target, tmp / f"{name}-{sabotage}-target".replace(" ", "_"), dirs_exist_ok=True))
    runtime = load_speculator("reference", PairSource.of(drafter, target), LoadOptions(dtype=dtype, act_quant=fp4))
    if sabotage in TARGET_SABOTAGES:
        TARGET_SABOTAGES[sabotage](runtime.target.model)
    if sabotage == FOLLOWS:
        follow_sampled(runtime, SAMPLING)
    faithful = sabotage == "faithful"
    with out_file.open("a") as out:
        for r in todo:
            start, ratios, ties = time.perf_counter(), [], None
            measurer.measured.clear()
            window = prompts[r * args.prompts:(r + 1) * args.prompts]
            if mode == "sampled":
                verdicts, compared, ties = sampled_run(reference, runtime, measurer, window, args.tokens, name,
                                                       r * args.prompts, args.tie_errors)
            elif mode == "mixed":
                verdicts, compared, ties = mixed_run(reference, runtime, measurer, window, args.tokens, name,
                                                     r * args.prompts, args.tie_errors)
            else:
                verdicts, compared = one_run(reference, runtime, measurer, window, args.tokens, fp4, name, ratios,
                                             args.tie_errors)
            record = {"precision": name, "sabotage": sabotage, "prompts": args.prompts, "tokens": args.tokens,
                      "run": r, "tie_errors": args.tie_errors, "verdicts": verdicts, "compared": compared,
                      "seconds": round(time.perf_counter() - start, 2),
                      "max_ratio": round(max(ratios, default=0.0), 3)}
            if ties is not None:
                record["ties"] = ties
            if faithful:
                record["z"] = [round(v, 3) for m in measurer.measured for v in m.z]
                record["ratios"] = [round(v, 3) for v in ratios]
            out.write(json.dumps(record) + "\n")
            out.flush()


def print_table(records: list[dict], args) -> None:
    print(f"{'precision':17} {'sabotage':20} {'runs':>4} | {'new: drafts':>11} {'95% bound':>9} {'new: counts':>11} "
          f"{'95% bound':>9} | {'old: drafts':>11} {'old: counts':>11} | {'prompts':>7} {'s':>6} {'carried':>7}")
    z_all, ratios = [], []
    for name in args.precision or PRECISIONS:
        for sabotage in args.sabotage or SABOTAGES:
            cell = [r for r in records if (r["precision"], r["sabotage"], r["prompts"], r["tokens"])
                    == (name, sabotage, args.prompts, args.tokens)]
            if not cell:
                continue
            n, faithful = len(cell), sabotage == "faithful"
            counts = [None if cell[0]["verdicts"][i] is None else sum(r["verdicts"][i] for r in cell) for i in range(4)]
            z_all += [v for r in cell for v in r.get("z", [])]
            ratios += [v for r in cell for v in r.get("ratios", [])]
            shown = ["-" if c is None else f"{c}/{n}" for c in counts]
            print(f"{name:17} {sabotage:20} {n:4d} | {shown[0]:>11} {bound(counts[0], n, not faithful):>9} "
                  f"{shown[1]:>11} {bound(counts[1], n, not faithful):>9} | {shown[2]:>11} {shown[3]:>11} | "
                  f"{sum(r['compared'] for r in cell) / n:7.1f} {sum(r['seconds'] for r in cell):6.0f} "
                  f"{sum('carried_from' in r for r in cell):7d}")
    print("(failing runs out of runs: detections for a sabotage, false alarms for the faithful drafter; the bound is "
          "the one-sided 95 % lower bound of detection, upper bound of false alarms; prompts: the mean compared a "
          "run, less than a run's prompts where all four verdicts had failed for good before its last; carried: runs "
          f"measured at a larger factor whose verdicts stand at TIE_ERRORS = {args.tie_errors:g}, read_records; sampled: "
          f"greedy-drafts at T {SAMPLING.temperature:g}, (a) drafts exact and (b) the acceptance law, the greedy "
          f"check where asked; mixed: C = {MIXED_C}, even prompts greedy among odd sampled ones, each greedy request "
          "judged on accepted counts; '-': no counts-only verdict there)")
    for label, xs in (("z = |top-2 margin shift| / e, faithful decisions", z_all),
                      ("faithful differences' margin / e", ratios)):
        xs = sorted(xs)
        if xs:
            q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
            print(f"{label}: n {len(xs)}, median {q(0.5):.2f}, p99 {q(0.99):.2f}, p99.9 {q(0.999):.2f}, "
                  f"max {xs[-1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per sabotage and precision")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per run (parity's default: 8)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens a prompt (parity's default: 32)")
    parser.add_argument("--quick", action="store_true", help="5 runs a cell: minutes, not hours")
    parser.add_argument("--precision", action="append", choices=list(PRECISIONS))
    parser.add_argument("--sabotage", action="append", choices=list(SABOTAGES))
    parser.add_argument("--records", type=Path, help="a folder of run records (JSONL) to resume and add to; "
                        "several processes may share it (one file each); default: a temporary one")
    parser.add_argument("--tie-errors", type=float, default=TIE_ERRORS,
                        help=f"the tie factor, in measured errors, to judge at (parity's TIE_ERRORS: {TIE_ERRORS:g})")
    parser.add_argument("--sampled-runs", type=int, default=None,
                        help="runs per sampled and mixed-batch cell (default: --runs)")
    parser.add_argument("--table", action="store_true", help="print the table of --records only, run nothing")
    args = parser.parse_args()
    runs = 5 if args.quick else args.runs
    args.sampled_runs = 5 if args.quick else (args.sampled_runs or runs)
    most = max(runs, args.sampled_runs) if any(p in SAMPLED for p in args.precision or PRECISIONS) else runs
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.records or Path(tmp) / "records"
        folder.mkdir(parents=True, exist_ok=True)
        if not args.table:
            prompts = prompt_windows(args.tokens, most * args.prompts)
            if most * args.prompts > len(prompts):
                sys.exit(f"{most} runs of {args.prompts} prompts need {most * args.prompts} distinct windows; the "
                         f"held-out and unseen text has {len(prompts)}: fewer --runs or --prompts")
            print(f"{runs} runs a greedy cell, {args.sampled_runs} a sampled or mixed-batch cell, {args.prompts} "
                  f"distinct held-out prompts a run ({len(prompts)} windows of {CONTEXT} tokens), {args.tokens} "
                  f"tokens, depth {DEPTH}, TIE_ERRORS = {args.tie_errors:g}", flush=True)
            done = {(r["precision"], r["sabotage"], r["prompts"], r["tokens"], r["run"])
                    for r in read_records(folder, args.tie_errors)}
            out_file = folder / f"{os.getpid()}.jsonl"
            for name in args.precision or PRECISIONS:
                for sabotage in args.sabotage or SABOTAGES:
                    measure_cell(name, sabotage, runs, args, prompts, done, out_file, Path(tmp))
        print_table(read_records(folder, args.tie_errors), args)


if __name__ == "__main__":
    main()
