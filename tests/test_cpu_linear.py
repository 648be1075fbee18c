"""The AVX2 linear kernel against its torch reference, its AVX-512 build against it (the same
bits), and the engine's choice of backend."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import (AmxMethod, Avx2Method, Avx512Method, DenseMethod, Int8Method,
                                  Linear, MergedLinear, OneDnnMethod, linear_method_for,
                                  onednn_available, packed_copy, runnable_linear_methods)
from engine.weights import weight_bytes
from pdkernels import cpu_build, cpu_linear
from tests.cpu_paths import linear_params

CPU = torch.device("cpu")

needs_kernel = pytest.mark.skipif(not cpu_linear.cpu_supported(),
                                  reason="the kernel needs an x86 CPU with AVX2 and FMA")
needs_avx512 = pytest.mark.skipif(not cpu_build.avx512_capable(),
                                  reason="the AVX-512 build needs an x86 CPU with AVX-512F")
needs_amx = pytest.mark.skipif(not cpu_build.amx_capable(),
                               reason="the AMX kernel needs an Intel CPU with AMX-BF16 (Sapphire "
                                      "Rapids or later)")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@needs_kernel
def test_builds_on_this_host(tmp_path, monkeypatch):
    # On an AVX2 host with a compiler (CI installs g++), the kernel must be there: a silent
    # fallback to torch would leave it untested.
    assert cpu_linear.available()
    lib = cpu_linear.build(tmp_path)
    assert lib.exists() and cpu_linear.build(tmp_path) == lib     # the second call reuses it
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match="cannot run the C\\+\\+ compiler"):
        cpu_linear.build(tmp_path / "fresh")
    monkeypatch.setenv("CXX", "false")               # a compiler that fails
    with pytest.raises(RuntimeError, match="false failed"):
        cpu_linear.build(tmp_path / "fresh")
    assert not list((tmp_path / "fresh").iterdir())  # no half-written library left behind


def _case(m: int, n: int, k: int, with_bias: bool):
    """x [m, k], w [n, k] at unit output scale, and a bias or None: seeded by the shape."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return x, w, torch.randn(n, generator=g) if with_bias else None


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 16, 8), (1, 40, 24), (5, 48, 64), (6, 16, 576),
                                   (7, 33, 100), (9, 960, 576), (13, 576, 1536), (64, 80, 96),
                                   (3, 1, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch(m, n, k, with_bias):
    x, w, b = _case(m, n, k, with_bias)
    y = cpu_linear.linear(x, cpu_linear.pack(w), n, cpu_linear.pad_bias(b))
    ref = cpu_linear.reference(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (m, n) and y.dtype == torch.float32
    # fp32 sums of k products of unit-scale terms: error grows like sqrt(k) ulps
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=2e-6 * k ** 0.5)


@needs_avx512
def test_avx512_build_is_there_on_an_avx512_host():
    # A silent fallback would leave the path `auto` takes on Intel AVX-512 hosts untested.
    assert cpu_linear.available_avx512()
    assert "avx512" in runnable_linear_methods(CPU, torch.float32)


@needs_avx512
@pytest.mark.parametrize("m", [1, 2, 5, 11, 12, 13, 24, 25, 37, 64, 100])
@pytest.mark.parametrize("n,k", [(16, 8), (32, 24), (48, 64), (40, 100), (1, 5), (960, 576),
                                 (17, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_avx512_build_gives_the_avx2_kernels_bits(m, n, k, threads):
    # The same fused multiply-adds in the same order per output: one panel or two per pass, 1
    # to 12 rows per pass, a last panel cut short, any thread count.
    x, w, b = _case(m, n, k, with_bias=(m + n) % 2 == 0)
    packed, bias = cpu_linear.pack(w), cpu_linear.pad_bias(b)
    want = cpu_linear.linear(x, packed, n, bias)
    torch.set_num_threads(threads)
    try:
        got = cpu_linear.linear(x, packed, n, bias, isa="avx512")
    finally:
        torch.set_num_threads(1)
    assert torch.equal(got, want)


@needs_avx512
def test_avx512_rows_do_not_depend_on_their_batch():
    w = torch.randn(200, 576)
    packed = cpu_linear.pack(w)
    x = torch.randn(29, 576)
    full = cpu_linear.linear(x, packed, 200, isa="avx512")
    for i in (0, 11, 12, 13, 28):
        assert torch.equal(cpu_linear.linear(x[i:i + 1], packed, 200, isa="avx512")[0], full[i])
    assert torch.equal(cpu_linear.linear(x[3:20], packed, 200, isa="avx512"), full[3:20])


@needs_amx
def test_amx_kernel_is_there_on_an_amx_host():
    # A silent fallback would leave the path `auto` takes on AMX hosts untested.
    assert cpu_linear.available_amx()
    assert "amx" in runnable_linear_methods(CPU, torch.float32)
    assert type(linear_method_for(CPU, torch.float32)) is AmxMethod


def _amx_error(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               got: torch.Tensor) -> float:
    """The largest |got - exact| relative to sum_k |x * w| (+ |b|): the scale of a term's
    error, whatever the cancellation."""
    xd, wd = x.double(), w.double()
    exact = xd @ wd.T + (b.double() if b is not None else 0)
    scale = xd.abs() @ wd.abs().T + (b.double().abs() if b is not None else 0)
    return float(((got.double() - exact).abs() / scale.clamp_min(1e-30)).max()) if got.numel() else 0.0


@needs_amx
@pytest.mark.parametrize("m", [1, 15, 16, 17, 32, 33, 100, 129, 300])
@pytest.mark.parametrize("n,k", [(16, 8), (32, 24), (40, 100), (1, 5), (960, 576), (17, 1536),
                                 (48, 33)])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_kernel_is_within_bf16x3_error_of_the_exact_product(m, n, k, threads):
    # Three products per term (hi*hi, hi*lo, lo*hi): each term within ~2^-16 of exact. One
    # product left out, or a piece cut instead of rounded, is off by ~2^-9: this bound sees it.
    x, w, b = _case(m, n, k, with_bias=(m + n) % 2 == 0)
    packed, bias = cpu_linear.pack_amx(w), cpu_linear.pad_bias(b)
    torch.set_num_threads(threads)
    try:
        got = cpu_linear.linear_amx(x, packed, n, bias)
    finally:
        torch.set_num_threads(1)
    assert got.shape == (m, n)
    assert _amx_error(x, w, b, got) < 2.0 ** -15
    assert torch.equal(got, cpu_linear.linear_amx(x, packed, n, bias))   # deterministic


@needs_amx
def test_amx_rows_do_not_depend_on_their_batch_or_thread_count():
    # Row groups of 16 in pairs or alone, a last group padded, blocks of 128 rows: each output
    # adds the same products in the same order.
    w = torch.randn(200, 576)
    packed = cpu_linear.pack_amx(w)
    x = torch.randn(150, 576)
    full = cpu_linear.linear_amx(x, packed, 200)
    for i in (0, 15, 16, 31, 32, 127, 128, 149):
        assert torch.equal(cpu_linear.linear_amx(x[i:i + 1], packed, 200)[0], full[i])
    assert torch.equal(cpu_linear.linear_amx(x[3:20], packed, 200), full[3:20])
    assert torch.equal(cpu_linear.linear_amx(x[100:], packed, 200), full[100:])
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_linear.linear_amx(x, packed, 200), full)
    finally:
        torch.set_num_threads(1)


@needs_amx
def test_amx_shapes_and_bad_input():
    w = torch.randn(40, 24)
    packed = cpu_linear.pack_amx(w)
    x = torch.randn(2, 3, 48)[..., ::2]                 # 3-D and not contiguous
    torch.testing.assert_close(cpu_linear.linear_amx(x, packed, 40), x @ w.T, rtol=1e-4,
                               atol=1e-4)
    assert cpu_linear.linear_amx(torch.empty(0, 24), packed, 40).shape == (0, 40)
    with pytest.raises(ValueError, match="does not hold"):
        cpu_linear.linear_amx(torch.randn(2, 24), packed, 96)
    with pytest.raises(ValueError, match="does not hold"):
        cpu_linear.linear_amx(torch.randn(2, 24), cpu_linear.pack(w), 40)   # the AVX2 panels
    with pytest.raises(ValueError, match="float32"):
        cpu_linear.linear_amx(torch.randn(2, 24, dtype=torch.float64), packed, 40)
    with pytest.raises(ValueError, match="bias must hold"):
        cpu_linear.linear_amx(torch.randn(2, 24), packed, 40, torch.zeros(8))


def test_unknown_isa_is_refused():
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu_linear.linear(torch.randn(1, 8), torch.zeros(16 * 8), 16, isa="sse")


@needs_kernel
def test_shapes_strides_and_empty_batches():
    w = torch.randn(40, 24)
    packed = cpu_linear.pack(w)
    x = torch.randn(2, 3, 48)[..., ::2]                 # 3-D and not contiguous
    torch.testing.assert_close(cpu_linear.linear(x, packed, 40), x @ w.T, rtol=1e-5, atol=1e-5)
    assert cpu_linear.linear(torch.empty(0, 24), packed, 40).shape == (0, 40)
    with pytest.raises(ValueError, match="does not hold"):
        cpu_linear.linear(torch.randn(2, 24), packed, 64)
    with pytest.raises(ValueError, match="float32"):
        cpu_linear.linear(torch.randn(2, 24, dtype=torch.float64), packed, 40)


@needs_kernel
def test_a_row_does_not_depend_on_its_batch():
    # What speculative verification relies on: a sequence's projection is bit-identical whether
    # it runs alone or beside other rows, at any position in the batch and any thread count.
    w = torch.randn(200, 576)
    packed = cpu_linear.pack(w)
    x = torch.randn(17, 576)
    full = cpu_linear.linear(x, packed, 200)
    for i in (0, 5, 6, 11, 16):
        assert torch.equal(cpu_linear.linear(x[i:i + 1], packed, 200)[0], full[i])
    assert torch.equal(cpu_linear.linear(x[3:12], packed, 200), full[3:12])
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_linear.linear(x, packed, 200), full)
    finally:
        torch.set_num_threads(1)


@needs_kernel
def test_linear_layers_pack_after_loading_including_a_tied_head():
    emb = nn.Embedding(50, 24)
    w, b = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(5, 24)
    auto = linear_method_for(torch.device("cpu"), torch.float32)
    assert isinstance(auto, (Avx2Method, AmxMethod)) == cpu_linear.preferred()
    proj = packed_copy(w, Avx2Method(), b)
    head = Linear(24, 50, False, Avx2Method())
    head.weight = emb.weight                         # tied, as a model's lm_head
    head.process_weights_after_loading()
    with torch.inference_mode():
        torch.testing.assert_close(proj(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(head(x), F.linear(x, emb.weight), rtol=1e-5, atol=1e-5)
    assert proj.weight is None and head.weight is None      # only the packed copies remain
    assert emb.weight.shape == (50, 24)                # the tied parameter is left in place


@pytest.mark.parametrize("method", linear_params())
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_forced_method_matches_torch_and_counts_its_weight_memory(method, with_bias):
    """--linear-method avx2 / onednn / torch: each computes F.linear, and the startup log's
    weight memory is read from whatever it holds (oneDNN's packed weight is opaque)."""
    chosen = linear_method_for(CPU, torch.float32, "none", method)
    assert chosen.name == {"torch": "dense"}.get(method, method)
    for m, n, k in [(1, 40, 24), (7, 33, 100), (17, 576, 64)]:
        x, w, b = _case(m, n, k, with_bias)
        layer = packed_copy(w, chosen, b)
        with torch.inference_mode():
            tol = 1e-4 if method == "amx" else 1e-5     # three bf16 products per term
            torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=tol, atol=tol)
        held = weight_bytes(layer)
        assert held >= n * k * 4 + (n * 4 if with_bias else 0)
        if method == "amx":     # two bf16 pieces; k padded to 32, panels to pairs
            assert held <= -(-n // 32) * 32 * -(-k // 32) * 32 * 4 + 2 * (n + 16) * 4
        else:
            assert held <= 2 * (-(-n // 16) * 16 * k * 4 + n * 4)


def test_forced_methods_that_cannot_run_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="--linear-method onednn: .*float weights only"):
        linear_method_for(CPU, torch.float32, "int8", "onednn")
    with pytest.raises(ValueError, match="--linear-method amx: .*float weights only"):
        linear_method_for(CPU, torch.float32, "int8", "amx")
    for choice in ("avx2", "amx", "onednn"):
        with pytest.raises(ValueError, match=f"--linear-method {choice}: a float32 CPU path"):
            linear_method_for(CPU, torch.bfloat16, "none", choice)
        with pytest.raises(ValueError, match=f"--linear-method {choice}: a float32 CPU path"):
            linear_method_for(torch.device("meta"), torch.float32, "none", choice)
    with pytest.raises(ValueError, match="linear method must be one of"):
        linear_method_for(CPU, torch.float32, "none", "mkl")
    # torch's path: integer weights take the dequantize-then-matmul reference, not the kernel
    assert linear_method_for(CPU, torch.float32, "int8", "torch").kernel is False
    monkeypatch.setattr(cpu_linear, "available", lambda: False)   # no AVX2, or no compiler
    with pytest.raises(ValueError, match="--linear-method avx2: our kernel needs"):
        linear_method_for(CPU, torch.float32, "none", "avx2")
    assert "avx2" not in runnable_linear_methods(CPU, torch.float32)
    monkeypatch.setattr(cpu_linear, "available_amx", lambda: False)  # no AMX, or an old kernel
    with pytest.raises(ValueError, match="--linear-method amx: the AMX kernel needs"):
        linear_method_for(CPU, torch.float32, "none", "amx")


def test_auto_picks_by_the_hosts_best_isa(monkeypatch):
    """AVX2-best hosts: our kernel; Intel AVX-512 hosts: its AVX-512 build, or the AMX kernel
    where the CPU has AMX; other AVX-512
    hosts: oneDNN for float weights, our int8 kernel for integer ones (it runs there too); no
    kernel at all: oneDNN, and the int8 reference."""
    monkeypatch.setattr(cpu_build, "kernels_preferred", lambda: True)
    monkeypatch.setattr(cpu_build, "intel_avx512_host", lambda: False)
    monkeypatch.setattr(cpu_build, "amx_capable", lambda: False)
    if cpu_linear.available():
        assert type(linear_method_for(CPU, torch.float32)) is Avx2Method
    monkeypatch.setattr(cpu_build, "intel_avx512_host", lambda: True)
    if cpu_linear.available_avx512():
        assert type(linear_method_for(CPU, torch.float32)) is Avx512Method
        assert linear_method_for(CPU, torch.float32, "int8").kernel is True   # AVX2 int8 panels
    monkeypatch.setattr(cpu_build, "amx_capable", lambda: True)
    if cpu_linear.available_amx():      # Intel AMX hosts: the AMX kernel for float weights
        assert type(linear_method_for(CPU, torch.float32)) is AmxMethod
        assert linear_method_for(CPU, torch.float32, "int8").kernel is True
    monkeypatch.setattr(cpu_build, "amx_capable", lambda: False)
    monkeypatch.setattr(cpu_build, "intel_avx512_host", lambda: False)
    monkeypatch.setattr(cpu_build, "kernels_preferred", lambda: False)
    if onednn_available(CPU, torch.float32):
        assert isinstance(linear_method_for(CPU, torch.float32), OneDnnMethod)
    assert linear_method_for(CPU, torch.float32, "int8").kernel == cpu_linear.available()
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    assert linear_method_for(CPU, torch.float32, "int8").kernel is False


def test_merged_linear_loads_each_shard_into_its_rows():
    layer = MergedLinear(8, [6, 2, 2], bias=True)
    parts = [torch.randn(n, 8) for n in (6, 2, 2)]
    for i, p in enumerate(reversed(parts)):           # any order
        layer.weight_loader(layer.weight, p, 2 - i)
    assert torch.equal(layer.weight.data, torch.cat(parts))
    assert layer.shard_rows(1) == (6, 8)
    with pytest.raises(ValueError, match="shard 1"):
        layer.weight_loader(layer.weight, torch.randn(3, 8), 1)
    with pytest.raises(ValueError, match="shard 3"):
        layer.weight_loader(layer.weight, torch.randn(2, 8), 3)


def test_other_devices_and_dtypes_compute_densely():
    assert type(linear_method_for(torch.device("cpu"), torch.bfloat16)) is DenseMethod
    assert type(linear_method_for(torch.device("meta"), torch.float32)) is DenseMethod


def test_linearbench_times_every_backend_of_the_model_shapes(model_dir, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "lin.json"
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "linearbench", "--model",
                           str(model_dir), "--layers", "1", "--rows", "1,3", "--repeat", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    expect = {"torch"} | ({"avx2"} if cpu_linear.available() else set())
    assert expect <= set(got["seconds"])
    assert all(s > 0 for res in got["seconds"].values() for s in res.values())
    assert set(got["seconds"]["torch"]) == {"1", "3"}
    # one layer of the default model (4 projections) + its lm_head
    assert got["flops_per_row"] == 2 * (576 * (576 + 2 * 192) + 576 * 576 + 576 * 2 * 1536
                                        + 1536 * 576 + 576 * 49152)
    assert "avx2/torch" in proc.stdout or not cpu_linear.available()


# ------------------------------------------------------------------ weight-only int8
def test_int8_quantization_is_per_channel_symmetric_within_half_a_step():
    w = torch.randn(40, 24) * torch.logspace(-3, 1, 40)[:, None]    # rows of every scale
    w[7] = 0.0
    q, scale = cpu_linear.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (40,) and int(q.abs().max()) == 127
    assert (q.float() * scale[:, None] - w).abs().le(scale[:, None] / 2 + 1e-7).all()
    assert scale[7] == 1.0 and not q[7].any()            # an all-zero row stays zero


@needs_kernel
@pytest.mark.parametrize("m,n,k", [(1, 16, 8), (1, 40, 24), (5, 48, 64), (7, 33, 100),
                                   (9, 960, 576), (13, 576, 1536), (3, 1, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_kernel_matches_dequantize_then_matmul(m, n, k, with_bias):
    x, w, b = _case(m, n, k, with_bias)
    q, scale = cpu_linear.quantize_int8(w)
    y = cpu_linear.linear_int8(x, cpu_linear.pack_int8(q), cpu_linear.pad_bias(scale), n,
                               cpu_linear.pad_bias(b))
    ref = cpu_linear.reference_int8(x.double(), q, scale.double(),
                                    None if b is None else b.double())
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=2e-6 * k ** 0.5)


@needs_kernel
@pytest.mark.parametrize("m,n,k,group", [(1, 16, 128, 128), (2, 40, 256, 128), (3, 48, 64, 32),
                                         (7, 33, 384, 128), (1, 576, 1536, 128), (4, 1, 32, 16),
                                         (9, 20, 1024, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_int8_kernel_matches_dequantize_then_matmul(m, n, k, group, with_bias):
    """Group scales (pre-quantized 4-bit checkpoints: values in [-15, 15]), rows 1 to 7 (the
    kernel's passes take 3), an N that is not whole panels."""
    from engine.layers.quant_formats import grouped_reference
    x, _, b = _case(m, n, k, with_bias)
    g = torch.Generator().manual_seed(m * n + k)
    q = torch.randint(-15, 16, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    y = cpu_linear.linear_int8_grouped(x, cpu_linear.pack_int8(q),
                                       cpu_linear.pack_group_scales(scale), group, n,
                                       cpu_linear.pad_bias(b))
    ref = grouped_reference(x.double(), q, scale.double(), None if b is None else b.double())
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=2e-6 * k ** 0.5)
    with pytest.raises(ValueError, match="group scales"):
        cpu_linear.linear_int8_grouped(x, cpu_linear.pack_int8(q),
                                       cpu_linear.pack_group_scales(scale), group * 2, n)


@needs_kernel
@pytest.mark.parametrize("group", [0, 64])
def test_an_int8_row_does_not_depend_on_its_batch(group):
    """Few rows take the register kernel, more the L1 buffer: the same products and sums, so a
    row's result is bit-identical alone or in any batch (per channel and with group scales)."""
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-15, 16, (200, 576), generator=g, dtype=torch.int8)
    b = cpu_linear.pad_bias(torch.randn(200, generator=g))
    x = torch.randn(17, 576, generator=g)
    packed = cpu_linear.pack_int8(q)
    if group:
        scales = cpu_linear.pack_group_scales(torch.rand(200, 576 // group, generator=g))
        run = lambda rows: cpu_linear.linear_int8_grouped(rows, packed, scales, group, 200, b)  # noqa: E731
    else:
        scale = cpu_linear.pad_bias(torch.rand(200, generator=g))
        run = lambda rows: cpu_linear.linear_int8(rows, packed, scale, 200, b)  # noqa: E731
    full = run(x)
    for i in (0, 5, 6, 11, 16):
        assert torch.equal(run(x[i:i + 1])[0], full[i])
        assert torch.equal(run(x[i:i + 2])[0], full[i])
    assert torch.equal(run(x[3:12]), full[3:12])
    torch.set_num_threads(2)
    try:
        assert torch.equal(run(x), full)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("kernel", [False, True])
def test_w8a8_layers_quantize_each_row_of_activations(kernel):
    """Dynamic per-token int8 activations: each row rounded with its own scale, exactly the
    dequantized product of those integers."""
    from engine.layers.linear import QuantizedMethod, quantize_per_token
    from engine.layers.quant_formats import QuantScheme
    if kernel and not cpu_linear.cpu_supported():
        pytest.skip("the int8 kernel targets AVX2 x86 CPUs")
    torch.manual_seed(30)
    scheme = QuantScheme.random("w8a8")
    layer = Linear(24, 40, True, QuantizedMethod(scheme, kernel))
    q = torch.randint(-127, 128, (40, 24), dtype=torch.int8)
    s = torch.rand(40, 1) * 0.01
    with torch.no_grad():
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(s)
        layer.bias.data.normal_()
    bias = layer.bias.detach().clone()
    layer.process_weights_after_loading()
    x = torch.randn(5, 24) * torch.logspace(-2, 2, 5)[:, None]      # rows of every size
    xq, xs = quantize_per_token(x)
    assert xs.shape == (5, 1) and xq.abs().max() == 127 and torch.equal(xq, xq.round())
    with torch.inference_mode():
        got = layer(x)
    ref = F.linear(xq * xs, q.float() * s, bias)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert layer.weight is None and not hasattr(layer, "weight_scale")


@pytest.mark.parametrize("kernel", [False, True])
def test_int8_layers_quantize_after_loading_and_drop_the_float_weight(kernel):
    if kernel and not cpu_linear.cpu_supported():
        pytest.skip("the int8 kernel targets AVX2 x86 CPUs")
    w, b = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(5, 24)
    layer = packed_copy(w, Int8Method(kernel=kernel), b)
    q, scale = cpu_linear.quantize_int8(w)
    with torch.inference_mode():
        got = layer(x)
    torch.testing.assert_close(got, cpu_linear.reference_int8(x, q, scale, b), rtol=1e-5,
                               atol=1e-5)
    assert layer.weight is None
    assert (got - F.linear(x, w, b)).abs().max() < 0.05 * F.linear(x, w, b).abs().max()
    chosen = linear_method_for(torch.device("cpu"), torch.float32, "int8")
    assert isinstance(chosen, Int8Method) and chosen.kernel == cpu_linear.available()
    with pytest.raises(ValueError, match="quantization"):
        linear_method_for(torch.device("cpu"), torch.float32, "int3")


def test_an_int8_engine_holds_under_half_the_weight_memory_and_decodes(model_dir):
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.request import Request, SamplingParams
    from engine.weights import weight_bytes

    engines = {q: Engine(model_dir, EngineConfig(role="decode", num_blocks=16, block_size=16,
                                                 quantization=q)) for q in ("none", "int8")}
    sizes = {q: weight_bytes(e.model) for q, e in engines.items()}
    # the tied embedding and lm_head (packed for its kernel) stay fp32, as vLLM keeps lm_head:
    # 2 x 113 of the ~318 MiB left
    assert sizes["int8"] < 0.55 * sizes["none"]
    heads = {q: e.model.lm_head.method.name for q, e in engines.items()}
    assert heads["int8"] == heads["none"] != "int8"
    tokens = {}
    for q, e in engines.items():
        e.add_request(Request("r", list(range(100, 120)), SamplingParams(temperature=0,
                                                                         max_tokens=4)))
        while e.has_work():
            for o in e.step():
                tokens.setdefault(q, []).extend(o.new_token_ids)
    assert len(tokens["int8"]) == 4 and tokens["int8"][0] == tokens["none"][0]
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(role="decode", quantization="int4-nonsense")


def test_the_kernels_are_preferred_on_avx2_hosts_amd_zen4_and_intel_avx512(monkeypatch):
    """AVX2-best hosts, AMD family 25 (Zen 4: AVX-512 on 256-bit units) and Intel AVX-512 hosts
    pick our kernels (Intel: the linear kernel's AVX-512 build); Zen 5 (family 26, full-width
    units) keeps oneDNN / SDPA."""
    if not cpu_build.avx2_capable():
        pytest.skip("not an x86 host with AVX2 and FMA")
    fields = {}
    monkeypatch.setattr(cpu_build, "cpuinfo_field", lambda name: fields.get(name))
    monkeypatch.setattr(cpu_build, "avx2_host", lambda: True)
    assert cpu_build.kernels_preferred()
    monkeypatch.setattr(cpu_build, "avx2_host", lambda: False)          # an AVX-512 host
    monkeypatch.setattr(cpu_build, "avx512_capable", lambda: True)
    for vendor, family, want in (("AuthenticAMD", "25", True), ("AuthenticAMD", "26", False),
                                 ("GenuineIntel", "6", True)):
        fields.update({"vendor_id": vendor, "cpu family": family})
        assert cpu_build.kernels_preferred() is want, (vendor, family)
        assert cpu_build.intel_avx512_host() is (vendor == "GenuineIntel")
