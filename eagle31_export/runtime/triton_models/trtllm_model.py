"""Triton python-backend model serving a TensorRT-LLM LLM-API configuration (`model.yaml`).

Copied as `tensorrt_llm/1/model.py` by `eagle31-export export triton --flavor trtllm`. Same
layout and tensor names as TensorRT-LLM's own LLM-API Triton model: `model.yaml` holds the
LLM arguments (`model`, `backend: pytorch`, parallel sizes, `speculative_config`) and
`triton_config` (max_batch_size, decoupled), which is applied to the model configuration at
load time. Needs `tensorrt_llm` (GPU machines), imported in `initialize`.

Tensor parallelism. Either one tritonserver process (the LLM API starts its own MPI workers for
`tensor_parallel_size` > 1), or one tritonserver per rank under `mpirun -n TP*PP` (how
TensorRT-LLM's `launch_triton_server.py` starts them). In the second case only rank 0 builds the
LLM and serves, handing the other ranks to the LLM API as its MPI session; every other rank
lends itself to that session as a worker (inside `initialize`, until the leader shuts down) and
refuses requests.

(Upstream's rank handling and cancellation, as read: docs/runtimes.md#llm-api-model-repository.)

Cancellation. A request the client cancels (gRPC stream closed with cancel_requests, a
cancelled `async_infer`) is noticed while streaming and by a watcher thread every
`triton_config.cancellation_check_period_ms` (default 100); its LLM request is aborted and the
client gets a final CANCELLED response.

Errors: a bad request (missing or undecodable `text_input`, max_tokens < 1, non-finite or
negative temperature, top_p outside (0, 1], negative top_k) is INVALID_ARG (HTTP 400) with one
line; any other failure is one generic INTERNAL line, its detail in the server log.
"""

import math
import os
import threading
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

# The package's own statistics module, copied next to this file (this folder is on sys.path):
# the same definition of tau as everywhere else, without needing eagle31_export installed.
from eagle31_statistics import acceptance_length, rounds_from_counts

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
INTERNAL_ERROR = "internal error while generating; the server log has the details"


def _model_yaml():
    path = os.environ.get("LLM_CONFIG_PATH") or os.path.join(os.path.dirname(__file__), "model.yaml")
    with open(path) as f:
        return yaml.safe_load(f)


# --- relative checkpoint paths (export triton writes `model: target`, `speculative_model: drafter`) ---
def _run_from_model_yaml_folder():
    """Relative paths in model.yaml name folders next to it, wherever the repository was moved:
    run the LLM (and the workers it starts, which inherit the working directory) from there."""
    path = os.environ.get("LLM_CONFIG_PATH") or os.path.join(os.path.dirname(__file__), "model.yaml")
    os.chdir(os.path.dirname(os.path.abspath(path)))


class BadRequest(ValueError):
    """A request that cannot run: one line, sent as INVALID_ARG."""


def _scalar(request, name, kind):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise BadRequest(f"{name} must hold exactly one value (got {values.size})")
    return kind(values[0])


def _mpi_world():
    """(rank, size) of this process in the MPI job tritonserver was started in; (0, 1) without one.
    The LLM API's own view of the job (tensorrt_llm._utils)."""
    from tensorrt_llm._utils import global_mpi_rank, global_mpi_size

    return int(global_mpi_rank()), int(global_mpi_size())


def _lend_rank_to_leader():
    """A non-zero rank: serve as an MPI worker of rank 0's LLM session until it shuts down."""
    from mpi4py.futures import MPICommExecutor
    from mpi4py.MPI import COMM_WORLD

    with MPICommExecutor(COMM_WORLD) as executor:
        if executor is not None:  # only the root of the communicator gets an executor
            raise RuntimeError(f"MPI rank {COMM_WORLD.Get_rank()} was handed the executor; rank 0 leads")


def _leader_session(world):
    """The MPI session rank 0 hands the LLM API: every rank of the job Triton was started in."""
    from mpi4py.MPI import COMM_WORLD
    from tensorrt_llm.llmapi import MpiCommSession

    return MpiCommSession(comm=COMM_WORLD, n_workers=world)


