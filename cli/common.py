"""Small helpers shared by the commands: JSON output, dtype parsing."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from eagle31_export.errors import UserError

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp64": torch.float64, "float64": torch.float64}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UserError(f"unknown dtype {name!r}; use one of fp32, fp16, bf16") from None


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
