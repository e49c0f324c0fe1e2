"""Drafter checkpoints: the canonical reader and writer (`checkpoint`), every framework's config keys
and tensor names (`formats`), and renames that rewrite a safetensors header only (`renames`).

The reader's names stay importable from here (`from eagle31_export.formats.drafter import read_drafter`).
"""

from eagle31_export.formats.drafter.checkpoint import *  # noqa: F401,F403
