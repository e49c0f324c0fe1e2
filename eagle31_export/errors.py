"""Errors a user can act on. The CLI prints their message as one line and exits 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message says what is wrong and what to do."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read: names the file, the tensor, expected vs found."""


class MissingRuntimeError(UserError):
    """An optional runtime (TensorRT, TensorRT-LLM, tritonserver, nvcc) is not installed."""
