"""Runtimes over a capture instead of a target (`PairSource.capture`): the runtime's own drafter
(the reference module, or the exported ONNX drafter graphs) with a `CaptureTarget`, so a target too
large for this machine is never loaded. Greedy only: a capture holds greedy continuations.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle31_export.errors import UserError
from eagle31_export.formats.capture import Capture
from eagle31_export.reference.capture_target import CaptureTarget, load_capture_pair
from eagle31_export.runtime.registry import LoadOptions, LoopSpeculator, PairSource


class CaptureSpeculator(LoopSpeculator):
    """The one loop over a `CaptureTarget`; each run first selects its prompt in the capture."""

    target: CaptureTarget

    def run(self, prompt_ids, max_new_tokens, depth, temperature=0.0, seed=0, stop_ids=(), observer=None):
        self._start(prompt_ids, max_new_tokens, depth, temperature)
        return super().run(prompt_ids, max_new_tokens, depth, temperature, seed, stop_ids, observer)

    def replay(self, prompt_ids, run, observer=None):
        self._start(prompt_ids, len(run.tokens), run.depth, 0.0)
        return super().replay(prompt_ids, run, observer)

    def _start(self, prompt_ids, max_new_tokens: int, depth: int, temperature: float) -> None:
        if temperature != 0:
            raise UserError("a capture holds the target's greedy continuations only: run at --temperature 0, "
                            "or give --target to sample")
        self.target.select(list(prompt_ids))
        self.target.capture.serves(max_new_tokens, depth)


def _no_act_quant(options: LoadOptions) -> None:
    if options.act_quant:
        raise UserError("--act-quant changes how the target computes; a capture holds what it computed: "
                        "drop --act-quant, or give --target")


def load_reference(drafter: Path | None, capture: Path, options: LoadOptions, kernels) -> CaptureSpeculator:
    _no_act_quant(options)
    if drafter is None:
        raise UserError("--runtime reference with --capture needs --drafter")
    pair = load_capture_pair(drafter, Capture.open(capture), dtype=options.dtype, kernels=kernels)
    speculator = CaptureSpeculator("reference", pair.target, pair.drafter,
                                   exact=options.dtype in (torch.float32, torch.float64))
    speculator.pair = pair
    return speculator


def load_onnxruntime(source: PairSource, options: LoadOptions, workdir: Path | None) -> CaptureSpeculator:
    """The exported drafter graphs (`source.artifacts`, or exported from `source.drafter` into
    `workdir`, with the target's input embeddings from the capture where the drafter has none);
    an export's target graph, if any, is not used: the capture stands in for the target."""
    from eagle31_export.runtime.onnxruntime import OnnxExport, OrtChainDrafterBackend, OrtDrafterBackend

    _no_act_quant(options)
    capture = Capture.open(source.capture)
    folder = source.artifacts
    if folder is None:
        if source.drafter is None or workdir is None:
            raise UserError("--runtime onnxruntime with --capture needs --onnx DIR or --drafter D (exported here)")
        from eagle31_export.export.onnx_export import export_onnx
        from eagle31_export.formats.capture import drafter_with_embeddings
        from eagle31_export.formats.drafter import read_drafter
        from eagle31_export.reference.capture_target import fit_drafter

        fit_drafter(read_drafter(source.drafter), capture, source.drafter)
        drafter = drafter_with_embeddings(source.drafter, capture, workdir / "drafter")
        folder = export_onnx(drafter, workdir / "onnx")
    export = OnnxExport.open(folder)
    drafter_backend = (OrtChainDrafterBackend if options.chain else OrtDrafterBackend)(export, options.threads)
    meta = export.meta["drafter"]
    ids = meta.get("aux_layer_ids")
    if ids is None:  # exported without a target: the drafter's default taps for the captured target
        from eagle31_export.config import default_aux_layer_ids

        ids = default_aux_layer_ids(capture.target_info.num_hidden_layers)
    if tuple(ids) != capture.aux_layer_ids:
        raise UserError(f"the drafter graphs in {folder} read the outputs of layers {list(ids)}, the capture "
                        f"{capture.folder} holds layers {list(capture.aux_layer_ids)}: if the drafter reads the "
                        "latter, the export has its tapped layers wrong; to run this export, re-capture with "
                        f"--aux-layer-ids {','.join(map(str, ids))}")
    vocab = meta["config"].get("vocab_size")
    if vocab is not None and vocab != capture.vocab_size:
        raise UserError(f"the drafter in {folder} has vocab_size {vocab}, the captured target {capture.vocab_size}")
    return CaptureSpeculator("onnxruntime", CaptureTarget(capture), drafter_backend,
                             exact=export.meta.get("dtype") == "fp32")
