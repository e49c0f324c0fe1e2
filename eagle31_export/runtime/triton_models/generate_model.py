"""Triton python-backend model: a plain request/response front for the decoupled speculation model.

Copied as `<model>/1/model.py` next to the speculation model. Decoupled models only answer
streaming gRPC; this one takes an ordinary HTTP or gRPC `infer`, forwards it (streaming off)
through Triton's BLS API, and returns the single response. The pair is loaded once, by the
speculation model; this process only moves tensors.

Requests run concurrently: `execute` hands each to a thread of its own, which forwards it and sends
its one response through the request's response sender (Triton's python backend allows that in
default mode from 24.06), so one instance keeps many requests in flight to the speculation model,
which batches them.

Errors keep their status: the speculation model's INVALID_ARG (a bad request, HTTP 400) and its
one-line message reach the client as they are; anything else is one generic INTERNAL line
(HTTP 500), its detail in the server log. The python backend drops an error's status code on
the way back through BLS, so this front asks the speculation model to put it in the message
(request parameter `STATUS_PARAMETER`) and takes it out again.
"""

import json
import threading
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from eagle31_export.runtime.triton_status import STATUS_PARAMETER, untag_status

OUTPUTS = ["output_ids", "text_output", "accepted_per_step", "acceptance_length", "acceptance_rate",
           "total_accepted_draft_tokens", "total_draft_tokens", "draft_tokens", "batched_calls"]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.target = config["parameters"]["speculation_model"]["string_value"]

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._answer, args=(request, request.get_response_sender()), daemon=True,
                             name="eagle31-forward").start()
        return None

    def _answer(self, request, sender):
        try:
            answer = self._forward(request)
        except Exception:
            pb_utils.Logger.log_error(f"eagle31_generate: {traceback.format_exc()}")
            answer = None
        sender.send(answer or pb_utils.InferenceResponse(error=pb_utils.TritonError(
            f"internal error while forwarding to {self.target}; the server log has the details",
            pb_utils.TritonError.INTERNAL)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _forward(self, request):
        inputs = [t for t in request.inputs() if t.name() != "streaming"]
        inputs.append(pb_utils.Tensor("streaming", np.asarray([False])))
        bls = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs, requested_output_names=OUTPUTS,
                                        parameters={STATUS_PARAMETER: True})
        answer = None
        for response in bls.exec(decoupled=True):
            if response.has_error():
                message, client_fault = untag_status(response.error().message())
                if client_fault is None:  # not composed by the speculation model: keep it in the log
                    pb_utils.Logger.log_error(f"eagle31_generate: {self.target} failed: {message}")
                    return None
                code = pb_utils.TritonError.INVALID_ARG if client_fault else pb_utils.TritonError.INTERNAL
                return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
            if response.output_tensors():
                answer = pb_utils.InferenceResponse(output_tensors=response.output_tensors())
        return answer
