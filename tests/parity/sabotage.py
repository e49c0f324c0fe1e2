"""The export bugs users hit in practice, applied on purpose.

See docs/tapped-layers.md#known-off-by-one-bugs, docs/eagle31.md#known-framework-bugs and
docs/nvfp4.md#compressed-tensors-layout.
"""

from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint


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


def scale_rope_theta(ckpt: DrafterCheckpoint, factor: float = 4.0) -> DrafterCheckpoint:
    """The drafter's rope_theta written as another model's (x4): positions rotate at other speeds."""
    return DrafterCheckpoint(ckpt.config.replace(rope_theta=ckpt.config.rope_theta * factor), ckpt.tensors)


def scale_fc(ckpt: DrafterCheckpoint, factor: float = 1.05) -> DrafterCheckpoint:
    """fc's weights scaled by 5 %: a converter's rescaling gone slightly wrong; every draft moves a little."""
    tensors = dict(ckpt.tensors)
    tensors["fc.weight"] = (tensors["fc.weight"].float() * factor).to(tensors["fc.weight"].dtype)
    return DrafterCheckpoint(ckpt.config, tensors)


# ---- NVFP4 target checkpoints, edited in place (both sides of a comparison then read the same file) ----

def drop_rope_scaling(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """A converter that forgets the drafter's rope_scaling (vllm-project/speculators PR 574)."""
    return DrafterCheckpoint(ckpt.config.replace(rope_scaling=None), ckpt.tensors)


def yarn_as_linear(ckpt: DrafterCheckpoint) -> DrafterCheckpoint:
    """yarn read as another schedule: linear with the same factor (NVIDIA-NeMo/Automodel PR 2399)."""
    linear = {"rope_type": "linear", "factor": ckpt.config.rope_scaling["factor"]}
    return DrafterCheckpoint(ckpt.config.replace(rope_scaling=linear), ckpt.tensors)


def cut_positions(ckpt: DrafterCheckpoint, positions: int = 2048) -> DrafterCheckpoint:
    """A drafter holding fewer positions than its target serves (sgl-project/sglang issue 6783)."""
    return DrafterCheckpoint(ckpt.config.replace(max_position_embeddings=positions), ckpt.tensors)


def edit_safetensors(folder, edit) -> None:
    """Apply `edit(tensors)` to every shard of the checkpoint in `folder`."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    for shard in sorted(Path(folder).glob("*.safetensors")):
        tensors = load_file(shard)
        edit(tensors)
        save_file(tensors, str(shard), metadata={"format": "pt"})


def reciprocal_global_scales(folder, suffix: str = ".weight_scale_2") -> None:
    """Every weight global scale written in the other format's convention (1 / value)."""
    def edit(tensors):
        for name in [n for n in tensors if n.endswith(suffix)]:
            tensors[name] = 1.0 / tensors[name]
    edit_safetensors(folder, edit)


def transpose_block_scales(folder, names=None) -> None:
    """Block scales stored [in/16, out] instead of [out, in/16] (all of them, or those in `names`)."""
    def edit(tensors):
        for name in [n for n in tensors if n.endswith(".weight_scale") and tensors[n].dim() == 2]:
            if names is None or name in names:
                tensors[name] = tensors[name].t().contiguous()
    edit_safetensors(folder, edit)
