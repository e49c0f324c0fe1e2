"""The export bugs users hit in practice, applied on purpose: the package's sabotage library
(eagle31_export/sabotage.py), under the names the tests and benchmarks import.

See docs/silent-bugs.md, docs/tapped-layers.md#known-off-by-one-bugs and docs/eagle31.md#known-framework-bugs.
"""

from eagle31_export.sabotage import (  # noqa: F401
    cut_positions,
    drop_d2t,
    drop_fc_norm,
    drop_rope_scaling,
    edit_safetensors,
    fc_norm_unapplied,
    pre_norm_feedback,
    random_embed_tokens,
    reciprocal_global_scales,
    scale_fc,
    scale_rope_theta,
    shift_aux_ids,
    shift_d2t,
    sliding_window,
    transpose_block_scales,
    yarn_as_linear,
)
