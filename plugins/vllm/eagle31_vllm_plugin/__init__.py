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
"""

from __future__ import annotations

import logging

log = logging.getLogger("eagle31_vllm_plugin")


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point."""
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.kernels.linear import _POSSIBLE_NVFP4_KERNELS
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel

    kernels = _POSSIBLE_NVFP4_KERNELS.setdefault(PlatformEnum.CPU, [])
    if kernels and EmulationNvFp4LinearKernel not in kernels:
        return  # this vLLM has CPU NVFP4 kernels of its own: leave its choice alone
    if EmulationNvFp4LinearKernel not in kernels:
        kernels.append(EmulationNvFp4LinearKernel)
    log.info("eagle31-vllm-plugin: NVFP4 linear layers on the CPU use vLLM's EmulationNvFp4LinearKernel")
