"""Train the tiny pair the demo and the parity suite use: a BPE tokenizer, a small Llama target,
an EAGLE-3 and an EAGLE 3.1 drafter (same budget, same data), on the Python standard library.

    python examples/tiny/train.py --out examples/tiny/models

Drafters are trained with training-time test (multi-step unrolling): step 1 reads the target's
tapped states through fc; steps 2..K read the drafter's own fed-back state (pre-norm for
EAGLE-3, post-norm for EAGLE 3.1), exactly as the reference drafter runs at inference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import read, split  # noqa: E402

from eagle31_export.config import DrafterConfig, default_aux_layer_ids  # noqa: E402
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, write_drafter  # noqa: E402
from eagle31_export.reference.drafter import Eagle3Drafter  # noqa: E402
from eagle31_export.reference.target import ReferenceTarget, tapped_forward  # noqa: E402
from eagle31_export.reference.ttt import ttt_forward  # noqa: E402

VOCAB = 2048
DRAFT_VOCAB = 1024
TARGET = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=8, num_attention_heads=6,
              num_key_value_heads=2, head_dim=32)


def log(msg: str, logfile) -> None:
    print(msg, flush=True)
    logfile.write(msg + "\n")
    logfile.flush()


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return fast


def encode(tokenizer, texts: list[str]) -> torch.Tensor:
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text)["input_ids"] + [eos]
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, length: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=gen)
        yield torch.stack([stream[s:s + length] for s in starts.tolist()])


def cosine_lr(step: int, total: int, peak: float, elapsed: float, budget: float, warmup: int = 30) -> float:
    """Cosine decay over whichever runs out first, the step count or the time budget, so a run cut
    short by a slow machine still ends at a low learning rate."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = max((step - warmup) / max(1, total - warmup), elapsed / budget)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_target(stream, steps, minutes, logfile, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"], bos_token_id=0,
                      eos_token_id=0, **TARGET)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    data = batches(stream, 257, 16, torch.Generator().manual_seed(seed))
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, 3e-3, time.time() - start, minutes * 60)
        x = next(data)
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            log(f"target step {step} loss {loss.item():.3f} ({time.time() - start:.0f}s)", logfile)
        if time.time() - start > minutes * 60:
            log(f"target: time budget reached at step {step}", logfile)
            break
    return model.eval()


def ttt_losses(drafter: Eagle3Drafter, target: ReferenceTarget, x: torch.Tensor, unroll: int,
               draft_ids: torch.Tensor) -> list[torch.Tensor]:
    """Soft cross-entropy against the target (restricted to the draft vocabulary), per unrolled step."""
    probs, taps = teacher(target, x, draft_ids)
    return chain_losses(drafter, probs, taps, x, unroll)


