"""A capture as the speculation loop's target: `CaptureTarget` serves greedy speculation exactly
without the target model, so both parity sides can run on a machine that cannot hold it.

Why reading a capture is enough: at temperature 0 the loop reads the target's logits only at
positions whose whole prefix is the target's greedy sequence (draft i is compared with the argmax
at row i only after drafts[:i] were accepted; the bonus token is read at the first mismatch), and
keeps tapped states only of accepted positions, which are on that sequence too. Every such row
is in the capture. Rows off the greedy sequence come back as NaN (logits and taps): a correct
loop never reads them, and a loop that did would produce NaN-derived tokens, not plausible ones.
A row on the greedy sequence past the end of the capture is refused in one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from eagle31_export.config import TargetInfo
from eagle31_export.errors import UserError
from eagle31_export.formats.capture import Capture, PromptCapture
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, read_drafter
from eagle31_export.reference.speculate import ReferenceDrafterBackend


class CaptureTarget:
    """`TargetBackend` over a capture: logits rebuilt from the top-k (-inf elsewhere, so every
    argmax is the target's), taps as captured, for positions on the greedy sequence."""

    def __init__(self, capture: Capture, dtype: torch.dtype | None = None):
        self.capture, self.dtype = capture, dtype or capture.dtype
        self.vocab_size = capture.vocab_size
        self.aux_layer_ids = capture.aux_layer_ids
        self.selected: int | None = None
        self._record: tuple[int, PromptCapture, list[int]] | None = None
        self.reset()

    def select(self, prompt: list[int]) -> None:
        """The prompt the next run starts from (needed when its first forward is longer than the
        prompt, as replay's is); refuses a prompt the capture does not hold."""
        self.selected = self.capture.require(list(prompt))

    @property
    def length(self) -> int:
        return len(self.ids)

    def reset(self) -> None:
        self.ids: list[int] = []
        self.index: int | None = None
        self.match = 0  # length of the common prefix of `ids` and the captured sequence

    def truncate(self, length: int) -> None:
        del self.ids[length:]
        self.match = min(self.match, length)

    def _begin(self, ids: list[int]) -> None:
        if self.selected is not None and ids[: len(p := self.capture.prompt(self.selected))] == p:
            self.index = self.selected
        else:
            self.index = self.capture.require(ids, "the first forward's tokens")
        if self._record is None or self._record[0] != self.index:
            record = self.capture.load(self.index)
            self._record = (self.index, record, [int(t) for t in record.tokens])

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        new = [int(t) for t in input_ids[0]]
        if not self.ids:
            self._begin(new)
        _, record, tokens = self._record
        start = len(self.ids)
        self.ids += new
        while self.match < min(len(self.ids), len(tokens)) and self.ids[self.match] == tokens[self.match]:
            self.match += 1
        t, rows = len(new), record.aux.shape[0]  # rows = len(tokens) - 1
        logits = torch.full((1, t, self.vocab_size), float("nan"))
        taps = torch.full((1, t, record.aux.shape[1]), float("nan"), dtype=self.dtype)
        on_path = range(start, min(self.match, start + t))  # rows whose whole prefix is the greedy sequence
        if on_path:
            if on_path[-1] >= rows:
                self._too_short(on_path[-1], record)
            sel = torch.arange(on_path.start, on_path.stop)
            block = torch.full((len(sel), self.vocab_size), float("-inf"))
            block.scatter_(1, record.topk_indices[sel], record.topk_values[sel])
            logits[0, : len(sel)] = block
            taps[0, : len(sel)] = record.aux[sel].to(self.dtype)
        return (logits[:, -logits_to_keep:] if logits_to_keep else logits), taps

    def _too_short(self, position: int, record: PromptCapture) -> None:
        need = max(1, position - record.prompt_len + 1 - self.capture.depth)
        raise UserError(f"the run reads the target after {position + 1} tokens of prompt {self.index} "
                        f"({record.prompt_len} prompt + {position + 1 - record.prompt_len} generated), past the "
                        f"capture's {len(record.tokens) - record.prompt_len} tokens: re-capture with "
                        f"--max-new-tokens >= {need} (at --depth {self.capture.depth})")


class CapturedEmbeddings(nn.Module):
    """The target's embeddings from a capture, where a drafter borrows them (`build_drafter`):
    the input embedding always; the output embedding only when the target ties the two."""

    def __init__(self, capture: Capture):
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(capture.embeddings(), freeze=True)
        self.tied = capture.target_info.tie_word_embeddings
        self.folder = capture.folder

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def get_output_embeddings(self) -> nn.Embedding:
        if not self.tied:
            raise UserError(f"the drafter has no lm_head and borrows the target's, which the capture {self.folder} "
                            "does not hold (only the input embeddings); run parity with --target")
        return self.embed


@dataclass
class CapturePair:
    checkpoint: DrafterCheckpoint
    target_info: TargetInfo
    aux_layer_ids: tuple[int, ...]
    target: CaptureTarget
    drafter: ReferenceDrafterBackend


def fit_drafter(ckpt: DrafterCheckpoint, capture: Capture, name: object) -> tuple[int, ...]:
    """Refuse a drafter that does not fit the captured target or reads other layers than were tapped."""
    from eagle31_export.formats.pair import check_fits

    info = capture.target_info
    check_fits(ckpt, info, name, capture.folder)
    ids = tuple(ckpt.config.resolved_aux_layer_ids(info.num_hidden_layers))
    if ids != capture.aux_layer_ids:
        raise UserError(f"drafter {name} reads the outputs of layers {list(ids)}, the capture {capture.folder} "
                        f"tapped {list(capture.aux_layer_ids)}: re-capture with --drafter {name}")
    return ids


def load_capture_pair(drafter: str | os.PathLike, capture: Capture, dtype: torch.dtype = torch.float32,
                      kernels=None) -> CapturePair:
    """The reference drafter over a capture: the reference pair without the target model."""
    from eagle31_export.reference.drafter import build_drafter

    ckpt = read_drafter(drafter)
    ids = fit_drafter(ckpt, capture, drafter)
    module = build_drafter(ckpt, dtype=dtype, target_model=CapturedEmbeddings(capture), kernels=kernels)
    return CapturePair(ckpt, capture.target_info, ids, CaptureTarget(capture, dtype), ReferenceDrafterBackend(module))
