"""Target checkpoints: reading, checking and loading one (`checkpoint`), tensor-parallel loading
(`tensor_parallel`) and NVFP4 quantization of a BF16 target (`quantize`).

The reader's names stay importable from here (`from eagle31_export.formats.target import load_causal_lm`).
"""

from eagle31_export.formats.target.checkpoint import *  # noqa: F401,F403
