"""Triton python-backend model: EAGLE speculative decoding of a drafter/target pair on CPU.

Copied as `<model>/1/model.py` by `eagle31-export export triton --flavor cpu`; it runs inside
Triton's python stub, with the interpreter (and packages) first on PATH. Decoupled: one
response per speculation round when `streaming` is true (the tokens that round committed),
else one response; the last response carries the acceptance statistics.

Requests run concurrently: `execute` hands each to a thread of its own and returns (a decoupled
model answers through its response senders), so the requests in flight meet in the runtime's
batched backend calls (`runtime/batching.py`) as in a serving engine, instead of queueing.

Where the runtime batches, the last response also carries `batched_calls` [calls, 4]: for each
batched backend call the request took part in, its id (unique in this model instance), size,
whether a prefill was in it (0/1), and the sequences in flight when it ran; a client that sent a
level's requests unions them by id into the level's batch sizes (`runtime/triton_client.py`).

Every request is checked before it runs (`SpeculationService.parse`). A request the pair cannot
run gets INVALID_ARG (HTTP 400) with one line naming the input; any other failure gets INTERNAL
(HTTP 500) with one generic line, and the detail goes to the server log only.
"""

import json
import os
import threading
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from eagle31_export.process_memory import return_freed_memory
from eagle31_export.reference.statistics import statistics
from eagle31_export.runtime.triton_service import SpeculationService, client_error
from eagle31_export.runtime.triton_status import STATUS_PARAMETER, tag_status

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# every input of config.pbtxt (runtime/triton_repo.py: CPU_INPUTS, and streaming); an absent one reaches parse as None
INPUTS = ("input_ids", "text_input", "max_tokens", "num_draft_tokens", "stop_token_ids", "temperature", "seed",
          "top_p", "top_k", "sampling_rule", "streaming")


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)


def _parameters(request):
    try:
        return json.loads(request.parameters() or "{}")
    except Exception:  # an older backend without request parameters, or none sent
        return {}


class TritonPythonModel:
    def initialize(self, args):
        return_freed_memory()  # long prompts: freed activations leave the stub process, as in the CLI
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        pair_dir = os.path.join(os.path.dirname(__file__), params.get("pair_dir", "pair"))
        self.service = SpeculationService.from_dir(pair_dir)  # runtime named in pair.json
        self.default_max_tokens = int(params.get("default_max_tokens", "64"))
        self.in_flight = set()
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True, name="eagle31-request")
            with self.lock:
                self.in_flight.add(thread)
            thread.start()
        return None

    def finalize(self):
        with self.lock:
            running = list(self.in_flight)
        for thread in running:  # the requests in flight finish before the model unloads
            thread.join()

    def _serve(self, request):
        try:
            self._answer(request)
        finally:
            with self.lock:
                self.in_flight.discard(threading.current_thread())
                self._log_batching()

    def _log_batching(self):
        """One log line each time the largest batched call grows: what the load made of the batching."""
        sizes = getattr(getattr(self.service.speculator, "batcher", None), "batch_sizes", None)
        largest = max(sizes, default=0) if sizes else 0
        if largest > getattr(self, "largest_batch", 1):
            self.largest_batch = largest
            pb_utils.Logger.log_info(f"eagle31_speculate: largest batched call so far: {largest} sequences")

    def _answer(self, request):
        sender = request.get_response_sender()
        try:
            self._generate(request, sender)
        except Exception as err:  # the model stays up; the client gets one line
            message, client_fault = client_error(err)
            if not client_fault:  # the detail stays on the server
                pb_utils.Logger.log_error(f"eagle31_speculate: {traceback.format_exc()}")
            code = pb_utils.TritonError.INVALID_ARG if client_fault else pb_utils.TritonError.INTERNAL
            if _parameters(request).get(STATUS_PARAMETER):  # the generate front: status travels in the text
                message = tag_status(message, client_fault)
            try:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)
            except Exception:  # e.g. the final response had already gone out; nothing more to send
                pb_utils.Logger.log_error(f"eagle31_speculate: cannot send the error: {traceback.format_exc()}")

    def _generate(self, request, sender):
        checked = self.service.parse({name: _input(request, name) for name in INPUTS}, self.default_max_tokens)
        sent = []

        def send_chunk(tokens):
            sent.extend(tokens)
            sender.send(pb_utils.InferenceResponse(output_tensors=self._tokens(tokens, sent)))

        calls = []
        result = self.service.run(checked, on_tokens=send_chunk if checked.streaming else None, calls=calls)
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
        if self.service.batches:  # runtimes that do not batch have no calls to report
            rows = np.asarray([call.row() for call in calls], dtype=np.int64).reshape(-1, 4)
            outputs.append(pb_utils.Tensor("batched_calls", rows))
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