class _Served:
    """One request in flight: its response sender and LLM request; sends nothing after the final
    response, whichever thread (the serving one, the cancellation watcher) sends it first."""

    def __init__(self, request):
        self.request, self.sender = request, request.get_response_sender()
        self.llm_request = None
        self.lock = threading.Lock()
        self.finished = False

    def send(self, response, final=False):
        with self.lock:
            if self.finished:
                return False
            self.finished = final
            self.sender.send(response, flags=FINAL if final else 0)
            return True

    def cancel_if_requested(self):
        """Abort the LLM request and end the stream with CANCELLED when the client cancelled."""
        if self.finished or not self.request.is_cancelled():
            return False
        if self.llm_request is not None:
            self.llm_request.abort()
        self.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
            "request cancelled by the client", pb_utils.TritonError.CANCELLED)), final=True)
        return True


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        triton = _model_yaml()["triton_config"]
        config.set_max_batch_size(int(triton["max_batch_size"]))
        config.set_model_transaction_policy({"decoupled": bool(triton["decoupled"])})
        return config

    def initialize(self, args):
        _run_from_model_yaml_folder()
        self.llm, self.rank, self.watcher = None, 0, None
        try:
            from tensorrt_llm import LLM, SamplingParams
        except ImportError as err:
            raise pb_utils.TritonModelException(
                f"tensorrt_llm cannot be imported ({err}); this model needs a GPU machine with TensorRT-LLM "
                "(NVIDIA's tritonserver trtllm container, or `pip install tensorrt-llm` from NVIDIA's index)") from None

        config = _model_yaml()
        triton = config.get("triton_config") or {}
        options = {k: v for k, v in config.items() if k != "triton_config"}
        self.rank, world = _mpi_world()
        ranks_needed = 1
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"):
            ranks_needed *= int(options.get(key) or 1)
        if world > 1 and world != ranks_needed:
            raise pb_utils.TritonModelException(
                f"tritonserver runs as {world} MPI ranks but model.yaml needs {ranks_needed} "
                f"(tensor_parallel_size x pipeline_parallel_size x context_parallel_size); start "
                f"`mpirun -n {ranks_needed}` tritonservers, or one tritonserver (the LLM API then starts its "
                "own workers)")
        if self.rank != 0:
            pb_utils.Logger.log_info(f"tensorrt_llm: MPI rank {self.rank} of {world} works for rank 0's LLM; "
                                     "requests go to rank 0's server")
            _lend_rank_to_leader()  # returns when rank 0 shuts its session down
            return

        try:  # turns nested dicts (speculative_config, ...) into the LLM API's config objects
            from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

            options = update_llm_args_with_extra_dict({}, options)
        except ImportError:
            pass
        if world > 1:  # this job's ranks are the LLM's workers (else it spawns its own for TP > 1)
            options["_mpi_session"] = _leader_session(world)
        self.sampling_params = SamplingParams
        self.llm = LLM(**options)

        self.in_flight, self.in_flight_lock = set(), threading.Lock()
        self.check_period = int(triton.get("cancellation_check_period_ms", 100)) / 1000.0
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch_cancellations, daemon=True)
        self.watcher.start()

    def execute(self, requests):
        if self.rank != 0:
            for request in requests:
                request.get_response_sender().send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"this tritonserver is MPI rank {self.rank}, a worker of rank 0's LLM; send requests to "
                    "rank 0's server", pb_utils.TritonError.UNAVAILABLE)), flags=FINAL)
            return None
        # Each request streams from its own thread so that execute returns at once (decoupled).
        for request in requests:
            served = _Served(request)
            with self.in_flight_lock:
                self.in_flight.add(served)
            threading.Thread(target=self._serve, args=(served,), daemon=True).start()
        return None

    def _watch_cancellations(self):
        while not self.stopping.wait(self.check_period):
            with self.in_flight_lock:
                served = list(self.in_flight)
            for one in served:
                try:
                    one.cancel_if_requested()
                except Exception:
                    pb_utils.Logger.log_error(f"tensorrt_llm: cancelling a request: {traceback.format_exc()}")

    def _serve(self, served):
        try:
            self._generate(served, served.request)
        except BadRequest as err:
            served.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                str(err).splitlines()[0], pb_utils.TritonError.INVALID_ARG)), final=True)
        except Exception:
            detail = traceback.format_exc()
            try:
                if not (served.finished or served.cancel_if_requested()):  # an aborted request may raise
                    pb_utils.Logger.log_error(f"tensorrt_llm: {detail}")
                    served.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        INTERNAL_ERROR, pb_utils.TritonError.INTERNAL)), final=True)
            except Exception:  # the client is gone: nothing left to tell it
                pb_utils.Logger.log_error(f"tensorrt_llm: {detail}")
        finally:
            with self.in_flight_lock:
                self.in_flight.discard(served)

    def _generate(self, served, request):
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        if text is None or text.as_numpy().size != 1:
            raise BadRequest("send text_input: exactly one prompt string")
        text = text.as_numpy().reshape(-1)[0]
        try:
            prompt = text.decode("utf-8") if isinstance(text, bytes) else str(text)
        except UnicodeDecodeError as err:
            raise BadRequest(f"text_input is not valid UTF-8 (byte {err.start})") from None
        streaming = bool(_scalar(request, "streaming", bool))
        params = {"max_tokens": _scalar(request, "sampling_param_max_tokens", int),
                  "temperature": _scalar(request, "sampling_param_temperature", float),
                  "top_k": _scalar(request, "sampling_param_top_k", int),
                  "top_p": _scalar(request, "sampling_param_top_p", float),
                  "seed": _scalar(request, "sampling_param_seed", int)}
        _check_sampling(params)
        params = self.sampling_params(**{k: v for k, v in params.items() if v is not None})
        if served.cancel_if_requested():
            return
        served.llm_request = self.llm.generate_async(prompt, params, streaming=streaming)
        if streaming:
            last = None
            for output in served.llm_request:
                if served.cancel_if_requested():
                    return
                if last is not None:
                    served.send(self._response(last, delta=True))
                last = output
            if not served.cancel_if_requested():
                served.send(self._response(last, delta=True), final=True)
        else:
            output = served.llm_request.result()
            if not served.cancel_if_requested():
                served.send(self._response(output, delta=False), final=True)

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
        if getattr(self, "watcher", None) is not None:
            self.stopping.set()
            self.watcher.join(timeout=5)
        if getattr(self, "llm", None) is not None:
            self.llm.shutdown()  # rank 0: also releases the other ranks' workers


def _check_sampling(params):
    """BadRequest for sampling values no request may carry."""
    if params["max_tokens"] is not None and params["max_tokens"] < 1:
        raise BadRequest(f"sampling_param_max_tokens must be >= 1 (got {params['max_tokens']})")
    temperature = params["temperature"]
    if temperature is not None and (not math.isfinite(temperature) or temperature < 0):
        raise BadRequest(f"sampling_param_temperature must be a finite number >= 0 (got {temperature})")
    top_p = params["top_p"]
    if top_p is not None and not (0 < top_p <= 1):
        raise BadRequest(f"sampling_param_top_p must be in (0, 1] (got {top_p})")
    if params["top_k"] is not None and params["top_k"] < 0:
        raise BadRequest(f"sampling_param_top_k must be >= 0 (got {params['top_k']})")
