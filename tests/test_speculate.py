"""The speculation loop: lossless greedy decoding, exact statistics, and exact rejection sampling."""

import random

import pytest
import torch

from factories import greedy_decode, make_target
from eagle31_export.formats.target.checkpoint import load_causal_lm
from eagle31_export.reference.drafter import build_drafter
from eagle31_export.reference.speculate import (
    ReferenceDrafterBackend,
    SpecResult,
    _Sampler,
    speculate,
)
from eagle31_export.reference.target import ReferenceTarget


@pytest.fixture(scope="module")
def pair(fp64_llama, eagle31_ckpt):
    ids = eagle31_ckpt.config.resolved_aux_layer_ids(8)
    drafter = build_drafter(eagle31_ckpt, dtype=torch.float64, target_model=fp64_llama)
    return ReferenceTarget(fp64_llama, ids), ReferenceDrafterBackend(drafter)


def test_greedy_speculation_is_lossless_for_many_prompts_and_depths(pair):
    target, drafter = pair
    rng = random.Random(0)
    for depth in range(1, 7):
        for _ in range(4):
            prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 12))]
            result = speculate(target, drafter, prompt, 20, depth)
            assert result.tokens == greedy_decode(target, prompt, 20), (depth, prompt)
            assert all(len(d) == depth for d in result.drafts)


class OracleDrafter:
    """A drafter backend that proposes the target's true greedy continuation, except at chosen
    (round, position) slots where it proposes a wrong token: the loop's bookkeeping is then
    predictable exactly. It exercises acceptance paths a random drafter never reaches."""

    def __init__(self, truth: list[int], prompt_len: int, wrong: set[tuple[int, int]], vocab: int):
        self.truth, self.prompt_len, self.wrong, self.vocab = truth, prompt_len, wrong, vocab
        self.pos = 0

    def reset(self):
        self.pos, self.round, self.step = 0, -1, 0

    @property
    def length(self):
        return self.pos

    def forward(self, input_ids, positions, hidden, hidden_is_aux):
        if hidden_is_aux:
            self.round, self.step = self.round + 1, 0
        last = int(positions[0, -1])
        self.pos = last + 1
        want = self.truth[last + 2 - self.prompt_len]  # the token after position last+1
        if (self.round, self.step) in self.wrong:
            want = (want + 1) % self.vocab
        self.step += 1
        logits = torch.full((1, input_ids.shape[1], self.vocab), -1.0)
        logits[0, -1, want] = 1.0
        return logits, hidden[..., :4]

    def draft_to_target(self, ids):
        return ids

    def truncate(self, length):
        self.pos = length


def test_statistics_follow_the_drafts_exactly(pair):
    target, _ = pair
    prompt = [7, 3, 9, 2]
    truth = greedy_decode(target, prompt, 60)
    wrong = {(0, 2), (1, 0), (3, 3), (4, 1)}
    result = speculate(target, OracleDrafter(truth, len(prompt), wrong, 256), prompt, 40, 4)
    assert result.tokens == truth[:40]
    assert result.accepted_per_step[:5] == [2, 0, 4, 3, 1]
    assert all(a == 4 for a in result.accepted_per_step[5:])
    rounds = len(result.accepted_per_step)
    assert result.acceptance_length == pytest.approx(1 + sum(result.accepted_per_step) / rounds)
    assert result.per_position_acceptance[0] == pytest.approx((rounds - 1) / rounds)
    assert result.drafts_proposed == 4 * rounds
    for r, drafts in enumerate(result.drafts):  # each draft is the truth unless we corrupted it
        start = len(prompt) + 1 + sum(a + 1 for a in result.accepted_per_step[:r]) - len(prompt)
        for i, d in enumerate(drafts):
            if (r, i) not in wrong and start + i < len(truth):
                assert d == truth[start + i]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_lossless_on_other_target_families(tmp_path, family, eagle3_ckpt):
    model = load_causal_lm(make_target(tmp_path / family, family, seed=2), dtype=torch.float64)
    target = ReferenceTarget(model, (1, 3, 4))
    drafter = ReferenceDrafterBackend(build_drafter(eagle3_ckpt, torch.float64, target_model=model))
    for depth in (1, 3, 5):
        prompt = [11, 22, 33, 44, depth]
        truth = greedy_decode(target, prompt, 16)
        assert speculate(target, drafter, prompt, 16, depth).tokens == truth
        oracle = OracleDrafter(greedy_decode(target, prompt, 40), len(prompt), {(1, 0)}, 256)
        assert speculate(target, oracle, prompt, 16, depth).tokens == truth


def test_rejection_sampling_reproduces_the_target_distribution():
    # Token emitted at the first draft position must be distributed as p, whatever q is.
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(2, 6) * 1.5
    sampler = _Sampler(temperature=1.0, seed=123)
    p, q = sampler.probs(p_logits), sampler.probs(q_logits)
    counts = torch.zeros(6)
    n = 20000
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=sampler.gen))
        accepted, nxt = sampler.verify(torch.stack([p_logits, p_logits]), [d], [q])
        counts[d if accepted else nxt] += 1
    freq = counts / n
    assert torch.allclose(freq, p.float(), atol=0.015), (freq, p)


def test_sampling_run_is_seeded_and_reproducible(pair):
    target, drafter = pair
    a = speculate(target, drafter, [1, 2, 3], 15, 3, temperature=0.8, seed=7)
    b = speculate(target, drafter, [1, 2, 3], 15, 3, temperature=0.8, seed=7)
    assert a.tokens == b.tokens and a.accepted_per_step == b.accepted_per_step
    assert len(a.tokens) == 15


def test_empty_result_statistics():
    r = SpecResult(tokens=[1], drafts=[], accepted_per_step=[], depth=3)
    assert r.acceptance_length == 0.0 and r.per_position_acceptance == [0.0, 0.0, 0.0]
