"""The EAGLE 3.1 fused kernels from Python: building, loading, torch custom ops, weight folding.

    fold_fc_norm_weights(fc_weight, norm_weights, num_sources)   export-time folding (ONNX reuses it)
    build_plugins(...) / ensure_cpu_library(...)                 CMake over plugins/
    torch.ops.eagle31.fc_norm / torch.ops.eagle31.post_norm_feedback
    PluginKernels()                                              DrafterKernels over those ops
"""

from eagle31_export.kernels.build import (
    BuildResult,
    build_plugins,
    default_build_dir,
    ensure_cpu_library,
    find_nvcc,
    plugin_source_dir,
)
from eagle31_export.kernels.folding import fold_fc_norm_weights
from eagle31_export.kernels.library import KernelLibrary
from eagle31_export.kernels.torch_ops import (
    PluginKernels,
    fc_norm_kernel_form,
    load_cpu_kernels,
    load_cuda_kernels,
)

__all__ = [
    "BuildResult",
    "KernelLibrary",
    "PluginKernels",
    "build_plugins",
    "default_build_dir",
    "ensure_cpu_library",
    "fc_norm_kernel_form",
    "find_nvcc",
    "fold_fc_norm_weights",
    "load_cpu_kernels",
    "load_cuda_kernels",
    "plugin_source_dir",
]