@torch.no_grad()
def teacher(target: ReferenceTarget, x: torch.Tensor, draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token distribution restricted to the draft vocabulary, and its tapped states."""
    logits, taps = tapped_forward(target, x[:, :-1])
    probs = torch.softmax(logits.float(), -1)[..., draft_ids]
    return probs / probs.sum(-1, keepdim=True), taps


def chain_losses(drafter: Eagle3Drafter, probs: torch.Tensor, taps: torch.Tensor, x: torch.Tensor, unroll: int,
                 anchors: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per unrolled step, the soft cross-entropy of the chains from every position (or from `anchors`)."""
    t = x.shape[1] - unroll - 1
    rows = torch.arange(t) if anchors is None else anchors
    step_logits = ttt_forward(drafter, taps[:, :t], x, unroll, anchors)
    return [-(probs[:, 1 + k + rows] * F.log_softmax(lg, -1)).sum(-1).mean() for k, lg in enumerate(step_logits)]


def drafter_step(drafter: Eagle3Drafter, opt, params: list, probs: torch.Tensor, taps: torch.Tensor,
                 x: torch.Tensor, unroll: int, anchors: torch.Tensor | None, lr: float) -> list[torch.Tensor]:
    """One optimizer step of a drafter on a batch the target has already scored; its per-step losses."""
    losses = chain_losses(drafter, probs, taps, x, unroll, anchors)
    opt.param_groups[0]["lr"] = lr
    opt.zero_grad()
    (sum(losses) / len(losses)).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return losses


def train_drafter(cfg: DrafterConfig, target_model, stream, draft_ids, steps, minutes, unroll, logfile, seed):
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    drafter.embed_tokens.weight.data.copy_(target_model.get_input_embeddings().weight.data)
    drafter.embed_tokens.weight.requires_grad_(False)
    drafter.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))
    target = ReferenceTarget(target_model, cfg.resolved_aux_layer_ids(TARGET["num_hidden_layers"]))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0, betas=(0.9, 0.95))
    data = batches(stream, 128 + unroll + 1, 16, torch.Generator().manual_seed(seed + 1))
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, 2e-3, time.time() - start, minutes * 60)
        losses = ttt_losses(drafter, target, next(data), unroll, draft_ids)
        loss = sum(losses) / len(losses)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0:
            per = " ".join(f"{l.item():.3f}" for l in losses)
            log(f"drafter(v{cfg.eagle_version}) step {step} loss per unroll step [{per}] ({time.time() - start:.0f}s)",
                logfile)
        if time.time() - start > minutes * 60:
            log(f"drafter(v{cfg.eagle_version}): time budget reached at step {step}", logfile)
            break
    return drafter.eval()


def drafter_config(eagle31: bool) -> DrafterConfig:
    return DrafterConfig(hidden_size=TARGET["hidden_size"], intermediate_size=512, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
                         rms_norm_eps=1e-5, max_position_embeddings=1024, fc_norm=eagle31, norm_output=eagle31,
                         # written out: a drafter naming no taps is served with each engine's own default
                         aux_layer_ids=default_aux_layer_ids(TARGET["num_hidden_layers"]), torch_dtype="bfloat16")


def save_drafter(drafter: Eagle3Drafter, out: Path, fmt: str) -> None:
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
               for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    write_drafter(DrafterCheckpoint(drafter.cfg, tensors), out, fmt, force=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "models")
    ap.add_argument("--target-steps", type=int, default=480)
    ap.add_argument("--target-minutes", type=float, default=16)
    ap.add_argument("--drafter-steps", type=int, default=400)
    ap.add_argument("--drafter-minutes", type=float, default=10)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    logfile = open(args.out / "training_log.txt", "w")
    log("command: python examples/tiny/train.py " + " ".join(sys.argv[1:]), logfile)
    train_files, held_out = split()
    log(f"corpus: {len(train_files)} training files, {len(held_out)} held out: "
        + ", ".join(f.name for f in held_out), logfile)
    tokenizer = train_tokenizer(read(train_files), args.out / "target")
    stream = encode(tokenizer, read(train_files))
    log(f"training tokens: {stream.numel()}", logfile)

    target = train_target(stream, args.target_steps, args.target_minutes, logfile, args.seed)
    target.to(torch.bfloat16).save_pretrained(args.out / "target", safe_serialization=True)
    target.to(torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)

    counts = torch.bincount(stream, minlength=VOCAB)
    draft_ids = counts.argsort(descending=True)[:DRAFT_VOCAB].sort().values
    log(f"draft vocabulary covers {counts[draft_ids].sum().item() / counts.sum().item():.3f} of training tokens",
        logfile)
    for eagle31, name, fmt in ((False, "drafter-eagle3", "eagle"), (True, "drafter-eagle31", "specforge")):
        drafter = train_drafter(drafter_config(eagle31), target, stream, draft_ids, args.drafter_steps,
                                args.drafter_minutes, args.unroll, logfile, args.seed)
        save_drafter(drafter, args.out / name, fmt)
        log(f"saved {name} ({fmt} format)", logfile)
    (args.out / "held_out_files.json").write_text(json.dumps([f.name for f in held_out], indent=2) + "\n")


if __name__ == "__main__":
    main()
