"""NVFP4 checkpoints: the encoding (`numerics`), the ModelOpt and compressed-tensors layouts
(`scheme`), reading (`stream`, `reader`), writing (`writer`), converting between layouts
(`convert`), activation calibration (`calibration`) and the dequantizing model (`model`).

The numerics stay importable from here (`from eagle31_export.formats.nvfp4 import dequantize`).
"""

from eagle31_export.formats.nvfp4.numerics import *  # noqa: F401,F403
