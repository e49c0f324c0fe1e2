"""Decoder layers in stored tensor names, as causal LMs and their multimodal wrappers store them
(vision or audio towers number their own layers and are not counted). Shared by the target
checkpoint reader and the NVFP4 model builder.
"""

from __future__ import annotations

import re

LAYER_INDEX = re.compile(r"^(?:model\.|language_model\.|transformer\.|model\.language_model\.|"
                         r"language_model\.model\.|model\.decoder\.)?(?:layers|h)\.(\d+)\.")


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to, or None (embeddings, final norm, lm_head, towers)."""
    m = LAYER_INDEX.search(name)
    return int(m.group(1)) if m is not None else None


def past_layers(name: str, num_layers: int) -> bool:
    """Whether the tensor belongs to a layer the config does not declare (an MTP head, say)."""
    index = layer_index(name)
    return index is not None and index >= num_layers
