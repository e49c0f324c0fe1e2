"""Runtimes over a capture instead of a target (`PairSource.capture`): the runtime's own drafter
(the reference module here; the exported ONNX drafter graphs in runtime/onnxruntime.py) with a
`CaptureTarget`, so a target too large for this machine is never loaded. Greedy only: a capture holds
greedy continuations.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle31_export.errors import UserError
from eagle31_export.formats.capture import Capture
from eagle31_export.reference.capture_target import CaptureTarget, load_capture_pair
from eagle31_export.runtime.contract import LoadOptions, LoopSpeculator


class CaptureSpeculator(LoopSpeculator):
    """The one loop over a `CaptureTarget`; each run first selects its prompt in the capture."""

    target: CaptureTarget

    def run(self, prompt_ids, max_new_tokens, depth, temperature=0.0, seed=0, stop_ids=(), observer=None):
        self._start(prompt_ids, max_new_tokens, depth, temperature)
        return super().run(prompt_ids, max_new_tokens, depth, temperature, seed, stop_ids, observer)

    def replay(self, prompt_ids, run, observer=None, follow=None):
        self._start(prompt_ids, len(run.tokens), run.depth, 0.0)
        return super().replay(prompt_ids, run, observer, follow)

    def _start(self, prompt_ids, max_new_tokens: int, depth: int, temperature: float) -> None:
        if temperature != 0:
            raise UserError("a capture holds the target's greedy continuations only: run at --temperature 0, "
                            "or give --target to sample")
        self.target.select(list(prompt_ids))
        self.target.capture.serves(max_new_tokens, depth)


def refuse_act_quant(options: LoadOptions) -> None:
    if options.act_quant:
        raise UserError("--act-quant changes how the target computes; a capture holds what it computed: "
                        "drop --act-quant, or give --target")


def load_reference(drafter: Path | None, capture: Path, options: LoadOptions, kernels) -> CaptureSpeculator:
    refuse_act_quant(options)
    if drafter is None:
        raise UserError("--runtime reference with --capture needs --drafter")
    pair = load_capture_pair(drafter, Capture.open(capture), dtype=options.dtype, kernels=kernels)
    speculator = CaptureSpeculator("reference", pair.target, pair.drafter,
                                   exact=options.dtype in (torch.float32, torch.float64))
    speculator.pair = pair
    return speculator
