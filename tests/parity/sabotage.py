"""The export bugs users hit in practice, applied on purpose.

See docs/tapped-layers.md#known-off-by-one-bugs, docs/eagle31.md#known-framework-bugs and
docs/nvfp4.md#compressed-tensors-layout.
"""

from eagle31_export.formats.drafter import DrafterCheckpoint


def shift_aux_ids(ckpt: DrafterCheckpoint, target_layers: int) -> DrafterCheckpoint:
    """The off-by-one between "before layer i" and "output of layer i" numbering."""
    ids = ckpt.config.resolved_aux_layer_ids(target_layers)
    return DrafterCheckpoint(ckpt.config.replace(aux_layer_ids=tuple(i + 1 for i in ids)), ckpt.tensors)


def pre_norm_feedback(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """An EAGLE 3.1 drafter run with EAGLE-3's pre-norm feedback (norm_output dropped)."""
    return DrafterCheckpoint(ckpt.config.replace(norm_output=False), ckpt.tensors)


def drop_fc_norm(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """fc_norm weights and flag lost on the way to the exported config."""
    tensors = {k: v for k, v in ckpt.tensors.items() if not k.startswith("fc_norm.")}
    return DrafterCheckpoint(ckpt.config.replace(fc_norm=False), tensors)


def shift_d2t(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """The draft-to-target vocabulary map off by one: draft id i lands on the target id of draft id
    i + 1 (the same set of target ids, so t2d still agrees; the last wraps to the first)."""
    import torch

    tensors = dict(ckpt.tensors)
    d2t = tensors["d2t"]
    target_ids = torch.arange(len(d2t)) + d2t
    tensors["d2t"] = torch.roll(target_ids, -1) - torch.arange(len(d2t))
    return DrafterCheckpoint(ckpt.config, tensors)
