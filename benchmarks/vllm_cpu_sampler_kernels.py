"""vLLM's CPU rejection sampler through `RejectionSampler.forward`, as shipped and with our plugin's fix.

Run with the vLLM environment's interpreter (`make setup-vllm`):

    .venv-vllm/bin/python benchmarks/vllm_cpu_sampler_kernels.py [--calls 1500]

One batch of three requests, each with two drafts over a vocabulary of 8 and fixed target logits:
request 0 samples at T = 0.7, request 1 at T = 1.0, request 2 is greedy. The batch goes through
`RejectionSampler.forward` (vllm/v1/sample/rejection_sampler.py) `--calls` times, first with the CPU
kernel overrides vLLM registers itself (`CpuPlatform.register_triton_kernel_overrides`), then with
our plugin (plugins/vllm, eagle31_vllm_plugin.cpu_sampler) registered first, as every vLLM process
does it, and the overrides registered again. Printed side by side, against the rule:
- draft 1 of each sampled request accepted, against sum of p_T(d1) (z: the normal z-score);
- draft 2 accepted where draft 1 was, against sum of p_T(d2) over those calls;
- the greedy request's output equal to the greedy rule (accept while the draft is the argmax, then
  the argmax), of all calls;
- rejections of sampled requests that emitted the rejected draft itself (the rule masks it out: 0).
Request 1's first draft is a token of low probability, so most of its rounds are rejections.
docs/runtimes.md, "Sampling parity", quotes this output.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import warnings
from dataclasses import dataclass, field

import torch
from vllm.platforms import current_platform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

VOCAB = 8
TEMPERATURES = (0.7, 1.0, 0.0)  # 0: greedy (vLLM's GREEDY_TEMPERATURE)
DRAFTS = ([1, 2], [5, 1], [1, 3])  # request 1 drafts a token of low probability first (p ~ 0.05)
LOGITS = torch.tensor([  # per request: the rows for draft 1, draft 2, and the bonus position
    [0.0, 2.0, 0.5, 1.0, -1.0, 0.2, 0.3, -0.5], [0.1, 0.4, 1.5, 0.2, 0.0, -0.3, 0.9, 0.0], [0.0] * 8,
    [1.0, 0.5, 0.0, 0.8, 0.3, -1.2, 1.1, 0.4], [0.2, 1.3, 0.1, 0.6, -0.4, 0.0, 0.5, 0.3], [0.0] * 8,
    [0.0, 2.0, 0.5, 1.0, -1.0, 0.2, 0.3, -0.5], [0.3, 0.1, 0.2, 1.7, 0.0, 0.4, -0.2, 0.6], [0.0] * 8,
])


@dataclass
class Tally:
    calls: int = 0
    accepted: dict = field(default_factory=dict)  # (request, draft position) -> accepted count
    expected: dict = field(default_factory=dict)  # same key -> sum of p_T(draft)
    variance: dict = field(default_factory=dict)
    rejections: int = 0
    emitted_draft: int = 0  # rejections that emitted the rejected draft
    greedy_as_rule: int = 0


def metadata() -> SpecDecodeMetadata:
    per_request = [len(d) for d in DRAFTS]
    cu = torch.tensor(per_request).cumsum(0).to(torch.int32)
    sampled = torch.tensor([n + 1 for n in per_request]).cumsum(0).to(torch.int32)
    rows = [r * 3 + i for r, d in enumerate(DRAFTS) for i in range(len(d))]
    bonus = [r * 3 + len(d) for r, d in enumerate(DRAFTS)]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([t for d in DRAFTS for t in d], dtype=torch.int32), num_draft_tokens=per_request,
        cu_num_draft_tokens=cu, cu_num_sampled_tokens=sampled,
        target_logits_indices=torch.tensor(rows, dtype=torch.int32),
        bonus_logits_indices=torch.tensor(bonus, dtype=torch.int32),
        logits_indices=torch.arange(LOGITS.shape[0], dtype=torch.int32))


def sampling_metadata() -> SamplingMetadata:
    n = len(TEMPERATURES)
    return SamplingMetadata(
        temperature=torch.tensor(TEMPERATURES, dtype=torch.float32), all_greedy=False, all_random=False,
        top_p=None, top_k=None, generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())


def greedy_rule(request: int) -> list[int]:
    out = []
    for i, draft in enumerate(DRAFTS[request]):
        best = int(LOGITS[request * 3 + i].argmax())
        out.append(best)
        if best != draft:
            return out
    return out + [int(LOGITS[request * 3 + len(DRAFTS[request])].argmax())]


def run(sampler: RejectionSampler, calls: int) -> Tally:
    tally, meta, sampling = Tally(), metadata(), sampling_metadata()
    for _ in range(calls):
        out = sampler(meta, None, LOGITS.clone(), sampling).sampled_token_ids
        tally.calls += 1
        for r, (temperature, drafts) in enumerate(zip(TEMPERATURES, DRAFTS)):
            row = out[r].tolist()
            if temperature == 0:
                tally.greedy_as_rule += [t for t in row if t != PLACEHOLDER_TOKEN_ID] == greedy_rule(r)
                continue
            for i, draft in enumerate(drafts):
                p = float(torch.softmax(LOGITS[r * 3 + i] / temperature, -1)[draft])
                key = (r, i + 1)
                tally.expected[key] = tally.expected.get(key, 0.0) + p
                tally.variance[key] = tally.variance.get(key, 0.0) + p * (1 - p)
                accepted = row[i] == draft and row[i + 1] != PLACEHOLDER_TOKEN_ID
                tally.accepted[key] = tally.accepted.get(key, 0) + accepted
                if not accepted:
                    tally.rejections += 1
                    tally.emitted_draft += row[i] == draft
                    break
    return tally


def describe(tally: Tally) -> list[str]:
    lines = []
    for (r, position), accepted in sorted(tally.accepted.items()):
        expected, variance = tally.expected[(r, position)], tally.variance[(r, position)]
        z = (accepted - expected) / math.sqrt(variance) if variance else float("nan")
        lines.append(f"T {TEMPERATURES[r]} draft {position} accepted {accepted} vs {expected:.1f} (z {z:+.1f})")
    lines.append(f"greedy request as the rule {tally.greedy_as_rule} of {tally.calls}")
    lines.append(f"rejections emitting the draft {tally.emitted_draft} of {tally.rejections} (rule: 0)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1500)
    calls = parser.parse_args().calls
    logging.getLogger("vllm").setLevel(logging.ERROR)  # re-registering the overrides warns of each
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's, met by vLLM's override scan
    os.environ.pop("EAGLE31_VLLM_KEEP_SAMPLER", None)
    current_platform.import_kernels()
    torch.manual_seed(0)
    sampler = RejectionSampler(Sampler())

    current_platform.register_triton_kernel_overrides()  # as vLLM ships them
    shipped = run(sampler, calls)

    from eagle31_vllm_plugin import cpu_sampler

    cpu_sampler.register()  # what vLLM's load_general_plugins() runs first in each process
    current_platform.register_triton_kernel_overrides()
    fixed = run(sampler, calls)
    print(f"RejectionSampler.forward, {calls} calls, 3 requests (T 0.7, T 1.0, greedy), 2 drafts each, "
          f"vocabulary {VOCAB}; plugin: {cpu_sampler._state}")
    left, right = describe(shipped), describe(fixed)
    width = max(map(len, left)) + 2
    print(f"{'as shipped':<{width}}with the plugin's fix")
    for a, b in zip(left, right):
        print(f"{a:<{width}}{b}")


if __name__ == "__main__":
    main()
