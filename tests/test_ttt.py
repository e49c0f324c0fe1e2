"""The teacher-forced chain (used to train the tiny pair and to measure agreement) computes
exactly what the reference drafter runs at inference: otherwise the drafters would be trained
for a different model."""

import pytest
import torch

from factories import assert_ttt_matches_inference, drafter_config_for, random_drafter
from eagle31_export.reference.drafter import build_drafter


def _drafter_and_inputs(llama_info, eagle31: bool, seed: int, batch: int, t: int, unroll: int):
    """A random fp64 drafter, token ids for `t` chains of `unroll` steps, and random tapped states."""
    cfg = drafter_config_for(llama_info, fc_norm=eagle31, norm_output=eagle31)
    drafter = build_drafter(random_drafter(cfg, seed=seed, with_embeddings=True), dtype=torch.float64)
    x = torch.randint(0, 256, (batch, t + unroll + 1))
    taps = torch.randn(batch, t, cfg.fc_in_features, dtype=torch.float64)
    return drafter, x, taps


@pytest.mark.parametrize("eagle31", [False, True])
def test_ttt_matches_inference_chain(llama_info, eagle31):
    unroll = 3
    drafter, x, taps = _drafter_and_inputs(llama_info, eagle31, seed=4, batch=1, t=6, unroll=unroll)
    assert_ttt_matches_inference(drafter, taps, x, unroll)


@pytest.mark.parametrize("eagle31", [False, True])
def test_ttt_at_anchors_is_the_full_chain_at_those_rows(llama_info, eagle31):
    """Long windows train on some anchors only (examples/tiny/train_long.py): the same numbers."""
    from eagle31_export.reference.ttt import ttt_forward

    unroll = 3
    drafter, x, taps = _drafter_and_inputs(llama_info, eagle31, seed=5, batch=2, t=12, unroll=unroll)
    anchors = torch.tensor([0, 3, 4, 9, 11])
    with torch.no_grad():
        full = ttt_forward(drafter, taps, x, unroll)
        some = ttt_forward(drafter, taps, x, unroll, anchors)
    for k in range(unroll):
        torch.testing.assert_close(some[k], full[k][:, anchors], rtol=1e-12, atol=1e-12)
