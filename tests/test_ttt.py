"""The teacher-forced chain (used to train the tiny pair and to measure agreement) computes
exactly what the reference drafter runs at inference: otherwise the drafters would be trained
for a different model."""

import pytest
import torch

from factories import drafter_config_for, random_drafter
from eagle31_export.reference.attention import KVCache
from eagle31_export.reference.drafter import build_drafter
from eagle31_export.reference.ttt import ttt_forward


@pytest.mark.parametrize("eagle31", [False, True])
def test_ttt_matches_inference_chain(llama_info, eagle31):
    cfg = drafter_config_for(llama_info, fc_norm=eagle31, norm_output=eagle31)
    drafter = build_drafter(random_drafter(cfg, seed=4, with_embeddings=True), dtype=torch.float64)
    t, unroll = 6, 3
    x = torch.randint(0, 256, (1, t + unroll + 1))
    taps = torch.randn(1, t, cfg.fc_in_features, dtype=torch.float64)
    with torch.no_grad():
        ttt = ttt_forward(drafter, taps, x, unroll)
        for anchor in range(t):  # the chain drafted from each position, as inference runs it
            cache = KVCache()
            step = drafter(x[:, 1:anchor + 2], torch.arange(anchor + 1).unsqueeze(0), taps[:, :anchor + 1], cache, True)
            torch.testing.assert_close(step.logits[0, -1], ttt[0][0, anchor], rtol=1e-9, atol=1e-9)
            for k in range(1, unroll):
                step = drafter(x[:, anchor + 1 + k:anchor + 2 + k], torch.tensor([[anchor + k]]),
                               step.fed_back[:, -1:], cache, False)
                torch.testing.assert_close(step.logits[0, -1], ttt[k][0, anchor], rtol=1e-9, atol=1e-9)
