"""The plugins' CPU kernels, torch ops and build helper against the reference ops (reference/ops.py).

The CPU library is built once per session with the package's own build helper (CMake) into a
temporary folder, as a fresh clone would.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from eagle31_export.kernels import (
    PluginKernels,
    build_plugins,
    fc_norm_kernel_form,
    fold_fc_norm_weights,
    load_cpu_kernels,
)
from eagle31_export.kernels import build as build_module
from eagle31_export.reference import ops as ref

def _toolchain_missing() -> bool:
    try:
        build_module.find_cmake()
        build_module.find_cxx_compiler()
    except Exception:
        return True
    return False


pytestmark = pytest.mark.skipif(_toolchain_missing(), reason="building the CPU kernels needs cmake and a C++ compiler")

HALF_EPS = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@pytest.fixture(scope="session")
def plugin_build(tmp_path_factory):
    result = build_plugins(tmp_path_factory.mktemp("eagle31-plugins"), cuda=False)
    load_cpu_kernels(result.cpu_library)
    return result


@pytest.fixture
def lib(plugin_build):
    return load_cpu_kernels(plugin_build.cpu_library)


def _sources(k: int, rows: tuple[int, ...], ht: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Sources of very different magnitudes: each must get its own 1/rms.
    return [(torch.randn(*rows, ht, generator=gen) * 10.0 ** (i - 1)).to(dtype) for i in range(k)]


def _fc_inputs(k, rows, ht, h, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed + 1)
    weight = (torch.randn(h, k * ht, generator=gen) / (k * ht) ** 0.5).to(dtype)
    norms = [(1.0 + 0.3 * torch.randn(ht, generator=gen)).to(dtype) for _ in range(k)]
    return _sources(k, rows, ht, dtype, seed), weight, norms


def _assert_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Every element within `rel` of the largest reference magnitude (cancellation-safe)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.double().abs().max().clamp_min(1e-30)
    err = (actual.double() - expected.double()).abs().max()
    assert err <= rel * scale, f"max error {err:.3e} > {rel:.1e} x {scale:.3e}"


# ---- the build ------------------------------------------------------------------------------------


def test_build_reports_each_part(plugin_build):
    assert plugin_build.parts["cpu"] == "built"
    assert plugin_build.cpu_library.is_file()
    assert plugin_build.parts["cuda"].startswith("skipped: disabled")
    if plugin_build.parts["tensorrt"].startswith("skipped"):
        log = (plugin_build.build_dir / "eagle31_build.log").read_text()
        assert "TensorRT not found: TensorRT plugin wrappers skipped" in log


# ---- Eagle31FcNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("ht", [7, 33, 64])
@pytest.mark.parametrize("rows", [(1,), (2, 3)])
def test_fc_norm_fp32_matches_reference(lib, k, ht, rows):
    sources, weight, norms = _fc_inputs(k, rows, ht, 19, torch.float32, seed=k * ht)
    # fc_norm off: the plain fc, same arithmetic as the reference up to summation order.
    _assert_rel(lib.fc_norm(sources, weight, 1e-6, False), ref.fc_norm_fusion(sources, weight, None, 1e-6), 1e-6)
    # fc_norm on: folding moves the norm weight into W, which changes the rounding only.
    folded = fold_fc_norm_weights(weight, norms, k)
    _assert_rel(lib.fc_norm(sources, folded, 1e-6, True), ref.fc_norm_fusion(sources, weight, norms, 1e-6), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,ht,h", [(1, 7, 5), (3, 33, 17), (5, 64, 48)])
def test_fc_norm_half_precision_matches_reference(lib, dtype, k, ht, h):
    sources, weight, norms = _fc_inputs(k, (4,), ht, h, dtype, seed=ht)
    folded = fold_fc_norm_weights(weight, norms, k)
    expected = ref.fc_norm_fusion(sources, weight, norms, 1e-6)
    _assert_rel(lib.fc_norm(sources, folded, 1e-6, True), expected, 4 * HALF_EPS[dtype])
    plain = ref.fc_norm_fusion(sources, weight, None, 1e-6)
    _assert_rel(lib.fc_norm(sources, weight, 1e-6, False), plain, 2 * HALF_EPS[dtype])


def test_fc_norm_kernel_form_is_the_reference_algebra():
    """sum_i s_i (W_i * w_i) a_i == fc(cat(rmsnorm_i(a_i))) exactly in fp64."""
    sources, weight, norms = _fc_inputs(3, (5,), 33, 17, torch.float64)
    folded = fold_fc_norm_weights(weight, norms, 3)
    torch.testing.assert_close(
        fc_norm_kernel_form(sources, folded, 1e-6, True), ref.fc_norm_fusion(sources, weight, norms, 1e-6),
        rtol=1e-12, atol=1e-12,
    )


def test_fold_scales_each_source_block_of_columns():
    weight = torch.arange(12.0).reshape(2, 6)
    norms = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-1.0, 0.5, 0.0])]
    folded = fold_fc_norm_weights(weight, norms, 2)
    expected = torch.tensor([[0.0, 2.0, 6.0, -3.0, 2.0, 0.0], [6.0, 14.0, 24.0, -9.0, 5.0, 0.0]])
    assert torch.equal(folded, expected)
    assert fold_fc_norm_weights(weight, None, 2) is weight
    with pytest.raises(ValueError, match=r"fc_norm weight 1 has shape \(2,\), expected \(3,\)"):
        fold_fc_norm_weights(weight, [norms[0], torch.ones(2)], 2)
    with pytest.raises(ValueError, match="expected 3 fc_norm weights"):
        fold_fc_norm_weights(weight, norms, 3)


# ---- Eagle31PostNormFeedback ------------------------------------------------------------------------


def _pnf_inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    residual = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    update = torch.randn(*shape, generator=gen).to(dtype)
    weight = (1.0 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return residual, update, weight


@pytest.mark.parametrize("norm_output", [False, True])
@pytest.mark.parametrize("shape", [(1, 7), (2, 3, 33), (5, 256)])
def test_post_norm_feedback_fp32_matches_reference(lib, shape, norm_output):
    residual, update, weight = _pnf_inputs(shape, torch.float32)
    normed, fed_back = lib.post_norm_feedback(residual, update, weight, 1e-5, norm_output)
    ref_normed, ref_fed = ref.post_norm_feedback(residual, update, weight, 1e-5, norm_output)
    _assert_rel(normed, ref_normed, 1e-6)
    _assert_rel(fed_back, ref_fed, 1e-6)
    # The feedback convention itself is exact: post-norm feeds `normed` back, pre-norm the sum.
    assert torch.equal(fed_back, normed) if norm_output else torch.equal(fed_back, residual + update)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_output", [False, True])
@pytest.mark.parametrize("shape", [(1, 7), (3, 33), (4, 512)])
def test_post_norm_feedback_half_precision_matches_reference(lib, dtype, shape, norm_output):
    residual, update, weight = _pnf_inputs(shape, dtype, seed=3)
    normed, fed_back = lib.post_norm_feedback(residual, update, weight, 1e-5, norm_output)
    ref_normed, ref_fed = ref.post_norm_feedback(residual, update, weight, 1e-5, norm_output)
    # The kernel rounds where the reference rounds: at most one unit in the last place apart.
    torch.testing.assert_close(normed, ref_normed, rtol=HALF_EPS[dtype], atol=0)
    torch.testing.assert_close(fed_back, ref_fed, rtol=HALF_EPS[dtype], atol=0)
    if not norm_output:
        assert torch.equal(fed_back, residual + update)


# ---- torch ops, PluginKernels, torch.export ---------------------------------------------------------


@pytest.mark.parametrize("with_norm", [False, True])
def test_plugin_kernels_agree_with_torch_kernels(lib, with_norm):
    sources, weight, norms = _fc_inputs(3, (2, 5), 32, 24, torch.float32)
    norms = norms if with_norm else None
    plugin, torch_kernels = PluginKernels(lib.path), ref.TorchKernels()
    _assert_rel(plugin.fc_norm(sources, weight, norms, 1e-6), torch_kernels.fc_norm(sources, weight, norms, 1e-6), 1e-5)
    residual, update, w = _pnf_inputs((2, 5, 24), torch.float32)
    for norm_output in (False, True):
        got = plugin.post_norm_feedback(residual, update, w, 1e-6, norm_output)
        want = torch_kernels.post_norm_feedback(residual, update, w, 1e-6, norm_output)
        for a, b in zip(got, want):
            _assert_rel(a, b, 1e-6)


def test_plugin_kernels_fold_once_and_refold_after_an_update(lib):
    sources, weight, norms = _fc_inputs(2, (3,), 16, 8, torch.float32)
    plugin = PluginKernels(lib.path)
    first = plugin._fold(weight, norms, 2)
    assert plugin._fold(weight, norms, 2) is first
    with torch.no_grad():
        norms[1].mul_(2.0)  # an in-place update bumps the tensor version
    refolded = plugin._fold(weight, norms, 2)
    assert refolded is not first
    _assert_rel(plugin.fc_norm(sources, weight, norms, 1e-6), ref.fc_norm_fusion(sources, weight, norms, 1e-6), 1e-5)


def test_reference_drafter_runs_on_plugin_kernels(lib, eagle31_ckpt):
    from eagle31_export.formats.drafter.checkpoint import DrafterCheckpoint
    from eagle31_export.reference.attention import KVCache
    from eagle31_export.reference.drafter import build_drafter

    gen = torch.Generator().manual_seed(0)
    ckpt = DrafterCheckpoint(eagle31_ckpt.config, dict(eagle31_ckpt.tensors, **{
        "embed_tokens.weight": torch.randn(eagle31_ckpt.config.vocab_size, eagle31_ckpt.config.hidden_size,
                                           generator=gen)}))
    aux = torch.randn(1, 5, ckpt.config.fc_in_features, generator=gen) * 4
    ids, positions = torch.randint(0, 256, (1, 5), generator=gen), torch.arange(5).unsqueeze(0)
    steps = {}
    for name, kernels in (("torch", ref.TorchKernels()), ("plugin", PluginKernels(lib.path))):
        drafter = build_drafter(ckpt, dtype=torch.float32, kernels=kernels)
        first = drafter(ids, positions, aux, KVCache(), True)
        second = drafter(ids[:, -1:], positions[:, -1:] + 1, first.fed_back[:, -1:], KVCache(), False)
        steps[name] = (first, second)
    for a, b in zip(steps["plugin"], steps["torch"]):
        _assert_rel(a.logits, b.logits, 1e-4)
        _assert_rel(a.fed_back, b.fed_back, 1e-4)


class _TwoOps(torch.nn.Module):
    def __init__(self, k: int, ht: int, h: int):
        super().__init__()
        sources, weight, norms = _fc_inputs(k, (1,), ht, h, torch.float32)
        self.register_buffer("folded", fold_fc_norm_weights(weight, norms, k))
        self.register_buffer("norm", 1.0 + 0.1 * torch.arange(h, dtype=torch.float32))

    def forward(self, a, b, c, residual):
        g = torch.ops.eagle31.fc_norm([a, b, c], self.folded, 1e-6, True)
        return torch.ops.eagle31.post_norm_feedback(residual, g, self.norm, 1e-6, True)


def test_torch_export_traces_both_ops_as_single_nodes(lib):
    module = _TwoOps(3, 16, 8)
    args = (*_sources(3, (2, 4), 16, torch.float32, seed=5), torch.randn(2, 4, 8))
    program = torch.export.export(module, args)
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert "eagle31.fc_norm.default" in targets and "eagle31.post_norm_feedback.default" in targets
    exported, eager = program.module()(*args), module(*args)
    for a, b in zip(exported, eager):
        assert torch.equal(a, b)


def test_ops_reject_bad_inputs(lib):
    a = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"weight must be \[H, 2\*8\]"):
        torch.ops.eagle31.fc_norm([a, a], torch.randn(4, 15), 1e-6, True)
    with pytest.raises(ValueError, match="source 1 has shape"):
        torch.ops.eagle31.fc_norm([a, torch.randn(3, 8)], torch.randn(4, 16), 1e-6, True)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        torch.ops.eagle31.fc_norm([a.double()], torch.randn(4, 8).double(), 1e-6, True)
    with pytest.raises(ValueError, match=r"norm_weight \[H\]"):
        torch.ops.eagle31.post_norm_feedback(a, a, torch.ones(7), 1e-6, True)


def test_empty_batches_pass_through(lib):
    out = torch.ops.eagle31.fc_norm([torch.empty(0, 8)], torch.randn(4, 8), 1e-6, True)
    assert out.shape == (0, 4)
    normed, fed_back = torch.ops.eagle31.post_norm_feedback(torch.empty(0, 8), torch.empty(0, 8), torch.ones(8), 1e-6, False)
    assert normed.shape == fed_back.shape == (0, 8)


# ---- the CLI ----------------------------------------------------------------------------------------


def test_cli_build_reports_parts(cli, plugin_build):
    code, out, _ = cli("plugins", "build", "--no-cuda", "--json", "--build-dir", str(plugin_build.build_dir))
    assert code == 0
    import json

    report = json.loads(out)
    assert report["parts"]["cpu"] == "built" and report["parts"]["cuda"].startswith("skipped")
    assert report["libraries"]["cpu"].endswith("libeagle31_kernels_cpu.so")


def test_cli_missing_nvcc_is_one_line_and_exit_2(monkeypatch, cli, tmp_path):
    monkeypatch.setattr(build_module, "find_nvcc", lambda: None)
    code, _, err = cli("plugins", "build", "--cuda", "--build-dir", str(tmp_path))
    assert code == 2
    assert err.strip().splitlines() == [err.strip()] and err.startswith("error: nvcc not found")


def test_cli_missing_cmake_is_one_line_and_exit_2(monkeypatch, cli, tmp_path):
    real_which = shutil.which
    monkeypatch.setattr(build_module.shutil, "which", lambda name, *a, **k: None if name == "cmake" else real_which(name))
    monkeypatch.setattr(build_module.sys, "executable", str(tmp_path / "python"))  # no cmake wheel beside it
    code, _, err = cli("plugins", "build", "--build-dir", str(tmp_path))
    assert code == 2
    assert err.strip().splitlines() == [err.strip()] and err.startswith("error: cmake not found")
