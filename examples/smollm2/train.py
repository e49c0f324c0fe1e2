"""Train the real pair's two drafters, EAGLE-3 and EAGLE 3.1, alike, on the target's own answers.

    python examples/smollm2/train.py [--minutes 60] [--total-steps 3000]   # resumes from models/

Data: every training prompt of `prompts.py` whose answer `generate.py` has written, as the served
conversation (chat template, default system prompt, the user turn, the target's greedy answer), and
every conversation `generate_chat.py` has written (Magpie and standard-library requests, greedy and
sampled answers, some of two turns).
Conversations are packed into windows that start at a conversation boundary, of 512, 1024 or 2048
tokens (TOKENS_PER_STEP tokens a step), so positions beyond 2048 are never trained.

Both drafters (tapped layers: EAGLE-3's default for 30 layers) see the same windows in the same
order with the same learning rate: one loop runs the target once a step and updates each drafter on
it with training-time test (`reference/ttt.py`, chains of `--unroll` steps from ANCHORS_PER_STEP
anchor positions; the soft cross-entropy against the target's probabilities over the draft
vocabulary, examples/tiny/train.py's losses). They start alike from the target: lm_head its
(tied) embedding rows of the draft vocabulary, the final norm its, the decoder layer a copy of its
last layer, fc passing the last tapped state through. The embedding is the target's, frozen, and not
stored (engines load it from the target).

Resumable anywhere: every CHECKPOINT_MINUTES, and at the end, both drafters (bf16, as committed) and
`models/progress.json` (the step reached, the data seen) are written; a rerun continues from them at
the next step of the same schedule (the optimizer's moments restart: logged). The draft vocabulary is
chosen once, by token frequency over the first run's conversations, and read back from the drafters.
At the end, held-out greedy tau by depth (reference speculative decoding, fp32) goes to the log.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import prompts as prompt_builder  # noqa: E402
from generate import TARGET, chat_ids, chunk_prompts, done_chunks, shard_path  # noqa: E402
from generate_chat import answers_path, done_shards  # noqa: E402

from eagle31_export.config import DrafterConfig, default_aux_layer_ids  # noqa: E402
from eagle31_export.formats.pair import read_pair  # noqa: E402
from eagle31_export.parity.acceptance import tau_by_depth  # noqa: E402
from eagle31_export.reference.drafter import Eagle3Drafter  # noqa: E402
from eagle31_export.reference.target import ReferenceTarget, load_target  # noqa: E402
from eagle31_export.runtime.registry import PairSource, load_speculator  # noqa: E402


def _tiny_training():
    """The tiny pair's training losses (examples/tiny/train.py), shared rather than copied; loaded by
    path because this file is `train.py` too."""
    spec = importlib.util.spec_from_file_location("tiny_train", HERE.parent / "tiny" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_tiny = _tiny_training()
drafter_step, log, save_drafter, teacher = _tiny.drafter_step, _tiny.log, _tiny.save_drafter, _tiny.teacher

MODELS = HERE / "models"
PROGRESS = MODELS / "progress.json"
DRAFTERS = {"EAGLE-3": ("drafter-eagle3", "eagle", False), "EAGLE 3.1": ("drafter-eagle31", "specforge", True)}
LAYERS = 30
DRAFT_VOCAB = 8192  # each checkpoint about 19 MB in bf16 (the embedding is the target's)
LENGTHS = (512, 1024, 2048)
TOKENS_PER_STEP = 2048
ANCHORS_PER_STEP = 384
CHECKPOINT_MINUTES = 15
EVAL_PROMPTS, EVAL_MAX_PROMPT, EVAL_NEW_TOKENS, EVAL_DEPTHS = 12, 768, 64, (1, 2, 3, 4)
DEMO_PROMPTS = 4  # what `demo --pair` measures (prompts.json): each costs minutes on 2 cores at 135M


def drafter_config(eagle31: bool, target_cfg) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=target_cfg.hidden_size, intermediate_size=target_cfg.intermediate_size,
        num_attention_heads=target_cfg.num_attention_heads, num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.hidden_size // target_cfg.num_attention_heads, vocab_size=target_cfg.vocab_size,
        draft_vocab_size=DRAFT_VOCAB, rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_parameters["rope_theta"],
        max_position_embeddings=target_cfg.max_position_embeddings, fc_norm=eagle31, norm_output=eagle31,
        aux_layer_ids=default_aux_layer_ids(LAYERS), torch_dtype="bfloat16")


def answered_conversations(tokenizer) -> list[list[int]]:
    """The training conversations answered so far: each shard's records matched to its chunk's prompts
    by position (generate.chunk_prompts), their keys checked."""
    ordered, conversations = prompt_builder.build(prompt_builder.split()[0]), []
    for index in range(done_chunks()):
        with gzip.open(shard_path(index), "rt") as f:
            records = [json.loads(line) for line in f]
        prompts = chunk_prompts(tokenizer, ordered, index)
        if [r["key"] for r in records] != [p.key for p, _ in prompts]:
            raise SystemExit(f"{shard_path(index)}: its records are not chunk {index}'s prompts; "
                             "was it written by another prompts.py? Delete it and rerun generate.py")
        conversations += [ids + r["answer"] for (_, ids), r in zip(prompts, records)]
    for index in range(done_shards()):  # generate_chat.py's conversations: stored whole, as token ids
        with gzip.open(answers_path(index), "rt") as f:
            conversations += [json.loads(line)["ids"] for line in f]
    return conversations


def windows(conversations: list[list[int]], gen: torch.Generator, extra: int):
    """(windows [B, L + extra], anchors): L from LENGTHS, TOKENS_PER_STEP // L windows, each from a
    random conversation's start through the ones after it; the step's anchors shared by its windows."""
    while True:
        length = LENGTHS[int(torch.randint(len(LENGTHS), (1,), generator=gen))]
        rows = []
        for start in torch.randint(len(conversations), (TOKENS_PER_STEP // length,), generator=gen).tolist():
            ids, i = [], start
            while len(ids) < length + extra:
                ids += conversations[i % len(conversations)]
                i += 1
            rows.append(ids[:length + extra])
        anchors = torch.randperm(length, generator=gen)[:ANCHORS_PER_STEP // len(rows)].sort().values
        yield torch.tensor(rows), anchors


def from_target(drafter: Eagle3Drafter, target: ReferenceTarget, draft_ids: torch.Tensor) -> None:
    """The starting point both drafters share: the target's embedding (frozen), head, final norm and
    last layer. (Zeroing the layer's output projections, the target's head read at the deepest tap,
    started worse in a first trial, since that state predicts the token the drafter is given, not the
    one after it.)"""
    model, cfg = target.model.model, drafter.cfg
    last, layer = model.layers[-1], drafter.layers[0]
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        drafter.lm_head.weight.copy_(target.model.get_output_embeddings().weight[draft_ids])
        drafter.norm.weight.copy_(model.norm.weight)
        for name in ("q_proj", "k_proj", "v_proj"):  # the same projection of the token and of the state
            src = getattr(last.self_attn, name).weight
            getattr(layer.self_attn, name).weight.copy_(torch.cat([src, src], 1))
        layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
        for norm in (layer.input_layernorm, layer.hidden_norm):
            norm.weight.copy_(last.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        h = cfg.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -h:].copy_(torch.eye(h))  # the deepest tap passes through
        drafter.d2t.copy_(draft_ids - torch.arange(draft_ids.numel()))


def fresh_drafters(target: ReferenceTarget, conversations: list[list[int]], logfile) -> dict[str, Eagle3Drafter]:
    counts = torch.bincount(torch.tensor([t for c in conversations for t in c]), minlength=target.model.config.vocab_size)
    draft_ids = counts.argsort(descending=True)[:DRAFT_VOCAB].sort().values
    log(f"draft vocabulary: the {DRAFT_VOCAB} most frequent tokens, "
        f"{counts[draft_ids].sum().item() / counts.sum().item():.4f} of the training tokens", logfile)
    drafters = {}
    for label, (_, _, eagle31) in DRAFTERS.items():
        drafter = Eagle3Drafter(drafter_config(eagle31, target.model.config))
        torch.manual_seed(0)
        from_target(drafter, target, draft_ids)
        drafters[label] = drafter
    return frozen_embedding(drafters)


def saved_drafters(target: ReferenceTarget) -> dict[str, Eagle3Drafter]:
    """Both drafters as last written, fp32, their embedding the target's (frozen)."""
    drafters = {}
    for label, (folder, _, _) in DRAFTERS.items():
        ckpt = read_pair(MODELS / folder, TARGET).checkpoint
        drafter = Eagle3Drafter(ckpt.config)
        state = {k: v.float() if v.is_floating_point() else v for k, v in ckpt.tensors.items() if k != "t2d"}
        state["embed_tokens.weight"] = target.model.get_input_embeddings().weight.detach()
        drafter.load_state_dict(state, strict=True)
        drafters[label] = drafter
    return frozen_embedding(drafters)


