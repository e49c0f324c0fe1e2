"""A real consumer: vllm-project/speculators loads our speculators-layout export and drafts like the reference.

speculators 0.9.0 is installed next to the CPU torch without its dependencies (see the Makefile);
this file is skipped only when it cannot be imported.
"""

import pytest
import torch

eagle3 = pytest.importorskip("speculators.models.eagle3")

from factories import drafter_config_for, random_drafter  # noqa: E402
from eagle31_export.export.speculators_layout import speculators_checkpoint  # noqa: E402
from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint, write_drafter  # noqa: E402
from eagle31_export.formats.target.checkpoint import load_causal_lm  # noqa: E402
from eagle31_export.reference.drafter import build_drafter  # noqa: E402
from eagle31_export.reference.ttt import ttt_forward  # noqa: E402

# speculators' default attention builds flex-attention block masks of 128 positions.
T, UNROLL = 128, 3


def _load_with_info(path):
    """(model, loading info) without the verifier step.

    Eagle3DraftModel.from_pretrained cannot pass output_loading_info (its override reads
    `.config` of the returned tuple), so the base SpeculatorModel.from_pretrained is called
    for the Eagle3 class: transformers' loader then reports missing / unexpected keys.
    """
    from speculators.model import SpeculatorModel

    return SpeculatorModel.from_pretrained.__func__(eagle3.Eagle3DraftModel, str(path), output_loading_info=True)


@pytest.fixture(scope="module")
def llama_lm(llama_target):
    return load_causal_lm(llama_target, dtype=torch.float32)


@pytest.mark.parametrize("taps", [(1, 3, 4), (1, 2, 4, 5)], ids=["3-taps", "4-taps"])
def test_speculators_loads_the_export_and_drafts_like_the_reference(tmp_path, llama_target, llama_info, llama_lm,
                                                                     taps):
    cfg = drafter_config_for(llama_info, fc_norm=True, norm_output=True, aux_layer_ids=taps)
    ckpt = random_drafter(cfg, seed=3)
    out = write_drafter(speculators_checkpoint(ckpt, llama_target), tmp_path / "spec", "speculators")

    # the config validates as speculators' own, with the EAGLE 3.1 flags and the target as verifier
    config = eagle3.Eagle3SpeculatorConfig.from_pretrained(str(out))
    assert (config.fc_norm, config.norm_output) == (True, True)
    assert config.eagle_aux_hidden_state_layer_ids == [i + 1 for i in taps]  # before-layer numbering
    assert config.speculators_config.verifier.name_or_path == str(llama_target.resolve())

    # every tensor loads: nothing missing, nothing unexpected, nothing mismatched
    _, info = _load_with_info(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"]

    model = eagle3.Eagle3DraftModel.from_pretrained(str(out)).eval()
    state = model.state_dict()
    # complete: every tensor is what we wrote (none left at its initial value), embeddings the target's
    for name, tensor in ckpt.tensors.items():
        torch.testing.assert_close(state[name].to(tensor.dtype), tensor, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(state["embed_tokens.weight"], llama_lm.get_input_embeddings().weight.detach(),
                               rtol=0, atol=0)
    assert len(model.fc_norm) == len(taps)

    # its forward (teacher-forced chain, 3 steps) equals the reference's
    reference = build_drafter(ckpt, dtype=torch.float32, target_model=llama_lm)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (1, T + UNROLL + 1), generator=gen)
    taps_in = torch.randn(1, T, cfg.fc_in_features, generator=gen)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, output: logits.append(output.detach()))
    with torch.no_grad():
        want = ttt_forward(reference, taps_in, x, UNROLL)
        model(hidden_states=taps_in, input_ids=x[:, 1:1 + T], document_ids=torch.zeros(1, T, dtype=torch.long),
              position_ids=torch.arange(T).unsqueeze(0), ttt_steps=UNROLL)
    hook.remove()
    assert len(logits) == UNROLL
    for k in range(UNROLL):
        n = T - k  # speculators pads the last k positions of step k with token 0
        torch.testing.assert_close(logits[k][0, :n], want[k][0, :n], rtol=1e-5, atol=1e-5, msg=f"step {k}")


def test_without_our_embeddings_speculators_loads_silently_with_none(tmp_path, llama_target, llama_info):
    """Why the export writes embed_tokens: speculators lists embed_tokens among the keys it may miss and
    takes the verifier's only when its own holds a NaN, so a folder without them loads with no word and
    an uninitialised embedding (whatever memory it got)."""
    cfg = drafter_config_for(llama_info, fc_norm=True, norm_output=True, aux_layer_ids=(1, 3, 4))
    ckpt = speculators_checkpoint(random_drafter(cfg, seed=3), llama_target)
    bare = DrafterCheckpoint(ckpt.config, {n: ckpt.tensors[n] for n in ckpt.tensors if n != "embed_tokens.weight"})
    out = write_drafter(bare, tmp_path / "bare", "speculators")
    assert "embed_tokens.weight" not in _stored_names(out)
    _, info = _load_with_info(out)
    assert "embed_tokens.weight" not in info["missing_keys"]  # not even reported
    assert "embed_tokens.weight" in eagle3.Eagle3DraftModel._keys_to_ignore_on_load_missing


def _stored_names(folder):
    from safetensors import safe_open

    names = []
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as handle:
            names.extend(handle.keys())
    return names
