"""The tensor each format's tapped-layer ids name is the same target tensor.

Independent oracle: transformers' `output_hidden_states`, where hidden_states[0] is the
embedding output and hidden_states[i + 1] the output of layer i.
"""

import json

import pytest
import torch

from factories import drafter_config_for, random_drafter
from eagle31_export.formats.drafter.checkpoint import read_drafter, write_drafter
from eagle31_export.formats.drafter.formats import FORMATS
from eagle31_export.reference.target import ReferenceTarget

# How each format numbers taps, from the projects' own code (docs/tapped-layers.md#per-format-numbering).
BEFORE_LAYER = {"eagle", "speculators"}


def _stored_ids(folder):
    cfg = json.loads((folder / "config.json").read_text())
    return cfg.get("eagle_aux_hidden_state_layer_ids") or cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_taps_the_same_target_tensors(tmp_path, llama_info, fp64_llama, fmt):
    ckpt = random_drafter(drafter_config_for(llama_info, aux_layer_ids=(0, 3, 6)))
    folder = write_drafter(ckpt, tmp_path / fmt, fmt)
    raw_ids = _stored_ids(folder)
    ids = read_drafter(folder).config.resolved_aux_layer_ids(llama_info.num_hidden_layers)

    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    target = ReferenceTarget(fp64_llama, ids)
    target.reset()
    _, taps = target.forward(prompt)
    with torch.no_grad():
        hidden = fp64_llama(prompt, output_hidden_states=True).hidden_states
    offset = 0 if fmt in BEFORE_LAYER else 1  # before layer j == hidden_states[j]
    expected = torch.cat([hidden[i + offset] for i in raw_ids], dim=-1)
    torch.testing.assert_close(taps, expected, rtol=0, atol=1e-12)


def test_default_taps_resolve_against_the_target(llama_info):
    cfg = drafter_config_for(llama_info)  # no ids stored: EAGLE-3 default
    assert cfg.resolved_aux_layer_ids(llama_info.num_hidden_layers) == (1, 3, 4)  # N=8: {1, N//2-1, N-4}


def test_last_layer_tap_is_pre_final_norm(fp64_llama):
    # transformers' last hidden_states entry is AFTER the final norm; a tap of layer N-1 must not be.
    n = len(fp64_llama.model.layers)
    target = ReferenceTarget(fp64_llama, (n - 1,))
    target.reset()
    _, taps = target.forward(torch.tensor([[1, 2, 3]]))
    with torch.no_grad():
        normed = fp64_llama(torch.tensor([[1, 2, 3]]), output_hidden_states=True).hidden_states[n]
    assert not torch.allclose(taps, normed)
    torch.testing.assert_close(fp64_llama.model.norm(taps), normed, rtol=0, atol=1e-12)
