"""The compiled kernels equal the pure-torch reference bit for bit on CPU, pass opcheck, fall back
cleanly when they cannot be built; the CUDA sources compile with nvcc; GPU checks when one exists."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from _loco_common import DTYPES, error_like, fresh_seed, gradient_like, kernels

from loco import ops, reference

SHAPES = [  # (numel, row_len, A, B): A * B rows, row r = a * B + b
    (1000, 500, 1, 2),
    (4096, 1024, 2, 2),
    (3, 1, 4, 1),
    (777, 200, 2, 2),
    (5000, 5000, 1, 1),
    (130, 33, 1, 4),
    (0, 16, 2, 1),
]


def _inner(buf: torch.Tensor, start: int, a: int) -> torch.Tensor:
    """[b, a, width + pad] buffer -> strided [a, b, width] view starting at column ``start``."""
    width = buf.shape[2] - 2 * start
    return buf[:, :, start : start + width].transpose(0, 1)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The compiled kernels on each device against the reference run on CPU.  On CUDA they do the same
# float32 operations (explicitly rounded intrinsics, no multiply-add contraction, round half to
# even), so the same bitwise comparison applies.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])]


@pytest.fixture(scope="module")
def native() -> None:
    if not kernels():
        pytest.fail(f"the CPU kernels did not build: {ops.build_error('cpu')}")


def _on(device: str) -> None:
    if device == "cuda" and not ops.load("cuda"):
        pytest.fail(f"the CUDA kernels did not build: {ops.build_error('cuda')}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("err", [None, "int8", "bf16", "fp32"])
def test_quantize_ef_is_bitwise_the_reference(
    native: None, device: str, dtype: str, bits: int, err: str | None
) -> None:
    _on(device)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    shapes = SHAPES + ([(100_003, 25_001, 2, 2)] if device == "cuda" else [])  # many blocks
    for group in (64, 128, 1024):
        for n, row_len, a, b in shapes:
            g = gradient_like(n, DTYPES[dtype], gen)
            cpad = reference.padded_row_len(row_len, group)
            e2, s2 = error_like(err, a * b * cpad, group, gen)
            e1, s1 = e2.to(device, copy=True), s2.to(device, copy=True)
            # destinations: rows of wider buffers, in swizzled (b, a) order, as in the send buffer
            qb2 = torch.zeros(b, a, cpad * bits // 8 + 8, dtype=torch.uint8)
            sb2 = torch.zeros(b, a, cpad // group + 2)
            qb1, sb1 = qb2.to(device, copy=True), sb2.to(device, copy=True)
            args = (0.8, bits, group, row_len)
            torch.ops.loco.quantize_ef(g.to(device), e1, s1, *args, _inner(qb1, 4, a), _inner(sb1, 1, a))
            reference.quantize_ef(g, e2, s2, *args, _inner(qb2, 4, a), _inner(sb2, 1, a))
            case = f"seed={seed} dtype={dtype} bits={bits} err={err} G={group} n={n} row_len={row_len} rows={a}x{b}"
            assert _equal(qb1.cpu(), qb2), f"codes differ: {case}"
            assert _equal(sb1.cpu(), sb2), f"scales differ: {case}"
            assert _equal(e1.cpu(), e2) and _equal(s1.cpu(), s2), f"error buffers differ: {case}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("err", [None, "int8", "bf16", "fp32"])
def test_dequant_reduce_requant_is_bitwise_the_reference(
    native: None, device: str, bits: int, err: str | None
) -> None:
    _on(device)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for group in (64, 128, 256, 1024):
        for sources in (1, 2, 3, 8):
            for rows in (1, 2, 4):
                m = group * 8
                wide = torch.randint(0, 256, (sources, m * bits // 8 + 16), dtype=torch.uint8, generator=gen)
                scales = torch.rand(sources, m // group + 3, generator=gen)
                e2, s2 = error_like(err, m, group, gen)
                e1, s1 = e2.to(device, copy=True), s2.to(device, copy=True)
                o2 = torch.zeros(rows, m * bits // 8 // rows + 4, dtype=torch.uint8)
                os2 = torch.zeros(rows, m // group // rows + 1)
                o1, os1 = o2.to(device, copy=True), os2.to(device, copy=True)
                width = m * bits // 8 // rows
                args = (0.3, bits, group)
                for w, sc, e, es, o, os_, op in (
                    (
                        wide.to(device),
                        scales.to(device),
                        e1,
                        s1,
                        o1,
                        os1,
                        torch.ops.loco.dequant_reduce_requant,
                    ),
                    (wide, scales, e2, s2, o2, os2, reference.dequant_reduce_requant),
                ):
                    # strided source rows, as received from an all-to-all
                    q, scale = w[:, 8 : 8 + m * bits // 8], sc[:, 1 : 1 + m // group]
                    op(q, scale, e, es, *args, o[:, 2 : 2 + width], os_[:, 1:])
                case = f"seed={seed} bits={bits} err={err} G={group} S={sources} rows={rows}"
                assert _equal(o1.cpu(), o2) and _equal(os1.cpu(), os2), f"codes/scales differ: {case}"
                assert _equal(e1.cpu(), e2) and _equal(s1.cpu(), s2), f"error buffers differ: {case}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out_dtype", ["fp32", "bf16", "fp16"])
def test_dequant_reduce_is_bitwise_the_reference(
    native: None, device: str, bits: int, out_dtype: str
) -> None:
    _on(device)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for group in (64, 1024):
        for sources in (1, 3, 4):
            m = group * 4
            q = torch.randint(0, 256, (sources, m * bits // 8), dtype=torch.uint8, generator=gen)
            scale = torch.rand(sources, m // group, generator=gen) * 10.0 ** torch.randint(
                -6, 3, (1,), generator=gen
            )
            for divisor in (1.0, 3.0, 4.0):
                for n in (m, m - 5, 1):
                    o1 = torch.empty(n, dtype=DTYPES[out_dtype], device=device)
                    o2 = torch.empty(n, dtype=DTYPES[out_dtype])
                    torch.ops.loco.dequant_reduce(q.to(device), scale.to(device), bits, group, divisor, o1)
                    reference.dequant_reduce(q, scale, bits, group, divisor, o2)
                    case = f"seed={seed} bits={bits} G={group} S={sources} d={divisor} n={n}"
                    assert _equal(o1.cpu(), o2), case


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("err", [None, "int8"])
@pytest.mark.parametrize("group", [64, 128])
def test_dequant_reduce_requant_special_groups_are_bitwise_the_reference(
    native: None, device: str, err: str | None, group: int
) -> None:
    """Non-finite, tiny and zero source groups among ordinary ones, in runs of 1 to 9 groups (the
    vectorized receiver works on several groups at once; the first and last of a run are
    special), on the error storages the vectorized path takes."""
    _on(device)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    specials = [math.inf, math.nan, 1e-35, 0.0]
    seen_inf = seen_zero = 0
    for n_groups in range(1, 10):
        m = group * n_groups
        sources = 2
        q2 = torch.randint(0, 256, (sources, m // 2), dtype=torch.uint8, generator=gen)
        s2 = torch.rand(sources, n_groups, generator=gen)
        for k in range(n_groups):  # about every other group special, in one source or both
            if torch.rand(1, generator=gen).item() < 0.5:
                src = int(torch.randint(0, sources, (1,), generator=gen))
                s2[src, k] = specials[int(torch.randint(0, len(specials), (1,), generator=gen))]
        if n_groups >= 3:  # a group of zeros and a tiny one in every source
            s2[:, 1], s2[:, 2] = 0.0, 1e-35
        e2, es2 = error_like(err, m, group, gen)
        e1, es1 = e2.to(device, copy=True), es2.to(device, copy=True)
        o2, os2 = torch.zeros(1, m // 2, dtype=torch.uint8), torch.zeros(1, n_groups)
        o1, os1 = o2.to(device, copy=True), os2.to(device, copy=True)
        torch.ops.loco.dequant_reduce_requant(q2.to(device), s2.to(device), e1, es1, 0.8, 4, group, o1, os1)
        reference.dequant_reduce_requant(q2, s2, e2, es2, 0.8, 4, group, o2, os2)
        case = f"seed={seed} err={err} G={group} groups={n_groups} scales={s2.tolist()}"
        assert _equal(o1.cpu(), o2) and _equal(os1.cpu(), os2), f"codes/scales differ: {case}"
        assert _equal(e1.cpu(), e2) and _equal(es1.cpu(), es2), f"error buffers differ: {case}"
        seen_inf += int((os2 == math.inf).sum())
        seen_zero += int((os2 == 0).sum())
    assert seen_inf > 0 and (err is not None or seen_zero > 0), "the special groups were not reached"


@pytest.mark.parametrize(
    "device,use_kernels",
    [("cpu", True), ("cpu", False), pytest.param("cuda", True, marks=[pytest.mark.gpu, GPU])],
)
def test_special_values(native: None, device: str, use_kernels: bool) -> None:
    """inf/NaN reach the receivers as non-finite values (fp16 overflow detection); groups below
    2**-100 are sent as zeros and kept in the error; zeros stay exact."""
    _on(device)
    group = 64
    g = torch.randn(4 * group)
    g[3] = math.inf  # group 0
    g[group + 5] = math.nan  # group 1
    g[2 * group : 3 * group] = 1e-32  # group 2: tiny
    g[3 * group :] = 0.0  # group 3: zeros
    g = g.to(device)
    e, es = torch.zeros(4 * group, dtype=torch.int8, device=device), torch.zeros(4, device=device)
    q, s = torch.empty(1, 2 * group, dtype=torch.uint8, device=device), torch.empty(1, 4, device=device)
    ops.quantize_ef(g, e, es, 0.0, 4, group, 4 * group, q, s, use_kernels=use_kernels)
    s = s.cpu()
    assert s[0, 0] == math.inf and s[0, 1] == math.inf and s[0, 2] == 0 and s[0, 3] == 0
    out = torch.empty(4 * group, device=device)
    ops.dequant_reduce(q, s.to(device), 4, group, 1.0, out, use_kernels=use_kernels)
    out = out.cpu()
    assert not out[:group].isfinite().any() and not out[group : 2 * group].isfinite().any()
    assert torch.equal(out[2 * group :], torch.zeros(2 * group))
    # the tiny group's value stays in the error buffer (fp32 storage keeps it exactly)
    e32 = torch.zeros(4 * group, device=device)
    none = torch.empty(0, device=device)
    ops.quantize_ef(g, e32, none, 0.0, 4, group, 4 * group, q, s.to(device), use_kernels=use_kernels)
    assert torch.equal(e32[2 * group : 3 * group].cpu(), g[2 * group : 3 * group].cpu())


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda:vec16", marks=[pytest.mark.gpu, GPU]),
        pytest.param("cuda:warp", marks=[pytest.mark.gpu, GPU]),
    ],
    ids=["cpu", "cuda-vec16", "cuda-warp"],
)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("err", [None, "int8", "bf16", "fp32"])
def test_aligned_kernels_are_bitwise_the_reference(
    native: None, monkeypatch: pytest.MonkeyPatch, device: str, bits: int, err: str | None
) -> None:
    """Both CUDA variants on the inputs the wide-access one takes (16-byte aligned gradients and
    outputs, rows whose byte lengths are multiples of 16, code rows of multiples of 8 bytes):
    ``vec16`` (the default) and ``warp`` (``LOCO_CUDA_VARIANT=warp``, which other CUDA tests reach
    only on unaligned inputs), every group size, partial last groups and short outputs; on CPU
    the same cases check the CPU kernels."""
    if device.startswith("cuda:"):
        device, variant = device.split(":")
        monkeypatch.setenv("LOCO_CUDA_VARIANT", variant)
    _on(device)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for group in (64, 128, 256, 512, 1024):
        for dtype in ("fp32", "bf16", "fp16"):
            # 3 rows: full groups, a partial last group (40 of G), the last row short by 24
            row_len = 3 * group + 40
            cpad = reference.padded_row_len(row_len, group)
            n = 3 * row_len - 24
            g = gradient_like(n, DTYPES[dtype], gen)
            e2, s2 = error_like(err, 3 * cpad, group, gen)
            e1, s1 = e2.to(device, copy=True), s2.to(device, copy=True)
            q2, sc2 = torch.zeros(3, cpad * bits // 8, dtype=torch.uint8), torch.zeros(3, cpad // group)
            q1, sc1 = q2.to(device, copy=True), sc2.to(device, copy=True)
            torch.ops.loco.quantize_ef(g.to(device), e1, s1, 0.8, bits, group, row_len, q1, sc1)
            reference.quantize_ef(g, e2, s2, 0.8, bits, group, row_len, q2, sc2)
            case = f"seed={seed} quantize_ef dtype={dtype} bits={bits} err={err} G={group}"
            assert _equal(q1.cpu(), q2) and _equal(sc1.cpu(), sc2), case
            assert _equal(e1.cpu(), e2) and _equal(s1.cpu(), s2), case
        for sources in (1, 3):
            m = group * 8
            q = torch.randint(0, 256, (sources, m * bits // 8), dtype=torch.uint8, generator=gen)
            scale = torch.rand(sources, m // group, generator=gen)
            e2, s2 = error_like(err, m, group, gen)
            e1, s1 = e2.to(device, copy=True), s2.to(device, copy=True)
            o2, os2 = torch.zeros(2, m * bits // 16, dtype=torch.uint8), torch.zeros(2, m // group // 2)
            o1, os1 = o2.to(device, copy=True), os2.to(device, copy=True)
            torch.ops.loco.dequant_reduce_requant(
                q.to(device), scale.to(device), e1, s1, 0.3, bits, group, o1, os1
            )
            reference.dequant_reduce_requant(q, scale, e2, s2, 0.3, bits, group, o2, os2)
            case = f"seed={seed} dequant_reduce_requant bits={bits} err={err} G={group} S={sources}"
            assert _equal(o1.cpu(), o2) and _equal(os1.cpu(), os2), case
            assert _equal(e1.cpu(), e2) and _equal(s1.cpu(), s2), case
            if err is not None:
                continue  # dequant_reduce has no error buffer: once is enough
            for out_dtype in ("fp32", "bf16", "fp16"):
                for count in (m, m - 5, 1):
                    d1 = torch.empty(count, dtype=DTYPES[out_dtype], device=device)
                    d2 = torch.empty(count, dtype=DTYPES[out_dtype])
                    torch.ops.loco.dequant_reduce(q.to(device), scale.to(device), bits, group, 3.0, d1)
                    reference.dequant_reduce(q, scale, bits, group, 3.0, d2)
                    assert _equal(d1.cpu(), d2), f"seed={seed} dequant_reduce {out_dtype} G={group} n={count}"


@pytest.mark.gpu
@GPU
def test_cuda_operators_refuse_tensors_on_another_device(native: None) -> None:
    """A CPU tensor among CUDA ones is an error naming it, not a kernel reading host memory."""
    _on("cuda")
    g = torch.randn(256)
    e, es = torch.zeros(256, dtype=torch.int8, device="cuda"), torch.zeros(2, device="cuda")
    q, s = torch.zeros(1, 128, dtype=torch.uint8, device="cuda"), torch.zeros(1, 2, device="cuda")
    with pytest.raises(RuntimeError, match="device"):
        torch.ops.loco.quantize_ef(g, e, es, 0.8, 4, 128, 256, q, s)
    with pytest.raises(RuntimeError, match="device"):
        torch.ops.loco.dequant_reduce(q.cpu(), s, 4, 128, 1.0, torch.empty(256, device="cuda"))


def test_opcheck(native: None) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    g = gradient_like(1000, torch.bfloat16, gen)
    for e, es in (error_like("int8", 1024, 128, gen), error_like(None, 1024, 128, gen)):
        q, s = torch.zeros(2, 256, dtype=torch.uint8), torch.zeros(2, 4)
        torch.library.opcheck(torch.ops.loco.quantize_ef.default, (g, e, es, 0.8, 4, 128, 500, q, s))
    qs, ss = (
        torch.randint(0, 256, (3, 256), dtype=torch.uint8, generator=gen),
        torch.rand(3, 4, generator=gen),
    )
    e, es = error_like("fp32", 512, 128, gen)
    q2, s2 = torch.zeros(2, 128, dtype=torch.uint8), torch.zeros(2, 2)
    torch.library.opcheck(torch.ops.loco.dequant_reduce_requant.default, (qs, ss, e, es, 0.5, 4, 128, q2, s2))
    out = torch.empty(500, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.loco.dequant_reduce.default, (qs, ss, 4, 128, 3.0, out))


def test_a_failed_build_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A compiler error is a warning, then the reference runs; LOCO_KERNELS=reference skips the build."""
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(ops, "_cpu_tag", lambda: "broken_test")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setitem(ops.EXTENSIONS, "cpu", ops.extension("cpu", [broken]))
    with pytest.warns(RuntimeWarning, match="could not build the CPU kernels.*reference"):
        assert ops.load("cpu") is False
    assert ops.build_error("cpu") and not ops.available("cpu")
    # the wrappers now run the reference
    g = torch.randn(256)
    q, s = torch.zeros(1, 128, dtype=torch.uint8), torch.zeros(1, 2)
    ops.quantize_ef(g, torch.empty(0, dtype=torch.int8), torch.empty(0), 0.8, 4, 128, 256, q, s)
    q2, s2 = q.clone(), s.clone()
    reference.quantize_ef(g, torch.empty(0, dtype=torch.int8), torch.empty(0), 0.8, 4, 128, 256, q2, s2)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    monkeypatch.setitem(ops.EXTENSIONS, "cpu", ops.extension("cpu"))
    monkeypatch.setenv("LOCO_KERNELS", "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.load("cpu") is False
    assert "LOCO_KERNELS" in (ops.build_error("cpu") or "")


NVCC = shutil.which("nvcc")


def _cuda_include() -> str | None:
    assert NVCC is not None
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    homes += [os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), "/usr/local/cuda"]
    found = [h for h in homes if h and os.path.isfile(os.path.join(h, "include", "cuda_runtime.h"))]
    return os.path.join(found[0], "include") if found else None


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_cuda_sources_compile_with_nvcc(tmp_path) -> None:
    """Compile-only check, no GPU needed: nvcc compiles the kernels, and the CUDA operators'
    binding passes a syntax check against this torch's headers (both at once)."""
    from torch.utils.cpp_extension import include_paths

    assert NVCC is not None
    kernels_cu, obj = str(ops.CSRC / "loco_kernels.cu"), str(tmp_path / "loco_kernels.o")
    nvcc = [NVCC, "-std=c++17", *ops.CUDA_CFLAGS, "-arch=sm_80", f"-I{ops.CSRC}", kernels_cu]
    ptx = tmp_path / "loco_kernels.ptx"
    jobs = {"nvcc": [*nvcc, "-c", "-o", obj], "ptx": [*nvcc, "-ptx", "-o", str(ptx)]}
    cuda_include = _cuda_include()
    if cuda_include is not None:
        cmd = [
            shutil.which("c++") or "g++",
            "-fsyntax-only",
            "-std=c++20",
            f"-I{ops.CSRC}",
            f"-I{cuda_include}",
        ]
        cmd += [f"-I{p}" for p in include_paths()] + [f"-I{sys.base_prefix}/include"]
        jobs["binding"] = [*cmd, str(ops.CSRC / "loco_cuda.cpp")]
    procs = {name: subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for name, cmd in jobs.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}: {err[-4000:]}"
    # the reference's arithmetic: every float32 multiply, add and divide rounded on its own (no
    # fused multiply-add), no flush of subnormals to zero, codes by round-half-even
    text = ptx.read_text()
    float_ops = re.findall(r"^\s*((?:fma|mul|add|sub|div|cvt)\.[\w.]*f32[\w.]*)", text, re.M)
    assert float_ops, "no float32 instructions found in the PTX"
    assert not [op for op in float_ops if op.startswith("fma") or ".ftz" in op or ".approx" in op], sorted(
        {op for op in float_ops if op.startswith("fma") or ".ftz" in op or ".approx" in op}
    )
    assert any(op.startswith("cvt.rni.") for op in float_ops), "no round-half-even conversion"
    if cuda_include is None:
        pytest.skip(
            "kernels compiled; the binding check needs the CUDA headers (cuda_runtime.h): set CUDA_HOME"
        )


@pytest.mark.gpu
@GPU
def test_unknown_cuda_variant_is_refused(native: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LOCO_CUDA_VARIANT`` naming no variant is an error naming the accepted values, not a
    silent fallback to one of them."""
    _on("cuda")
    monkeypatch.setenv("LOCO_CUDA_VARIANT", "vec8")
    q = torch.zeros(1, 64, dtype=torch.uint8, device="cuda")
    scale = torch.ones(1, 1, device="cuda")
    out = torch.empty(128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"LOCO_CUDA_VARIANT='vec8'.*'vec16'.*'warp'"):
        torch.ops.loco.dequant_reduce(q, scale, 4, 128, 1.0, out)
