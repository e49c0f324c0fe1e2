"""Fine-tune the tiny pair's two drafters at long context, over the target stretched to 32768 positions.

    python examples/tiny/train_long.py --out examples/tiny/models/long   # ~20 min (1 thread, 2-core machine)

1210 s measured (models/long/training_log.txt: 280 steps of about 4 s, plus the two evaluations),
on a 2-core machine with another job on the other core (an 8-step trial ran at 2.5 s a step).
Seeded: the batches, their anchors and the learning rates (a cosine over the steps) are the same on
every run; --minutes only stops a run on a machine too slow for it, before the schedule's end.

The target is the tiny target under yarn (factor 32 over its 1024 positions: demo/long_pair.py),
weights frozen and unchanged; only its rope config is stretched. Each drafter starts from its
short-context weights (models/drafter-eagle3, models/drafter-eagle31) under the same rope and
positions, and is trained with training-time test (train.py's losses, `reference/ttt.py`) on windows
of 1024 to 8192 tokens of the training files (the held-out files stay out: corpus.split()).

Both drafters see the same batches in the same order, with the same learning rates: one loop
computes the target once a step and updates each drafter on it, so their budgets (steps and
minutes) are equal by construction; each drafter's own update time is logged. A step holds
TOKENS_PER_STEP tokens (8 windows of 1024 tokens ... 1 of 8192) and trains the chains from
ANCHORS_PER_STEP anchor positions drawn uniformly over the windows: the step-0 keys cover every
position, so the chains attend to the whole window, at a cost linear in its length.

Before and after, the teacher-forced agreement of each drafter with the target (step k's draft is
the target's greedy token), on three 8192-token windows of the held-out files, is logged by anchor
position: whether the drafters learned to draft beyond the 1024 positions of the short pair.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import read, split  # noqa: E402
from train import batches, cosine_lr, drafter_step, encode, log, save_drafter, teacher  # noqa: E402

from eagle31_export.demo.long_pair import write_long_context_pair  # noqa: E402
from eagle31_export.formats.pair import read_pair  # noqa: E402
from eagle31_export.formats.tokenizer import load_tokenizer  # noqa: E402
from eagle31_export.reference.drafter import Eagle3Drafter  # noqa: E402
from eagle31_export.reference.target import ReferenceTarget, load_target, tapped_forward  # noqa: E402
from eagle31_export.reference.ttt import ttt_forward  # noqa: E402

MODELS = Path(__file__).resolve().parent / "models"
ROPE = "yarn"
DRAFTERS = {"EAGLE-3": ("drafter-eagle3", "eagle"), "EAGLE 3.1": ("drafter-eagle31", "specforge")}
LENGTHS = (1024, 2048, 4096, 8192)  # window lengths, drawn uniformly per step
TOKENS_PER_STEP = 8192
ANCHORS_PER_STEP = 512
EVAL_WINDOWS, EVAL_LENGTH, EVAL_STRIDE = 3, 8192, 8  # held-out windows; every 8th position anchors a chain
BUCKETS = (0, 1024, 2048, 4096, 8192)  # anchor positions, for the agreement by position


def trainable_drafter(folder: Path, target_folder: Path, target: ReferenceTarget) -> Eagle3Drafter:
    """The drafter at `folder` as an fp32 module to train, its embeddings the target's (frozen)."""
    ckpt = read_pair(folder, target_folder).checkpoint
    drafter = Eagle3Drafter(ckpt.config)
    state = {k: v.float() if v.is_floating_point() else v for k, v in ckpt.tensors.items() if k != "t2d"}
    state["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach().float()
    drafter.load_state_dict(state, strict=True)
    drafter.embed_tokens.weight.requires_grad_(False)
    return drafter


def load_stretched(stretched: Path) -> tuple[ReferenceTarget, dict[str, Eagle3Drafter]]:
    """The stretched target as the reference loads it (fp32 compute) and both drafters, trainable."""
    spec = read_pair(stretched / DRAFTERS["EAGLE 3.1"][0], stretched / "target")
    target = load_target(stretched / "target", spec.aux_layer_ids)
    drafters = {label: trainable_drafter(stretched / folder, stretched / "target", target)
                for label, (folder, _) in DRAFTERS.items()}
    vocabularies = [draft_vocabulary(d) for d in drafters.values()]
    assert all(torch.equal(v, vocabularies[0]) for v in vocabularies), "the drafters' draft vocabularies differ"
    return target, drafters


def draft_vocabulary(drafter: Eagle3Drafter) -> torch.Tensor:
    """Target ids of the draft vocabulary (d2t is an offset table)."""
    return drafter.draft_to_target(torch.arange(drafter.cfg.draft_vocab_size))


def long_batches(stream: torch.Tensor, unroll: int, gen: torch.Generator):
    """(windows [B, L + unroll + 1], anchors): L drawn from LENGTHS, TOKENS_PER_STEP // L windows of
    it, and the anchors the step trains from (shared by its windows, ANCHORS_PER_STEP in all)."""
    while True:
        length = LENGTHS[int(torch.randint(len(LENGTHS), (1,), generator=gen))]
        rows = TOKENS_PER_STEP // length
        x = next(batches(stream, length + unroll + 1, rows, gen))
        anchors = torch.randperm(length, generator=gen)[:ANCHORS_PER_STEP // rows].sort().values
        yield x, anchors


def held_out_windows(tokenizer) -> torch.Tensor:
    """EVAL_WINDOWS windows of EVAL_LENGTH tokens, evenly spaced over the held-out files' tokens."""
    stream = encode(tokenizer, read(split()[1]))
    starts = torch.linspace(0, stream.numel() - EVAL_LENGTH - 1, EVAL_WINDOWS).long().tolist()
    return torch.stack([stream[s:s + EVAL_LENGTH] for s in starts])


@torch.no_grad()
def agreement_by_position(drafter: Eagle3Drafter, target: ReferenceTarget, windows: torch.Tensor,
                          unroll: int) -> list[list[float]]:
    """[bucket][step]: the fraction of chains anchored in each BUCKETS range whose step-k draft is
    the target's greedy token (teacher-forced: step k reads the real token)."""
    t = windows.shape[1] - unroll - 1
    anchors = torch.arange(0, t, EVAL_STRIDE)
    hits = torch.zeros(len(BUCKETS) - 1, unroll)
    for x in windows:
        x = x.unsqueeze(0)
        logits, taps = tapped_forward(target, x[:, :-1])
        greedy = logits.argmax(-1)[0]
        for k, lg in enumerate(ttt_forward(drafter, taps[:, :t], x, unroll, anchors)):
            hit = (drafter.draft_to_target(lg[0].argmax(-1)) == greedy[1 + k + anchors]).float()
            for b in range(len(BUCKETS) - 1):
                hits[b, k] += hit[(anchors >= BUCKETS[b]) & (anchors < BUCKETS[b + 1])].sum()
    per_bucket = torch.tensor([((anchors >= lo) & (anchors < hi)).sum() for lo, hi in zip(BUCKETS, BUCKETS[1:])])
    return (hits / (per_bucket.unsqueeze(1) * windows.shape[0])).tolist()


def log_agreement(when: str, drafters: dict, target: ReferenceTarget, windows: torch.Tensor, unroll: int,
                  logfile) -> None:
    log(f"held-out agreement by anchor position ({when}; {windows.shape[0]} windows of {windows.shape[1]} "
        f"tokens, every {EVAL_STRIDE}th position; steps 1..{unroll}):", logfile)
    for label, drafter in drafters.items():
        drafter.eval()
        rows = agreement_by_position(drafter, target, windows, unroll)
        log(f"  {label:9s} " + " | ".join(f"{lo}-{hi}: " + " ".join(f"{a:.3f}" for a in row)
                                          for lo, hi, row in zip(BUCKETS, BUCKETS[1:], rows)), logfile)
        drafter.train()


def train(drafters: dict, target: ReferenceTarget, stream: torch.Tensor, args, logfile) -> dict:
    """The joint loop: one batch and one target forward a step, one update of each drafter on it.
    Returns each drafter's losses per unroll step over the last 50 steps (mean)."""
    draft_ids = draft_vocabulary(next(iter(drafters.values())))
    params = {label: [p for p in d.parameters() if p.requires_grad] for label, d in drafters.items()}
    opts = {label: torch.optim.AdamW(params[label], lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
            for label in drafters}
    data = long_batches(stream, args.unroll, torch.Generator().manual_seed(args.seed))
    spent = {label: 0.0 for label in drafters}  # each drafter's own update time
    recent = {label: [] for label in drafters}
    start = time.time()
    for step in range(args.steps):
        lr = cosine_lr(step, args.steps, args.lr, 0.0, 1.0, warmup=20)  # by steps alone: a run is reproducible
        x, anchors = next(data)
        probs, taps = teacher(target, x, draft_ids)
        line = []
        for label, drafter in drafters.items():
            began = time.time()
            losses = drafter_step(drafter, opts[label], params[label], probs, taps, x, args.unroll, anchors, lr)
            spent[label] += time.time() - began
            recent[label] = (recent[label] + [[loss.item() for loss in losses]])[-50:]
            line.append(f"{label} [{' '.join(f'{loss.item():.3f}' for loss in losses)}]")
        if step % 25 == 0:
            log(f"step {step} windows {x.shape[0]}x{x.shape[1] - args.unroll - 1} lr {lr:.2e} loss per unroll step: "
                + ", ".join(line) + f" ({time.time() - start:.0f}s)", logfile)
        if time.time() - start > args.minutes * 60:  # a safety stop on a slow machine, at whatever lr
            log(f"time budget reached at step {step}, before the schedule's end", logfile)
            break
    log(f"trained {step + 1} steps in {time.time() - start:.0f}s; own update time: "
        + ", ".join(f"{label} {s:.0f}s" for label, s in spent.items()), logfile)
    return {label: torch.tensor(rows).mean(0).tolist() for label, rows in recent.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=MODELS / "long")
    ap.add_argument("--steps", type=int, default=280)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the tiny models gain little from threads; and the runs stay comparable
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    logfile = open(args.out / "training_log.txt", "w")
    log("command: python examples/tiny/train_long.py " + " ".join(sys.argv[1:]), logfile)
    with tempfile.TemporaryDirectory(prefix="tiny-long-") as work:
        stretched = write_long_context_pair(MODELS, Path(work), ROPE)
        target, drafters = load_stretched(stretched)
        log(f"target: models/target under {ROPE} rope (factor 32 over 1024 positions, 32768 positions), "
            "weights frozen; drafters from their short-context weights, same rope", logfile)
        train_files, held_out = split()
        tokenizer = load_tokenizer(MODELS / "target")
        stream = encode(tokenizer, read(train_files))
        log(f"corpus: {len(train_files)} training files, {stream.numel()} tokens; {len(held_out)} files held out",
            logfile)
        log(f"windows of {', '.join(map(str, LENGTHS))} tokens, {TOKENS_PER_STEP} tokens and {ANCHORS_PER_STEP} "
            f"chains a step, unroll {args.unroll}, lr {args.lr}, up to {args.steps} steps or {args.minutes} minutes",
            logfile)
        windows = held_out_windows(tokenizer)
        log_agreement("before: the short-context drafters, stretched", drafters, target, windows, args.unroll, logfile)
        final = train(drafters, target, stream, args, logfile)
        log_agreement("after", drafters, target, windows, args.unroll, logfile)
    for label, loss in final.items():
        log(f"{label}: loss per unroll step, mean of the last 50 steps: [{' '.join(f'{v:.3f}' for v in loss)}]",
            logfile)
    for label, (folder, fmt) in DRAFTERS.items():
        save_drafter(drafters[label].eval(), args.out / folder, fmt)
        log(f"saved {args.out.name}/{folder} ({fmt} format)", logfile)
    log(f"total {time.time() - began:.0f}s", logfile)


if __name__ == "__main__":
    main()
