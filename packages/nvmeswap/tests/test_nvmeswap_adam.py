"""The fused Adam/AdamW kernel against torch's own optimizers (the oracle), bit for bit.

torch.optim.Adam/AdamW step an fp32 parameter whose gradient is the 16-bit gradient converted and
multiplied by DeepSpeed's unscale factor; the kernel reads the 16-bit gradient directly.  Fresh
random inputs of many sizes (block edges, odd tails), gradient dtypes, weight decay of both kinds,
both branches of torch's lerp and 1 or 2 threads.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from nvmeswap import adam, fused

SIZES = [1, 7, 4095, 4096, 4097, 3 * 4096 + 5, 50_001]
GRADS = [torch.bfloat16, torch.float16, torch.float32, None]


@pytest.fixture(scope="module", params=["kernel", "reference"])
def impl(request: pytest.FixtureRequest, fused_kernel: bool) -> object:
    if request.param == "kernel":
        if not fused_kernel:
            pytest.fail(f"the fused Adam kernel did not build: {adam.build_error()}")
        return lambda p, m, v, g, scale, h: torch.ops.nvmeswap.adam_step_(
            p, m, v, g, scale, *h.args(), adam.uses_fma()
        )
    return adam.reference_adam_step_


def _compare(impl, cls, n, gdt, wd, beta1, scale, seed, steps=3):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [None if gdt is None else (torch.randn(n, generator=gen) * 3).to(gdt) for _ in range(steps)]
    lr, beta2, eps = 1e-2, 0.999, 1e-8
    q = torch.nn.Parameter(p0.clone())
    opt = cls([q], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for s, g in enumerate(grads):
        q.grad = torch.zeros(n) if g is None else g.to(torch.float32, copy=True)
        q.grad.mul_(scale)  # DeepSpeed's unscale_and_clip_grads on the fp32 gradient
        opt.step()
        impl(
            p,
            m,
            v,
            g,
            scale,
            adam.AdamHyper(lr, beta1, beta2, eps, wd, cls is torch.optim.AdamW, float(s + 1)),
        )
    st = opt.state[q]
    return [int((a != b).sum()) for a, b in ((q.data, p), (st["exp_avg"], m), (st["exp_avg_sq"], v))]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("gdt", GRADS, ids=str)
def test_bitwise_equal_to_torch_optimizers(impl, cls, gdt) -> None:  # type: ignore[no-untyped-def]
    bad = []
    for n, wd, beta1, scale in itertools.product(SIZES, [0.0, 0.05], [0.9, 0.3], [1.0, 0.37]):
        diff = _compare(impl, cls, n, gdt, wd, beta1, scale, seed=n + int(1000 * scale) + int(10 * beta1))
        if any(diff):
            bad.append((n, wd, beta1, scale, diff))
    assert not bad, f"elements differing from torch (param, exp_avg, exp_avg_sq): {bad}"


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_do_not_change_the_result(impl, threads: int) -> None:  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert _compare(impl, torch.optim.AdamW, 200_003, torch.bfloat16, 0.01, 0.9, 0.5, seed=threads) == [
            0,
            0,
            0,
        ]
    finally:
        torch.set_num_threads(before)


def test_special_values_propagate_as_in_torch(impl) -> None:  # type: ignore[no-untyped-def]
    """inf/NaN gradients (an fp16 overflow DeepSpeed did not skip) and subnormal values."""
    g = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-40, -0.0, 6e4] * 700, dtype=torch.float32)
    p0 = torch.randn(g.numel(), generator=torch.Generator().manual_seed(3))
    q = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([q], lr=1e-3)
    q.grad = g.clone()
    opt.step()
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    impl(p, m, v, g, 1.0, adam.AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, 1.0))
    st = opt.state[q]
    for got, want in ((p, q.data), (m, st["exp_avg"]), (v, st["exp_avg_sq"])):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_opcheck(fused_kernel: bool) -> None:
    if not fused_kernel:
        pytest.fail(f"the fused Adam kernel did not build: {adam.build_error()}")
    gen = torch.Generator().manual_seed(0)
    for gdt in (torch.bfloat16, torch.float32):
        args = (
            torch.randn(5000, generator=gen),
            torch.randn(5000, generator=gen) * 0.1,
            torch.rand(5000, generator=gen) * 0.01,
            torch.randn(5000, generator=gen).to(gdt),
            0.5, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, 3.0, adam.uses_fma(),
        )  # fmt: skip
        torch.library.opcheck(torch.ops.nvmeswap.adam_step_.default, args)


def test_bad_arguments_are_clear_errors(fused_kernel: bool) -> None:
    if not fused_kernel:
        pytest.fail(f"the fused Adam kernel did not build: {adam.build_error()}")
    p, m, v = torch.zeros(10), torch.zeros(10), torch.zeros(10)
    hyper = (1.0, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0, True)
    with pytest.raises(RuntimeError, match="exp_avg has 9 elements, param has 10"):
        torch.ops.nvmeswap.adam_step_(p, torch.zeros(9), v, None, *hyper)
    with pytest.raises(RuntimeError, match="param must be a contiguous float32 CPU tensor, got Double"):
        torch.ops.nvmeswap.adam_step_(p.double(), m, v, None, *hyper)
    with pytest.raises(RuntimeError, match="grad must be bfloat16, float16 or float32, got Int"):
        torch.ops.nvmeswap.adam_step_(p, m, v, torch.zeros(10, dtype=torch.int32), *hyper)
    with pytest.raises(RuntimeError, match="step must be >= 1"):
        torch.ops.nvmeswap.adam_step_(p, m, v, None, *hyper[:-2], 0.0, True)


def test_portable_torch_kernels_are_matched_too(tmp_path) -> None:
    """Under torch's portable kernels (ATEN_CPU_CAPABILITY=default: no fused multiply-adds) the
    kernel is built without AVX2, finds that torch rounds each product, and matches it bitwise."""
    import os
    import subprocess
    import sys

    script = (
        "import torch, itertools\n"
        "from nvmeswap import adam\n"
        "assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT'\n"
        "assert adam.supported(), adam.build_error()\n"
        "assert not adam.uses_fma()\n"
        "import test_nvmeswap_adam as t\n"
        "impl = lambda p, m, v, g, s, h: torch.ops.nvmeswap.adam_step_(p, m, v, g, s, *h.args(), False)\n"
        "for cls, gdt in itertools.product([torch.optim.AdamW, torch.optim.Adam], t.GRADS):\n"
        "    assert t._compare(impl, cls, 20_001, gdt, 0.05, 0.9, 0.37, seed=5) == [0, 0, 0], (cls, gdt)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_a_registered_step_hook_prevents_fusion() -> None:
    """The fused step does not call optimizer.step(): an optimizer with step hooks is not fused."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    handle = opt.register_step_pre_hook(lambda *a: None)
    try:
        assert "step hooks" in str(fused.refusal(opt))
    finally:
        handle.remove()
    assert fused.refusal(opt) is None


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "SGD"),
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "'amsgrad'"),
        (lambda ps: torch.optim.Adam(ps, foreach=True), "'foreach'"),
        (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.1)), "'lr'"),
    ],
)
def test_refusal_names_what_is_unsupported(make, needle: str) -> None:  # type: ignore[no-untyped-def]
    why = fused.refusal(make([torch.nn.Parameter(torch.zeros(3))]))
    assert why is not None and needle in why
    assert fused.refusal(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])) is None
    assert fused.refusal(torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))], weight_decay=0.1)) is None


def test_the_load_time_check_can_fail_and_says_where(fused_kernel: bool) -> None:
    """The check that picks the kernel's rounding at load: the other rounding (fused
    multiply-adds where torch uses none, or the reverse) must disagree with torch, and the reason
    names the optimizer, the tensor and the first element that differs."""
    if not fused_kernel:
        pytest.fail(f"the fused Adam kernel did not build: {adam.build_error()}")
    assert adam._disagreement(adam.uses_fma()) is None
    why = adam._disagreement(not adam.uses_fma())
    assert why is not None and "differs in" in why and "first at" in why, why
