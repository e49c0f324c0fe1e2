"""eagle31-export: EAGLE 3.1 drafters and NVFP4 targets to TensorRT-LLM / TensorRT / Triton, with parity."""

__version__ = "0.1.0"
