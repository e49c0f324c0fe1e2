"""The streaming weight checks: every non-finite value is found wherever it sits (piece
boundaries included), norms that are all zero (also -0.0) are named, dtypes match roles."""

import pytest
import torch
from safetensors.torch import save_file

from eagle31_export.formats.safetensors_io import SafetensorsDir
from eagle31_export.formats.weight_checks import role_of, scan_checkpoint, scan_tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_single_bad_value_is_found_at_any_position_and_piece_size(tmp_path, dtype, value):
    rows, cols = 37, 19
    for index in (0, rows * cols // 2, rows * cols - 1):
        folder = tmp_path / f"{index}"
        folder.mkdir()
        bad = torch.randn(rows, cols).to(dtype)
        bad.view(-1)[index] = value
        save_file({"good.weight": torch.randn(rows, cols).to(dtype), "bad.weight": bad}, str(folder / "model.safetensors"))
        source = SafetensorsDir(folder)
        for chunk_bytes in (1, 64, 10_000, 1 << 20):  # one row per piece .. the whole tensor
            scan = scan_checkpoint(source, {"good.weight": "weight", "bad.weight": "weight"}, chunk_bytes=chunk_bytes)
            assert len(scan.problems) == 1 and scan.problems[0].startswith("bad.weight: contains NaN or Inf")
            assert scan.bytes_read == 2 * rows * cols * bad.element_size()


def test_norms_all_zero_are_named_and_roles_follow_names(tmp_path):
    tensors = {"model.norm.weight": -torch.zeros(8), "fc_norm.1.weight": torch.zeros(8),
               "layers.0.input_layernorm.weight": torch.ones(8), "lm_head.weight": torch.zeros(4, 8),
               "d2t": torch.zeros(4, dtype=torch.float64)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    source = SafetensorsDir(tmp_path)
    roles = {n: "index" if n == "d2t" else role_of(n, t.dim()) for n, t in tensors.items()}
    assert roles["model.norm.weight"] == roles["fc_norm.1.weight"] == "norm" and roles["lm_head.weight"] == "weight"
    problems = scan_checkpoint(source, roles).problems
    assert problems[0] == "d2t: stored as F64, expected an integer index map (I8, I16, I32, I64, U8, U16, U32, U64)"
    zeros = sorted(p.split(":")[0] for p in problems if "all zeros" in p)
    assert zeros == ["fc_norm.1.weight", "model.norm.weight"]  # an all-zero ordinary weight is no problem
    assert scan_checkpoint(source, roles, zero_norms_ok=True).problems == problems[:1]


def test_tensors_in_memory_get_the_same_checks():
    params = [("a.weight", torch.tensor([[1.0, float("nan")]])), ("n.norm.weight", torch.zeros(2)),
              ("c.weight", torch.ones(0, 3))]
    problems = scan_tensors(params, {n: role_of(n, t.dim()) for n, t in params}).problems
    assert [p.split(":")[0] for p in problems] == ["a.weight", "n.norm.weight"]
