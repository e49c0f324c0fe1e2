"""A target loaded tensor-parallel across the processes of a `torchrun` launch, with transformers'
own tensor parallelism (its per-architecture `tp_plan`, sharding styles and hooks).

Plain checkpoints: `from_pretrained(..., tp_plan="auto")`; transformers starts torch.distributed
(gloo on CPU, nccl on GPUs) and every rank reads only its shard of each weight.

NVFP4 checkpoints: transformers cannot read them (it would need its own quantizer), so the
project's streaming reader dequantizes them into the plain architecture as in
`formats.nvfp4.model.build_model`, and transformers' machinery shards that model: the model is built
without memory (`init_empty_weights`), `distribute_model` installs the plan's hooks, and each
weight, dequantized one Linear at a time, is cut by the plan's own sharding style
(`TensorParallelLayer.shard_tensor`) before it is set, as `from_pretrained` does for plain
weights. Each rank then holds its shards plus one dequantized Linear at a time.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from eagle31_export.errors import CheckpointError, UserError
from eagle31_export.formats.nvfp4.numerics import dequantize
from eagle31_export.formats.nvfp4.reader import NVFP4Checkpoint
from eagle31_export.formats.nvfp4.scheme import detect_scheme


def launch_world() -> tuple[int, int]:
    """(rank, world size) of this process as torchrun set them; (0, 1) outside torchrun."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UserError("RANK / WORLD_SIZE are not integers; launch with torchrun --nproc-per-node N") from None


def load_causal_lm_tp(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The target sharded across this torchrun launch's processes; call it on every rank."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _require_accelerate()
    from eagle31_export.formats.target.checkpoint import check_target

    check_target(path)  # the checkpoint against its config, before any weight is read (as load_causal_lm)
    if detect_scheme(path) is not None:
        return _load_nvfp4_tp(NVFP4Checkpoint.open(path), dtype)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot read the target config ({err})") from None
    _require_plan(config, path)
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=dtype, tp_plan="auto",
                                                 local_files_only=True, trust_remote_code=False)
    return model.eval()


def _require_accelerate() -> None:
    try:
        import accelerate  # noqa: F401  (transformers' tensor parallelism needs it)
    except ModuleNotFoundError:
        raise UserError("tensor-parallel loading needs accelerate; pip install accelerate") from None


def _require_plan(config, path) -> None:
    """A model type without a tensor-parallel plan in transformers cannot be sharded: say so."""
    cls = type(config)
    plan = getattr(config, "base_model_tp_plan", None) or getattr(cls, "base_model_tp_plan", None)
    if not plan:
        raise UserError(f"{path}: transformers has no tensor-parallel plan for model_type "
                        f"{getattr(config, 'model_type', '?')!r}; run without torchrun (one process)")


def _load_nvfp4_tp(ckpt: NVFP4Checkpoint, dtype: torch.dtype) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.integrations.tensor_parallel import distribute_model, initialize_tensor_parallelism

    from eagle31_export.formats.nvfp4.model import plain_config

    config = plain_config(ckpt.config)
    _require_plan(config, ckpt.folder)
    device, mesh, tp_size = initialize_tensor_parallelism("auto")
    with init_empty_weights():  # parameters on the meta device; buffers (rope tables) real
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except ValueError as err:
            raise CheckpointError(f"{ckpt.folder}: cannot build a causal LM from config.json ({err})") from None
    distribute_model(model, None, None, mesh, tp_size)  # the plan's hooks; weights come next
    loader = _ShardLoader(model, mesh, torch.device(device if isinstance(device, str) else device), dtype)
    embed_name = _weight_name(model, model.get_input_embeddings())
    embed = None
    for name, tensor in ckpt.iter_other_tensors():
        if name == embed_name:
            embed = tensor
        loader.put(name, tensor, ckpt)
    for q in ckpt.iter_linears():
        loader.put(f"{q.name}.weight", dequantize(q.packed, q.weight_scale, q.weight_scale_2, dtype), ckpt)
    out = model.get_output_embeddings()
    out_name = _weight_name(model, out) if out is not None else None
    tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if out_name is not None and out_name not in loader.filled and tied and embed is not None:
        loader.put(out_name, embed, ckpt)  # the lm_head's shards of the tied embedding
    loader.check_complete(ckpt)
    return model.eval()


def _weight_name(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return f"{name}.weight"
    raise CheckpointError(f"{type(model).__name__}: cannot find its embedding module")


class _ShardLoader:
    """Sets full tensors into a `distribute_model`-ed model, each cut to this rank's shard by the
    sharding style the model's tp_plan names for it (transformers' `shard_and_distribute_module`,
    with the parameter placed on this rank's device)."""

    def __init__(self, model: nn.Module, mesh, device: torch.device, dtype: torch.dtype):
        self.model, self.mesh, self.device, self.dtype = model, mesh, device, dtype
        self.rank = mesh.get_local_rank()
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.buffers = dict(model.named_buffers())
        self.filled: set[str] = set()

    def put(self, name: str, tensor: torch.Tensor, ckpt: NVFP4Checkpoint) -> None:
        from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES, _get_parameter_tp_plan

        if name in self.buffers and name not in self.params:
            with torch.no_grad():
                self.buffers[name].copy_(tensor)
            self.filled.add(name)
            return
        if name not in self.params:
            return  # not part of the architecture (build_model ignores these too)
        empty = self.params[name]
        if tuple(empty.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{ckpt.folder}: {name} has shape {list(tensor.shape)}; the model expects "
                                  f"{list(empty.shape)}")
        dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        module_name, _, attr = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        plan = _get_parameter_tp_plan(name, self.model.tp_plan or {})
        if plan is None:
            value = tensor.to(device=self.device, dtype=dtype)
        else:
            style = copy.copy(ALL_PARALLEL_STYLES[plan])
            style.empty_param, style.device_mesh, style.rank = empty, self.mesh, self.rank
            value = style.shard_tensor(tensor, tensor_idx=None, device=self.device, dtype=dtype)
            style.update_module_attributes(module)
        setattr(module, attr, nn.Parameter(value.contiguous(), requires_grad=False))
        self.filled.add(name)

    def check_complete(self, ckpt: NVFP4Checkpoint) -> None:
        missing = sorted(n for n, p in self.model.named_parameters(remove_duplicate=False) if p.is_meta)
        if missing:
            raise CheckpointError(f"{ckpt.folder}: tensor {missing[0]} is missing from the checkpoint "
                                  f"({len(missing)} missing in all); is it complete?")
