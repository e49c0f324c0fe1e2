"""Triton python-backend model: EAGLE speculative decoding of a drafter/target pair on CPU.

Copied as `<model>/1/model.py` by `eagle31-export export triton --flavor cpu`; it runs inside
Triton's python stub, with the interpreter (and packages) first on PATH. Decoupled: one
response per speculation round when `streaming` is true (the tokens that round committed),
else one response; the last response carries the acceptance statistics.
"""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from eagle31_export.reference.statistics import statistics
from eagle31_export.runtime.triton_service import SpeculationService

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        pair_dir = os.path.join(os.path.dirname(__file__), params.get("pair_dir", "pair"))
        self.service = SpeculationService.from_dir(pair_dir)  # runtime named in pair.json
        self.default_max_tokens = int(params.get("default_max_tokens", "64"))

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._generate(request, sender)
            except Exception as err:  # the client gets the reason; the model stays up
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err))), flags=FINAL)
        return None

    def _generate(self, request, sender):
        ids, text = _input(request, "input_ids"), _input(request, "text_input")
        if ids is not None:
            prompt = [int(i) for i in ids]
        elif text is not None:
            raw = text[0]
            prompt = self.service.encode(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
        else:
            raise ValueError("send input_ids (INT64) or text_input (STRING)")
        max_tokens = _input(request, "max_tokens")
        depth = _input(request, "num_draft_tokens")
        streaming = _input(request, "streaming")
        stop = _input(request, "stop_token_ids")
        temperature, seed = _input(request, "temperature"), _input(request, "seed")
        sent = []

        def send_chunk(tokens):
            sent.extend(tokens)
            sender.send(pb_utils.InferenceResponse(output_tensors=self._tokens(tokens, sent)))

        result = self.service.generate(
            prompt,
            int(max_tokens[0]) if max_tokens is not None else self.default_max_tokens,
            int(depth[0]) if depth is not None else None,
            tuple(int(s) for s in stop) if stop is not None else (),
            on_tokens=send_chunk if streaming is not None and bool(streaming[0]) else None,
            temperature=float(temperature[0]) if temperature is not None else 0.0,
            seed=int(seed[0]) if seed is not None else 0,
        )
        rest = result.tokens[len(sent):]
        sent.extend(rest)
        stats = statistics(result.accepted_per_step, result.drafts)
        depth_used = result.depth
        drafts = np.asarray(stats["draft_tokens"], dtype=np.int64).reshape(-1, depth_used)
        outputs = self._tokens(rest, sent) + [
            pb_utils.Tensor("accepted_per_step", np.asarray(stats["accepted_per_step"], dtype=np.int32)),
            pb_utils.Tensor("acceptance_length", np.asarray([stats["acceptance_length"]], dtype=np.float32)),
            pb_utils.Tensor("acceptance_rate", np.asarray([stats["acceptance_rate"]], dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens",
                            np.asarray([stats["total_accepted_draft_tokens"]], dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.asarray([stats["total_draft_tokens"]], dtype=np.int32)),
            pb_utils.Tensor("draft_tokens", drafts),
        ]
        sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL)

    def _tokens(self, new, so_far):
        """output_ids: the tokens of this response; text_output: their text (when there is a tokenizer)."""
        tensors = [pb_utils.Tensor("output_ids", np.asarray(new, dtype=np.int64))]
        if self.service.tokenizer is not None:
            before = self.service.decode(so_far[: len(so_far) - len(new)])
            full = self.service.decode(so_far)
            delta = full[len(before):] if full.startswith(before) else full
            tensors.append(pb_utils.Tensor("text_output", np.asarray([delta.encode("utf-8")], dtype=np.object_)))
        return tensors
