"""Two ways to run the target for data generation, behind one call: `generate(requests) -> token ids`.

- `VllmEngine`: vLLM's offline engine (`vllm.LLM`), fp32, every request submitted at once (continuous
  batching, prefix caching), one sampling seed per request. Needs a Python with vLLM.
- `HfEngine`: transformers' batched `generate`, fp32, requests grouped by sampling settings and sorted
  by length, BATCH at a time, left-padded.

A request is (prompt ids, temperature, max new tokens, seed); temperature 0 is greedy. Each answer is
cut after its first <|im_end|> (the target's end of turn, its eos) and keeps it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

EOS = 2  # <|im_end|>
TOP_P = 1.0  # sampled at the temperature alone, as servers do by default


@dataclass(frozen=True)
class Request:
    ids: list[int]
    temperature: float
    max_tokens: int
    seed: int


def _cut(row: list[int]) -> list[int]:
    return row[:row.index(EOS) + 1] if EOS in row else row


class VllmEngine:
    name = "vllm"

    def __init__(self, target: Path, max_model_len: int = 2560, max_num_seqs: int = 128):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.llm = LLM(model=str(target), dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=True, seed=0)

    def generate(self, requests: list[Request]) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(temperature=r.temperature, top_p=TOP_P if r.temperature else 1.0,
                                 max_tokens=r.max_tokens, seed=r.seed if r.temperature else None,
                                 stop_token_ids=[EOS], skip_special_tokens=False, detokenize=False)
                  for r in requests]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r.ids) for r in requests], params, use_tqdm=False)
        return [_cut(list(o.outputs[0].token_ids)) for o in outs]


class HfEngine:
    name = "transformers"

    def __init__(self, target: Path, batch: int = 16, threads: int = 2):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch, self.batch = torch, batch
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def generate(self, requests: list[Request]) -> list[list[int]]:
        torch, out = self.torch, [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.temperature, r.max_tokens), []).append(i)
        for (temperature, max_tokens), members in groups.items():
            members.sort(key=lambda i: len(requests[i].ids))
            for b in range(0, len(members), self.batch):
                group = members[b:b + self.batch]
                width = max(len(requests[i].ids) for i in group)
                ids = torch.tensor([[EOS] * (width - len(requests[i].ids)) + requests[i].ids for i in group])
                mask = torch.tensor([[0] * (width - len(requests[i].ids)) + [1] * len(requests[i].ids) for i in group])
                torch.manual_seed(requests[group[0]].seed)
                sampling = dict(do_sample=True, temperature=temperature, top_p=TOP_P, top_k=0) if temperature \
                    else dict(do_sample=False)
                with torch.no_grad():
                    rows = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                               eos_token_id=EOS, pad_token_id=EOS, **sampling)[:, width:].tolist()
                for i, row in zip(group, rows):
                    out[i] = _cut(row)
        return out


def make(name: str, target: Path, **kw):
    return {"vllm": VllmEngine, "transformers": HfEngine}[name](target, **kw)
