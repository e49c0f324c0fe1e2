"""vLLM's CPU rejection-sampling kernels called directly with hand-made inputs, beside what the rule says.

Run with the vLLM environment's interpreter (`make setup-vllm`):

    .venv-vllm/bin/python benchmarks/vllm_cpu_sampler_kernels.py

One request, two drafts, a vocabulary of four. `_rejection_random_sample_kernel_impl` (no draft
probabilities) must accept draft i iff p_target(d_i) >= u_i and stop at the first rejection, writing the
recovered token there; `_sample_recovered_tokens_kernel_impl` must return argmax(p * inv_q) with the draft
masked out. Each line prints what the kernel wrote and what the rule says; the last line says whether all
agree. docs/runtimes.md, "Sampling parity", quotes it.
"""

from __future__ import annotations

import torch
from vllm.platforms import current_platform
from vllm.utils import cpu_triton_utils as kernels

PLACEHOLDER = -1


def rule_output(target: torch.Tensor, drafts: list[int], uniform: list[float], recovered: list[int], bonus: int):
    out = []
    for i, d in enumerate(drafts):
        if float(target[i, d]) >= uniform[i]:
            out.append(d)
            continue
        return out + [recovered[i]] + [PLACEHOLDER] * (len(drafts) - i)
    return out + [bonus]


def rule_recovered(target: torch.Tensor, drafts: list[int], inv_q: torch.Tensor) -> list[int]:
    out = []
    for i, d in enumerate(drafts):
        score = target[i].clone()
        score[d] = 0
        out.append(int(torch.argmax(score * inv_q[0])))
    return out


def main() -> None:
    current_platform.import_kernels()  # the CPU build's _C ops, for this machine's instruction set
    target = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float32)
    drafts, bonus, recovered = [1, 2], 3, [0, 3]
    same = True
    for uniform in ([0.5, 0.1], [0.7, 0.1], [0.5, 0.3], [0.05, 0.05]):
        out = torch.full((1, 3), PLACEHOLDER, dtype=torch.int32)
        kernels._rejection_random_sample_kernel_impl(
            out, torch.tensor([2]), torch.tensor(drafts), None, target, torch.tensor([bonus]), torch.tensor(recovered),
            torch.tensor(uniform, dtype=torch.float64), torch.tensor([False]), 2, 4, NO_DRAFT_PROBS=True)
        want = rule_output(target, drafts, uniform, recovered, bonus)
        same &= out[0].tolist() == want
        print(f"accept/reject, u = {uniform}: kernel {out[0].tolist()}, rule {want}")
    for inv_q in (torch.ones(1, 4), torch.tensor([[1.0, 100.0, 1.0, 1.0]])):
        got = torch.full((2,), PLACEHOLDER, dtype=torch.int64)
        kernels._sample_recovered_tokens_kernel_impl(got, torch.tensor([2]), torch.tensor(drafts), None, target,
                                                     inv_q, 4, NO_DRAFT_PROBS=True)
        want = rule_recovered(target, drafts, inv_q)
        same &= got.tolist() == want
        print(f"recovered, inv_q = {inv_q[0].tolist()}: kernel {got.tolist()}, rule {want}")
    print("the kernels follow the rule on every case" if same else "the kernels DIFFER from the rule")


if __name__ == "__main__":
    main()