def frozen_embedding(drafters: dict[str, Eagle3Drafter]) -> dict[str, Eagle3Drafter]:
    """The drafters with their embedding, the target's, out of training. It is not stored (vLLM and
    speculators load it from the target), so a trained copy would be served as the target's anyway:
    the first run trained a randomly initialized one, and its drafters served at tau 1.35 and 1.16."""
    for drafter in drafters.values():
        drafter.embed_tokens.weight.requires_grad_(False)
    return drafters


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup)))))


def checkpoint(drafters: dict, progress: dict) -> None:
    for label, (folder, fmt, _) in DRAFTERS.items():
        save_drafter(drafters[label], MODELS / folder, fmt)
    PROGRESS.write_text(json.dumps(progress, indent=1) + "\n")


def train(drafters: dict, target: ReferenceTarget, conversations, progress: dict, args, logfile) -> None:
    draft_ids = next(iter(drafters.values())).draft_to_target(torch.arange(DRAFT_VOCAB))
    params = {label: [p for p in d.parameters() if p.requires_grad] for label, d in drafters.items()}
    opts = {label: torch.optim.AdamW(params[label], lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
            for label in drafters}
    first = progress["step"]
    # the schedule's batches depend on the step alone (and on the conversations answered so far)
    data = windows(conversations, torch.Generator().manual_seed(args.seed + first), args.unroll + 1)
    start = saved = time.time()
    for step in range(first, args.total_steps):
        lr = lr_at(step, args.total_steps, args.lr)
        x, anchors = next(data)
        probs, taps = teacher(target, x, draft_ids)
        line = []
        for label, drafter in drafters.items():
            losses = drafter_step(drafter, opts[label], params[label], probs, taps, x, args.unroll, anchors, lr)
            line.append(f"{label} [{' '.join(f'{loss.item():.3f}' for loss in losses)}]")
        progress.update(step=step + 1, tokens=progress["tokens"] + x.numel())
        if step % 10 == 0:
            log(f"step {step} windows {x.shape[0]}x{x.shape[1] - args.unroll - 1} lr {lr:.2e} loss per unroll step: "
                + ", ".join(line) + f" ({time.time() - start:.0f}s)", logfile)
        if time.time() - saved > CHECKPOINT_MINUTES * 60:
            checkpoint(drafters, progress)
            saved = time.time()
        if time.time() - start > args.minutes * 60:
            log(f"time budget reached after step {step}", logfile)
            break
    progress["seconds"] = progress.get("seconds", 0) + round(time.time() - start)
    checkpoint(drafters, progress)


def held_out_prompts(tokenizer) -> list[list[int]]:
    """EVAL_PROMPTS chat prompts from the held-out files, as served, written beside the drafters as
    `held_out_prompts.jsonl` (for `parity --prompts`), the first DEMO_PROMPTS of them as `prompts.json`
    (what `demo` measures)."""
    held = [chat_ids(tokenizer, p.text) for p in prompt_builder.build(prompt_builder.split()[1])]
    held = [ids for ids in held if len(ids) <= EVAL_MAX_PROMPT][::7][:EVAL_PROMPTS]
    (MODELS / "held_out_prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in held))
    (MODELS / "prompts.json").write_text(json.dumps({"prompt_ids": held[:DEMO_PROMPTS]}) + "\n")
    return held


def held_out_tau(tokenizer, logfile) -> dict:
    """Greedy tau by depth of both saved drafters on held-out prompts (their answers never trained)."""
    held = held_out_prompts(tokenizer)
    out = {}
    for label, (folder, _, _) in DRAFTERS.items():
        reference = load_speculator("reference", PairSource.of(MODELS / folder, TARGET))
        out[label] = tau_by_depth(reference, held, EVAL_DEPTHS, EVAL_NEW_TOKENS)
        log(f"held-out tau by depth, {label}: " + " ".join(f"{d}: {t:.3f}" for d, t in out[label].items())
            + f" ({len(held)} prompts of up to {EVAL_MAX_PROMPT} tokens, {EVAL_NEW_TOKENS} new tokens, fp32)",
            logfile)
    return out


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60, help="stop (and save) after this much training")
    ap.add_argument("--total-steps", type=int, default=3000, help="the schedule's length (cosine learning rate)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-eval", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    MODELS.mkdir(exist_ok=True)
    logfile = open(MODELS / "training_log.txt", "a")
    log(f"command: python examples/smollm2/train.py {' '.join(sys.argv[1:])}", logfile)
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    target = load_target(TARGET, default_aux_layer_ids(LAYERS))
    for p in target.model.parameters():
        p.requires_grad_(False)
    conversations = answered_conversations(tokenizer)
    log(f"data: {len(conversations)} answered training conversations, {sum(map(len, conversations))} tokens",
        logfile)
    progress = json.loads(PROGRESS.read_text()) if PROGRESS.is_file() else {"step": 0, "tokens": 0}
    if progress["step"]:
        drafters = saved_drafters(target)
        log(f"resumed at step {progress['step']} from the saved drafters (optimizer moments restart)", logfile)
    else:
        drafters = fresh_drafters(target, conversations, logfile)
    progress["conversations"] = len(conversations)
    if progress["step"] < args.total_steps:
        train(drafters, target, conversations, progress, args, logfile)
    if not args.no_eval:
        progress["held_out_tau"] = held_out_tau(tokenizer, logfile)
        PROGRESS.write_text(json.dumps(progress, indent=1) + "\n")


if __name__ == "__main__":
    main()
