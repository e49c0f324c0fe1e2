"""Our vLLM plugin's chunk-tail probe and wrapper (plugins/vllm/eagle31_vllm_plugin/chunk_tail.py), on
methods of the shape of vLLM 0.32's `prepare_next_token_ids_padded`, written here: the probe tells the
prompt's last token from the token after the chunk, and the wrapper makes the first read the second.
The real method, in a real engine: tests/test_vllm_engine.py (chunked prefill, fixed and as shipped)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

PLUGIN_ROOT = Path(__file__).resolve().parents[1] / "plugins" / "vllm"
sys.path.insert(0, str(PLUGIN_ROOT))  # the plugin package, which vLLM alone installs

from eagle31_vllm_plugin import chunk_tail  # noqa: E402


def last_token_backup(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
    """vLLM 0.32's choice: every request's token at num_tokens_no_spec - 1, then the kernel."""
    for i in range(gpu_input_batch.num_reqs):
        request = requests[gpu_input_batch.req_ids[i]]
        self.backup_next_token_ids.np[i] = request.get_token_id(gpu_input_batch.num_tokens_no_spec[i] - 1)
    self.backup_next_token_ids.copy_to_gpu(gpu_input_batch.num_reqs)
    return "kernel ran"


def computed_token_backup(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
    """Another choice (the chunk's start): not the defect the plugin knows."""
    for i in range(gpu_input_batch.num_reqs):
        request = requests[gpu_input_batch.req_ids[i]]
        self.backup_next_token_ids.np[i] = request.get_token_id(gpu_input_batch.num_computed_tokens_cpu[i])
    self.backup_next_token_ids.copy_to_gpu(gpu_input_batch.num_reqs)


def test_the_probe_reads_which_token_a_partial_prefill_gets():
    batch = chunk_tail._Batch
    assert chunk_tail.backup_token_read(last_token_backup) == batch.PROMPT - 1
    assert chunk_tail.backup_token_read(computed_token_backup) == 0
    assert chunk_tail.backup_token_read(lambda *args: None) is None  # returns without choosing: not recognised


def test_the_wrapper_reads_the_token_after_the_chunk_and_restores_the_batch():
    fixed = chunk_tail.reading_the_next_prompt_token(last_token_backup)
    assert chunk_tail.backup_token_read(fixed, chunk_tail._Runner(chunk_tail._Batch.SEQ_LEN)) == chunk_tail._Batch.SEQ_LEN

    # two requests: a partial prefill (6 of 10 tokens) and a decode (its sequence covers its tokens)
    class Buffer:
        np = np.zeros(2, dtype=np.int64)

        def copy_to_gpu(self, n):
            pass

    class Request:
        def __init__(self, base):
            self.base = base

        def get_token_id(self, index):
            return self.base + int(index)

    class Batch:
        num_reqs, req_ids = 2, ["a", "b"]
        num_tokens_no_spec = np.array([10, 20], dtype=np.int32)

    class Runner:
        optimistic_seq_lens_cpu = torch.tensor([6, 20], dtype=torch.int32)

    proposer = type("Proposer", (), {})()
    proposer.backup_next_token_ids = Buffer()
    runner = Runner()
    setattr(proposer, chunk_tail.RUNNER_ATTR, lambda: runner)
    batch = Batch()
    assert fixed(proposer, None, {"a": Request(100), "b": Request(200)}, batch, None) == "kernel ran"
    assert proposer.backup_next_token_ids.np.tolist() == [106, 219]  # token 6 after the chunk; the decode's as shipped
    assert batch.num_tokens_no_spec.tolist() == [10, 20]

    # without a runner (a proposer built before the plugin wrapped __init__) the shipped choice stands
    setattr(proposer, chunk_tail.RUNNER_ATTR, None)
    fixed(proposer, None, {"a": Request(100), "b": Request(200)}, batch, None)
    assert proposer.backup_next_token_ids.np.tolist() == [109, 219]
