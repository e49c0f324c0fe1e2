"""examples/smollm2/train.py serves what it trains: every parameter it updates is in the checkpoint
it writes, and what it does not store (the embedding, loaded from the target by engines) is the
target's from the start and never updated. A first run trained a randomly initialized embedding that
the checkpoint then dropped, and its drafters served at held-out tau 1.35 and 1.16.

A small random Llama with the real target's 30 layers stands in for SmolLM2 (this checks the
training script's bookkeeping, not the model)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle31_export.config import default_aux_layer_ids
from eagle31_export.formats.drafter.checkpoint import read_drafter
from eagle31_export.reference.target import ReferenceTarget

ROOT = Path(__file__).resolve().parents[1]


def _train_module():
    spec = importlib.util.spec_from_file_location("smollm2_train", ROOT / "examples" / "smollm2" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stand_in_target(train) -> ReferenceTarget:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=train.DRAFT_VOCAB + 64, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=train.LAYERS, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True)
    return ReferenceTarget(LlamaForCausalLM(cfg).eval(), default_aux_layer_ids(train.LAYERS))


def test_every_trained_parameter_is_written_and_the_embedding_is_the_targets(tmp_path):
    train = _train_module()
    target = _stand_in_target(train)
    for p in target.model.parameters():
        p.requires_grad_(False)
    vocab = target.model.config.vocab_size
    conversations = [torch.randint(vocab, (300,), generator=torch.Generator().manual_seed(i)).tolist()
                     for i in range(4)]
    drafters = train.fresh_drafters(target, conversations, io.StringIO())
    draft_ids = next(iter(drafters.values())).draft_to_target(torch.arange(train.DRAFT_VOCAB))
    x = torch.tensor([conversations[0][:64 + 4]])
    probs, taps = train.teacher(target, x, draft_ids)
    embedding = target.model.get_input_embeddings().weight
    for label, drafter in drafters.items():
        params = [p for p in drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        train.drafter_step(drafter, opt, params, probs, taps, x, 3, None, 1e-2)
        assert torch.equal(drafter.embed_tokens.weight, embedding), label
        trained = {name for name, p in drafter.named_parameters() if p.requires_grad}
        folder = tmp_path / label.replace(" ", "")
        train.save_drafter(drafter, folder, train.DRAFTERS[label][1])
        stored = read_drafter(folder).tensors
        assert trained and trained <= set(stored), (label, sorted(trained - set(stored)))
        for name in trained:  # what was trained is what was written (bf16)
            expected = dict(drafter.named_parameters())[name].detach().to(torch.bfloat16)
            assert torch.equal(stored[name].to(torch.bfloat16), expected), (label, name)
