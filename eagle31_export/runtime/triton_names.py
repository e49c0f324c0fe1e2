"""The model names of our Triton repositories (runtime/triton_repo.py writes them, the client calls them)."""

SPECULATE_MODEL = "eagle31_speculate"
GENERATE_MODEL = "eagle31_generate"
TRTLLM_MODEL = "tensorrt_llm"
