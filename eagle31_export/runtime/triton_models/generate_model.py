"""Triton python-backend model: a plain request/response front for the decoupled speculation model.

Copied as `<model>/1/model.py` next to the speculation model. Decoupled models only answer
streaming gRPC; this one takes an ordinary HTTP or gRPC `infer`, forwards it (streaming off)
through Triton's BLS API, and returns the single response. The pair is loaded once, by the
speculation model; this process only moves tensors.
"""

import json

import triton_python_backend_utils as pb_utils

OUTPUTS = ["output_ids", "text_output", "accepted_per_step", "acceptance_length", "acceptance_rate",
           "total_accepted_draft_tokens", "total_draft_tokens", "draft_tokens"]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.target = config["parameters"]["speculation_model"]["string_value"]

    def execute(self, requests):
        import numpy as np

        responses = []
        for request in requests:
            inputs = [t for t in request.inputs() if t.name() != "streaming"]
            inputs.append(pb_utils.Tensor("streaming", np.asarray([False])))
            bls = pb_utils.InferenceRequest(model_name=self.target, inputs=inputs, requested_output_names=OUTPUTS)
            answer = None
            for response in bls.exec(decoupled=True):
                if response.has_error():
                    answer = pb_utils.InferenceResponse(error=pb_utils.TritonError(response.error().message()))
                    break
                if response.output_tensors():
                    answer = pb_utils.InferenceResponse(output_tensors=response.output_tensors())
            responses.append(answer or pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"{self.target} returned no response")))
        return responses
