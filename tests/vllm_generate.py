"""Run by the vLLM environment's interpreter (tests/test_vllm_nvfp4.py): load each target folder in
vLLM's offline engine, target alone, and decode greedily from one prompt. Prints one JSON line per
folder: {"tokens", "logprobs"} (each chosen token's log-probability), or {"error", "raised_in"} (the
exception's type and the vLLM file and line that raised it) where the engine did not start.

    python tests/vllm_generate.py DTYPE FOLDER [FOLDER ...]
"""

import gc
import json
import sys
import traceback

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

PROMPT = [1, 5, 9, 17, 33, 65]


def generate(folder: str, dtype: str) -> dict:
    llm = LLM(model=folder, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True, max_model_len=256,
              tensor_parallel_size=1, distributed_executor_backend="uni", seed=0, generation_config="vllm",
              gpu_memory_utilization=0.2)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)[0].outputs[0]
    logprobs = [step[token].logprob for step, token in zip(out.logprobs, out.token_ids)]
    del llm
    gc.collect()
    return {"tokens": list(out.token_ids), "logprobs": logprobs}


def main() -> None:
    dtype, folders = sys.argv[1], sys.argv[2:]
    for folder in folders:
        try:
            result = generate(folder, dtype)
        except Exception as err:  # noqa: BLE001 - what vLLM raised is the result
            frames = [f for f in traceback.extract_tb(err.__traceback__) if "/vllm/" in f.filename]
            where = f"{frames[-1].filename.split('/vllm/', 1)[1]}:{frames[-1].lineno}" if frames else None
            result = {"error": f"{type(err).__name__}: {err}".strip(), "raised_in": where}
        print(json.dumps({"folder": folder, **result}), flush=True)


if __name__ == "__main__":
    main()
