"""The CPU layer ops (pdkernels/cpu_ops.py): RMSNorm with the residual add, and rotary in place,
against the torch reference they replace; and when the layers take them."""

from __future__ import annotations

import pytest
import torch

from engine.layers.norm import RMSNorm
from engine.layers.rotary import apply_rotary
from pdkernels import cpu_ops

needs_ops = pytest.mark.skipif(not cpu_ops.available(),
                               reason="the CPU layer ops need an x86 CPU with AVX2 and FMA")


@pytest.fixture(autouse=True)
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _norm(dim: int, kernels: str) -> RMSNorm:
    n = RMSNorm(dim, 1e-5, kernels)
    n.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(dim))
    return n


def test_the_host_has_them():
    # CI hosts are x86 with AVX2 and a compiler: a silent fallback would leave them untested.
    import platform
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert cpu_ops.available()


@needs_ops
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("dim", [576, 64, 13])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_rms_norm_matches_the_reference_and_adds_the_residual_exactly(rows, dim, nthreads):
    torch.set_num_threads(nthreads)
    g = torch.Generator().manual_seed(rows * 7 + dim)
    x, res = torch.randn(rows, dim, generator=g) * 3, torch.randn(rows, dim, generator=g)
    ref, cpu = _norm(dim, "torch"), _norm(dim, "cpu")
    want_y, want_sum = ref(x, res)
    got_y, got_sum = cpu(x, res)
    assert torch.equal(got_sum, want_sum)                 # the stream the next layer reads
    torch.testing.assert_close(got_y, want_y, rtol=2e-6, atol=2e-6)   # the mean's sum order
    torch.testing.assert_close(cpu(x), ref(x), rtol=2e-6, atol=2e-6)
    assert cpu(x).shape == x.shape and cpu(x).dtype == torch.float32


@needs_ops
def test_rms_norm_takes_strided_rows_and_leaves_other_tensors_to_torch():
    ref, cpu = _norm(64, "torch"), _norm(64, "cpu")
    wide = torch.randn(5, 160)
    x = wide[:, 32:96]                                   # rows 160 floats apart
    torch.testing.assert_close(cpu(x), ref(x), rtol=2e-6, atol=2e-6)
    q = torch.randn(4, 96 * 3)[:, :192].view(4, 3, 64)  # per-head q_norm input: not one stride
    assert not cpu_ops.supports(q)
    assert torch.equal(cpu(q), ref(q))                  # the torch path, the same bits
    h = torch.randn(3, 64, dtype=torch.float64)
    assert not cpu_ops.supports(h)
    assert cpu(h).dtype == torch.float64


@needs_ops
@pytest.mark.parametrize("tokens", [1, 5, 64, 130])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_rotary_gives_the_references_bits_on_q_and_k_views(tokens, nthreads):
    torch.set_num_threads(nthreads)
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 9 * 64 + 2 * 3 * 64, generator=g)
    q, k = qkv[:, :576].view(tokens, 9, 64), qkv[:, 576:768].view(tokens, 3, 64)
    freqs = torch.arange(tokens).float()[:, None] * torch.rand(32, generator=g)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    assert cpu_ops.usable_rotary(q, cos)
    v_before = qkv[:, 768:].clone()
    assert cpu_ops.rotary_(q, cos, sin) is q
    cpu_ops.rotary_(k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, 768:], v_before)          # v, beside them, untouched


def test_the_torch_backend_takes_them_with_its_cpu_kernel_only():
    from engine.attention.base import BufferSizes
    from engine.attention.torch_backend import TorchBackend
    from engine.config import ModelConfig

    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True)
    sizes = BufferSizes(max_tokens=16, max_seqs=4, max_blocks=4)
    sdpa = TorchBackend(cfg, 16, torch.float32, torch.device("cpu"), sizes, cpu_attention="sdpa")
    assert sdpa.kernels == "torch"
    if cpu_ops.available():
        ours = TorchBackend(cfg, 16, torch.float32, torch.device("cpu"), sizes,
                            cpu_attention="avx2")
        assert ours.kernels == "cpu"
