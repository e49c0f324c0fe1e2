"""Triton python-backend model serving a TensorRT-LLM LLM-API configuration (`model.yaml`).

Copied as `tensorrt_llm/1/model.py` by `eagle31-export export triton --flavor trtllm`. Same
layout and tensor names as TensorRT-LLM's own LLM-API Triton model: `model.yaml` holds the
LLM arguments (`model`, `backend: pytorch`, parallel sizes, `speculative_config`) and
`triton_config` (max_batch_size, decoupled), which is applied to the model configuration at
load time. Needs `tensorrt_llm` (GPU machines), imported in `initialize`.
"""

import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

# The package's own statistics module, copied next to this file (this folder is on sys.path):
# the same definition of tau as everywhere else, without needing eagle31_export installed.
from eagle31_statistics import acceptance_length, rounds_from_counts

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _model_yaml():
    path = os.environ.get("LLM_CONFIG_PATH") or os.path.join(os.path.dirname(__file__), "model.yaml")
    with open(path) as f:
        return yaml.safe_load(f)


def _scalar(request, name, kind):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else kind(tensor.as_numpy().reshape(-1)[0])


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        triton = _model_yaml()["triton_config"]
        config.set_max_batch_size(int(triton["max_batch_size"]))
        config.set_model_transaction_policy({"decoupled": bool(triton["decoupled"])})
        return config

    def initialize(self, args):
        try:
            from tensorrt_llm import LLM, SamplingParams
        except ImportError as err:
            raise pb_utils.TritonModelException(
                f"tensorrt_llm cannot be imported ({err}); this model needs a GPU machine with TensorRT-LLM "
                "(NVIDIA's tritonserver trtllm container, or `pip install tensorrt-llm` from NVIDIA's index)") from None

        options = {k: v for k, v in _model_yaml().items() if k != "triton_config"}
        try:  # turns nested dicts (speculative_config, ...) into the LLM API's config objects
            from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

            options = update_llm_args_with_extra_dict({}, options)
        except ImportError:
            pass
        self.sampling_params = SamplingParams
        self.llm = LLM(**options)

    def execute(self, requests):
        # Each request streams from its own thread so that execute returns at once (decoupled).
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None

    def _serve(self, request):
        sender = request.get_response_sender()
        try:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            prompt = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            streaming = bool(_scalar(request, "streaming", bool))
            params = {"max_tokens": _scalar(request, "sampling_param_max_tokens", int),
                      "temperature": _scalar(request, "sampling_param_temperature", float),
                      "top_k": _scalar(request, "sampling_param_top_k", int),
                      "top_p": _scalar(request, "sampling_param_top_p", float),
                      "seed": _scalar(request, "sampling_param_seed", int)}
            params = self.sampling_params(**{k: v for k, v in params.items() if v is not None})
            result = self.llm.generate_async(prompt, params, streaming=streaming)
            if streaming:
                last = None
                for output in result:
                    if last is not None:
                        sender.send(self._response(last, delta=True))
                    last = output
                sender.send(self._response(last, delta=True), flags=FINAL)
            else:
                sender.send(self._response(result.result(), delta=False), flags=FINAL)
        except Exception as err:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err))), flags=FINAL)

    def _response(self, request_output, delta):
        out = request_output.outputs[0]
        text = getattr(out, "text_diff", out.text) if delta else out.text
        ids = getattr(out, "token_ids_diff", out.token_ids) if delta else out.token_ids
        tensors = [pb_utils.Tensor("text_output", np.asarray([text.encode("utf-8")], dtype=np.object_)),
                   pb_utils.Tensor("output_ids", np.asarray(list(ids), dtype=np.int32))]
        if request_output.finished and out.finish_reason is not None:
            tensors.append(pb_utils.Tensor("finish_reason", np.asarray([str(out.finish_reason).encode()],
                                                                       dtype=np.object_)))
        metrics = getattr(out, "request_perf_metrics", None)  # set with return_perf_metrics: true
        spec = getattr(metrics, "speculative_decoding", None)
        if request_output.finished and spec is not None:
            drafted, accepted = int(spec.total_draft_tokens), int(spec.total_accepted_draft_tokens)
            # rounds from what the runtime reports (rounds may draft fewer than max_draft_len tokens)
            rounds = rounds_from_counts(len(out.token_ids), accepted)
            tensors += [
                pb_utils.Tensor("acceptance_rate", np.asarray([spec.acceptance_rate], dtype=np.float32)),
                pb_utils.Tensor("total_accepted_draft_tokens", np.asarray([accepted], dtype=np.int32)),
                pb_utils.Tensor("total_draft_tokens", np.asarray([drafted], dtype=np.int32)),
                pb_utils.Tensor("acceptance_length",
                                np.asarray([acceptance_length(accepted, rounds)], dtype=np.float32)),
            ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def finalize(self):
        if getattr(self, "llm", None) is not None:
            self.llm.shutdown()
