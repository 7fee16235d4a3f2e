"""The grouped mixture-of-experts GEMM (kernels/moe.py, under TRITON_INTERPRET=1 on CPU) against
its torch twin (reference.grouped_scaled_mm) and a float64 computation, and its routing plan."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from quantkit.kernels import moe, ops, reference

# The interpreter evaluates sigmoid's exp(-x) for large |x| before it saturates to 0 or 1.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

ROOT = Path(__file__).resolve().parents[2]
QDTYPES = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
# (tokens, slots, experts, K, N): odd token counts, K not a multiple of the 64-wide K tile, N not
# of the N tile; the last has ~70 pairs per expert (64-row blocks), the first one pair in all.
SHAPES = [(1, 1, 3, 64, 48), (13, 3, 5, 80, 70), (37, 2, 9, 208, 40), (140, 4, 8, 64, 24)]
EPILOGUES = [(False, "none"), (False, "gelu_tanh"), (True, "silu"), (True, "gelu")]


def _operands(tokens, slots, experts, K, N, dtype, gated, seed, per_token=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, K, generator=gen) * 2
    a, a_scale = reference.quantize_per_token(x, dtype)
    if not per_token:
        a_scale = a_scale.amax().reshape(1)
        a = reference.quantize_per_tensor(x, a_scale, dtype)
    rows = 2 * N if gated else N
    w_float = torch.randn(experts, rows, K, generator=gen)
    w = torch.empty(experts, rows, K, dtype=dtype)
    w_scale = torch.empty(experts, rows)
    for e in range(experts):
        q, scale = reference.quantize_per_channel(w_float[e], dtype)
        w[e], w_scale[e] = q, scale.view(-1)
    # Every expert and the "no expert" sentinel (= experts) among the pairs.
    routed = torch.randint(0, experts + 1, (tokens * slots,), generator=gen)
    routed[0] = experts - 1
    routed[-1] = experts if routed.numel() > 1 else routed[-1]
    return a, a_scale, w, w_scale, routed


def _float64(a, a_scale, w, w_scale, routed, slots, activation, gated):
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    out = torch.zeros(routed.numel(), n_out, dtype=torch.float64)
    scale = a_scale.double().reshape(-1)
    for p, e in enumerate(routed.tolist()):
        if e >= w.shape[0]:
            continue
        row = p // slots
        full = (a[row].double() @ w[e].double().t()) * scale[row if scale.numel() > 1 else 0] * w_scale[e].double()
        if gated:
            gate, up = full.chunk(2)
            out[p] = reference.apply_activation(gate, activation) * up
        else:
            out[p] = reference.apply_activation(full, activation)
    return out


# The weight tiles loaded by address (_grouped_kernel) or by TMA (_grouped_tma_kernel: on the GPU
# the plain form's default in 64-row blocks), walking column tiles first or row blocks first, or by
# TMA on a persistent grid (_grouped_persistent_kernel: the default in 128-row blocks).
KERNELS = [pytest.param(dict(tma=False), id="address"), pytest.param(dict(tma=True, n_fastest=True), id="tma"),
           pytest.param(dict(tma=True, n_fastest=False), id="tma-rows-first"),
           pytest.param(dict(tma=True, persistent=True), id="tma-persistent")]


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gated,activation", EPILOGUES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_grouped_gemm_matches_reference_and_float64(dtype, shape, gated, activation, kernel):
    tokens, slots, experts, K, N = shape
    a, a_scale, w, w_scale, routed = _operands(*shape, dtype, gated, seed=sum(shape))
    out = moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, slots, activation, gated, torch.bfloat16,
                                config=kernel)
    ref = reference.grouped_scaled_mm(a, w, a_scale, w_scale, routed, slots, activation, gated, torch.bfloat16)
    assert out.shape == ref.shape == (tokens * slots, N)
    unrouted = routed >= experts
    assert torch.equal(out[unrouted], torch.zeros_like(out[unrouted]))
    if dtype == torch.int8 and activation == "none":
        assert torch.equal(out, ref)  # exact int32 accumulators, the same fp32 epilogue and one cast
    else:  # two bf16 roundings apart at most (fp32 summation order, the kernel's erf/sigmoid)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3 * ref.float().abs().max().item())
    exact = _float64(a, a_scale, w, w_scale, routed, slots, activation, gated)
    assert ((out.double() - exact).norm() / exact.norm()).item() < 2 ** -8


@pytest.mark.parametrize("dtype", QDTYPES)
def test_a_weight_tma_cannot_take_falls_back_to_address_loads(dtype, monkeypatch):
    """A weight whose base is not 16-byte aligned (a view one byte into its storage): TMA cannot
    address it, so the TMA config runs the address-loaded kernel."""
    a, a_scale, aligned, w_scale, routed = _operands(150, 2, 3, 64, 40, dtype, True, seed=4)
    storage = torch.empty(aligned.numel() + 1, dtype=dtype)
    w = storage[1:].view(aligned.shape)
    w.copy_(aligned)
    assert w.is_contiguous() and not moe.tma_eligible(w) and moe.tma_eligible(aligned)
    launched = []
    monkeypatch.setattr(moe._GROUPED, "kernel", _Recording(moe._grouped_kernel, "_grouped_kernel", launched))
    monkeypatch.setattr(moe, "_grouped_tma_kernel", _Recording(moe._grouped_tma_kernel, "_grouped_tma_kernel",
                                                               launched))
    out = moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 2, "silu", True, config=dict(tma=True))
    ref = reference.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 2, "silu", True)
    assert launched == ["_grouped_kernel"]
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3 * ref.float().abs().max().item())
    moe.grouped_scaled_mm(a, aligned, a_scale, w_scale, routed, 2, "silu", True, config=dict(tma=True))
    assert launched == ["_grouped_kernel", "_grouped_tma_kernel"]


class _Recording:
    """A jitted kernel that notes its launches."""

    def __init__(self, kernel, name, launched):
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_grouped_gemm_with_a_static_input_scale(dtype, kernel):
    a, a_scale, w, w_scale, routed = _operands(11, 2, 4, 96, 36, dtype, True, seed=5, per_token=False)
    out = moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 2, "silu", True, torch.float16, config=kernel)
    ref = reference.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 2, "silu", True, torch.float16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -9, atol=1e-3 * ref.float().abs().max().item())


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_route_plan_puts_each_pair_once_in_a_block_of_its_expert(block_m):
    """Every pair in exactly one slot, each block within one run: an expert's, or the last run for
    the pairs of no expert (their rows are written as zeros); slots past the runs are padding."""
    experts = 7
    routed = torch.randint(0, experts + 3, (301,), generator=torch.Generator().manual_seed(block_m))
    plan = moe.route_plan(routed, experts, block_m)
    rows, used = plan.rows, int(plan.used)
    assert rows.numel() % block_m == 0 and used % block_m == 0 and used <= rows.numel()
    assert sorted(rows[:used][rows[:used] >= 0].tolist()) == list(range(301))
    assert (rows[used:] == -1).all()
    block_of_slot = torch.arange(used) // block_m
    filled = rows[:used] >= 0
    runs = routed.clamp_max(experts)
    assert torch.equal(plan.block_expert.long()[block_of_slot[filled]], runs[rows[:used][filled].long()])


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_routing_weights_scale_the_rows_in_the_epilogue(dtype, kernel):
    a, a_scale, w, w_scale, routed = _operands(9, 4, 6, 64, 40, dtype, False, seed=8)
    weights = torch.rand(routed.numel(), generator=torch.Generator().manual_seed(9))
    out = moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 4, out_dtype=torch.float32, row_scale=weights,
                                config=kernel)
    ref = reference.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 4, out_dtype=torch.float32, row_scale=weights)
    plain = reference.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 4, out_dtype=torch.float32)
    if dtype == torch.int8:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    torch.testing.assert_close(ref, plain * weights[:, None], rtol=1e-6, atol=0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_pair_unrouted_gives_zeros_and_no_columns_an_empty_output(kernel):
    a, a_scale, w, w_scale, routed = _operands(150, 2, 3, 64, 40, torch.float8_e4m3fn, True, seed=6)
    out = moe.grouped_scaled_mm(a, w, a_scale, w_scale, torch.full_like(routed, 3), 2, "silu", True,
                                config=kernel)
    assert out.shape == (300, 40) and torch.equal(out, torch.zeros_like(out))
    empty = moe.grouped_scaled_mm(a, w[:, :0], a_scale, w_scale[:, :0], routed, 2, config=kernel)
    assert empty.shape == (300, 0)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_persistent_grid_smaller_than_its_programs(dtype):
    """One expert and a handful of pairs: 3 tiles for the interpreter's 4 programs."""
    a, a_scale, w, w_scale, routed = _operands(5, 1, 1, 64, 40, dtype, False, seed=7)
    config = dict(tma=True, persistent=True, block_m=128)
    out = moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 1, "gelu", config=config)
    ref = reference.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 1, "gelu")
    assert moe.plan_capacity(5, 1, 128) // 128 == 3
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3 * ref.float().abs().max().item())


def _sm90_shared_bytes(config: dict, gated: bool, dtype: torch.dtype, out_dtype: torch.dtype) -> int:
    """Shared memory of the kernel ``config`` selects, compiled for sm_90 here (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if config.get("tma"):
        kernel = moe._grouped_persistent_kernel if config.get("persistent") else moe._grouped_tma_kernel
    else:
        kernel = moe._grouped_kernel
    operand = "i8" if dtype == torch.int8 else "fp8e4nv"
    out = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[out_dtype]
    constants = dict(IS_INT8=dtype == torch.int8, A_PER_TOKEN=True, ROW_SCALE=not gated, ACTIVATION=2 if gated else 0,
                     GATED=gated, EVEN_K=True, N_FASTEST=bool(config.get("n_fastest")), SLOT_ORDER=False,
                     INTERPRETED=False,
                     NUM_PROGRAMS=132, BLOCK_M=config["block_m"], BLOCK_N=config["block_n"],
                     BLOCK_K=config["block_k"])
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        if name == "w_desc":
            signature[name] = f"tensordesc<{operand}[{config['block_n']}, {config['block_k']}]>"
            continue
        signature[name] = {"a_ptr": f"*{operand}", "w_ptr": f"*{operand}", "out_ptr": f"*{out}", "rows_ptr": "*i32",
                           "block_expert_ptr": "*i32", "used_ptr": "*i32"}.get(
            name, "*fp32" if name.endswith("_ptr") else "i32")
        attrs[(i,)] = [["tt.divisibility", 16]]  # as the launcher specializes aligned pointers and strides
    constants = {name: constants[name] for name in kernel.arg_names if name in constants}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config["num_warps"], num_stages=config["num_stages"]))
    return compiled.metadata.shared


# Compiled in a fresh process without TRITON_INTERPRET (here @triton.jit gives interpreted
# functions, which triton.compile cannot take), as test_gemm_gluon's sm_90 builds.
_SHARED_SCRIPT = """
import json, torch
from quantkit.kernels import moe
from tests.kernels.test_moe import _sm90_shared_bytes
rows = []
for dtype in (torch.float8_e4m3fn, torch.int8):
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        for pairs in (128 * 64, 128 * 512):
            for gated, K in ((True, 2048), (False, 768)):
                config = moe.default_config(pairs, 128, K, gated, out_dtype, interpreted=False)
                if dtype == torch.int8 and out_dtype == torch.float16:
                    continue  # the same shared memory as bf16 (2-byte outputs, 1-byte operands)
                rows.append([str(dtype), str(out_dtype), pairs, gated, config,
                             _sm90_shared_bytes(config, gated, dtype, out_dtype)])
print(json.dumps(rows))
"""


def test_gpu_defaults_fit_in_an_sms_shared_memory():
    """Every default the GPU takes at prefill sizes (64- and 128-row blocks, both forms, Qwen3-30B-
    A3B's K, each output dtype, FP8 and INT8), compiled for sm_90: at most the 227 KB (232,448
    bytes) an H100/H200 SM gives one block. The persistent kernel's 4 stages fill it with bf16
    outputs; a float32 output's larger staging buffer overflowed it (review, session 32)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SHARED_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 20 and {row[4]["block_m"] for row in rows} == {64, 128}
    assert {bool(row[4].get("persistent")) for row in rows} == {True, False}
    for dtype, out_dtype, pairs, gated, config, shared in rows:
        assert 0 < shared <= 232448, (dtype, out_dtype, pairs, gated, config, shared)


def test_grouped_gemm_refuses_bad_input_in_one_line():
    a, a_scale, w, w_scale, routed = _operands(5, 2, 3, 64, 16, torch.int8, False, seed=1)
    cases = [
        ((a, w[0], a_scale, w_scale, routed, 2), "3-D"),
        ((a, w, a_scale, w_scale[:, :4], routed, 2), "w_scale has shape"),
        ((a, w, a_scale, w_scale, routed.float(), 2), "1-D integer tensor"),
        ((a, w, a_scale, w_scale, routed[:-1], 2), "pairs but a has 5 rows"),
        ((a, w, a_scale, w_scale, routed, 0), "row_div=0"),
        ((a, w.to(torch.float8_e4m3fn), a_scale, w_scale, routed, 2), "w.dtype"),
        ((a, w, a_scale, w_scale, routed, 2, "none", False, torch.bfloat16, torch.ones(3)), "row_scale must be"),
        ((a, w, a_scale, w_scale, torch.stack([routed, routed], 1)[:, 0], 2), "experts.contiguous()"),
    ]
    for args, message in cases:
        for backend in ("triton", "torch"):
            with pytest.raises(ValueError, match=message):
                ops.grouped_scaled_mm(*args, backend=backend)


def test_a_plan_made_once_serves_both_gemms_and_other_blocks_replan(monkeypatch):
    a, a_scale, w, w_scale, routed = _operands(21, 2, 5, 64, 32, torch.int8, False, seed=4)
    plan = moe.plan_for(routed, 5)
    made = []
    monkeypatch.setattr(moe, "route_plan", lambda *args: made.append(args) or moe.RoutePlan(*plan))
    ref = reference.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 2, out_dtype=torch.float32)
    out = moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 2, out_dtype=torch.float32, plan=plan)
    assert torch.equal(out, ref)  # exact int32 accumulators, the same fp32 epilogue
    assert not made  # the plan given was used
    other = 64 if plan.block_m != 64 else 16
    moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 2, out_dtype=torch.float32, plan=plan,
                          config={"block_m": other})
    assert len(made) == 1 and made[0][2] == other  # planned again for the other block height


def test_cached_launches_repeat_tritons_arguments(monkeypatch):
    """The plan's two kernels and the address-loaded GEMM on the GPU path (launch.CachedLaunch),
    driven with a recording fake kernel as in test_call_cache.py: the first call of a key goes
    through triton, later ones launch directly with the same arguments; another pair count with
    the same integer specialization reuses the binary, another operand dtype does not."""
    from quantkit.kernels import launch
    from tests.kernels.fake_launch import FakeDriver, RecordingKernel
    from tests.kernels.test_call_cache import _check_direct_launch_repeats_triton_path

    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(launch, "_driver", lambda: FakeDriver())
    monkeypatch.setattr(moe, "check_runnable", lambda t, name: None)
    kernels = {}
    for name in ("_RANK", "_PLACE", "_GROUPED"):
        cached = launch.CachedLaunch(getattr(moe, name).kernel)
        cached.kernel = kernels[name] = RecordingKernel()
        monkeypatch.setattr(moe, name, cached)
    for _ in range(3):
        a, a_scale, w, w_scale, routed = _operands(13, 3, 5, 80, 70, torch.int8, True, seed=3)
        moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 3, "silu", True, config=dict(block_m=16))
    arg_names = {"_RANK": moe._rank_kernel.arg_names, "_PLACE": moe._place_kernel.arg_names,
                 "_GROUPED": moe._grouped_kernel.arg_names}
    for name, kernel in kernels.items():
        assert len(kernel.triton_calls) == 1 and len(kernel.compiled.runs) == 2, name
        _check_direct_launch_repeats_triton_path(kernel, arg_names[name], 2)
    # 21 pairs instead of 39 (neither 1 nor a multiple of 16): the same binaries.
    a, a_scale, w, w_scale, routed = _operands(7, 3, 5, 80, 70, torch.int8, True, seed=4)
    moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 3, "silu", True, config=dict(block_m=16))
    assert [len(k.triton_calls) for k in kernels.values()] == [1, 1, 1]
    assert kernels["_RANK"].compiled.runs[-1][9 + 3] == 21  # the pair count, passed as it is
    # FP8 operands: a new GEMM binary, the same plan kernels.
    a, a_scale, w, w_scale, routed = _operands(7, 3, 5, 80, 70, torch.float8_e4m3fn, True, seed=4)
    moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 3, "silu", True, config=dict(block_m=16))
    assert [len(k.triton_calls) for k in kernels.values()] == [1, 1, 2]


# ---------------------------------------------------------------------------------------------- slot order


def _slot_case(dtype, gated, seed, per_token=True, tokens=141, slots=3, experts=2, K=80, N=40):
    """A routing with 128-row blocks (over 192 pairs an expert on average), every expert and the
    sentinel of no expert among the pairs, K not a multiple of the 64-wide K tile."""
    a, a_scale, w, w_scale, routed = _operands(tokens, slots, experts, K, N, dtype, gated, seed, per_token)
    assert moe.block_m_for(routed.numel(), experts) == 128
    return a, a_scale, w, w_scale, routed, moe.plan_for(routed, experts)


@pytest.mark.parametrize("gluon", [False, True])
def test_128_row_blocks_from_96_pairs_only_for_gluon_slot_order(gluon, monkeypatch):
    """The lower 128-row threshold (96 pairs an expert) is the Gluon slot-order path's; pair-order
    GEMMs and the Triton slot-order kernel keep 64-row blocks up to 192 pairs."""
    from quantkit.kernels import gemm_gluon

    monkeypatch.setattr(gemm_gluon, "available", lambda: gluon)
    experts = 7
    rows128 = 128 if gluon else 64
    for average, pair_order, slot_order in ((31, 32, 32), (95, 64, 64), (96, 64, rows128), (191, 64, rows128),
                                            (192, 128, 128)):
        pairs = average * experts
        assert moe.block_m_for(pairs, experts) == pair_order, average
        assert moe.block_m_for(pairs, experts, slot_order=True) == slot_order, average
    routed = torch.randint(0, experts, (100 * experts,), generator=torch.Generator().manual_seed(3))
    assert moe.plan_for(routed, experts).block_m == 64
    assert moe.plan_for(routed, experts, slot_order=True).block_m == (128 if gluon else 64)


@pytest.mark.parametrize("block_m", [16, 128])
def test_route_plan_slots_invert_its_rows(block_m):
    routed = torch.randint(0, 9, (301,), generator=torch.Generator().manual_seed(block_m))
    plan = moe.route_plan(routed, 7, block_m)
    assert plan.slots.dtype == torch.int32 and plan.slots.shape == (301,)
    assert torch.equal(plan.rows[plan.slots.long()], torch.arange(301, dtype=torch.int32))


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("per_token", [True, False], ids=["per-token", "static"])
def test_gather_slots_matches_its_twin(dtype, per_token):
    a, a_scale, w, w_scale, routed, plan = _slot_case(dtype, True, seed=21, per_token=per_token)
    got = moe.gather_slots(a, a_scale, plan, 3, w.shape[0])
    ref = reference.gather_slots(a, a_scale, plan.rows, plan.block_expert, int(plan.used), 128, 3, w.shape[0])
    used = int(plan.used)
    assert used < plan.rows.numel()  # slots past the routing's, zeroed too
    for g, r in zip(got, ref):
        assert torch.equal(g.view(torch.int8) if g.dtype == dtype else g, r.view(torch.int8) if r.dtype == dtype else r)
    # The pairs of no expert and the padding: zero rows and scales.
    unrouted = (routed >= w.shape[0]).nonzero().flatten()
    assert unrouted.numel() and (got[1][plan.slots[unrouted].long()] == 0).all()
    assert (got[1][:used][plan.rows[:used] < 0] == 0).all() and (got[1][used:] == 0).all()


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("gated,activation,out_dtype", [(False, "none", torch.bfloat16), (True, "silu", torch.bfloat16),
                                                        (False, "gelu", torch.float32), (True, "gelu", torch.float16)])
def test_grouped_slot_mm_equals_the_pair_order_kernel_row_for_row(dtype, gated, activation, out_dtype):
    """The slot-order GEMM (the persistent kernel with its rows by TMA) gives each routed pair's
    row of grouped_scaled_mm bit for bit, zeros for the pairs of no expert and the padding, and
    its twin's rows (INT8 plain exactly)."""
    a, a_scale, w, w_scale, routed, plan = _slot_case(dtype, gated, seed=23)
    a_slots, scales = moe.gather_slots(a, a_scale, plan, 3, w.shape[0])
    out = moe.grouped_slot_mm(a_slots, w, scales, w_scale, plan, activation, gated, out_dtype)
    assert out.dtype == out_dtype
    pairs = moe.grouped_scaled_mm(a, w, a_scale, w_scale, routed, 3, activation, gated, out_dtype, plan=plan)
    used = int(plan.used)
    assert out.shape == (plan.rows.numel(), w.shape[1] // (2 if gated else 1))
    assert torch.equal(out[plan.slots.long()], pairs)
    assert torch.equal(out[:used][plan.rows[:used] < 0], torch.zeros_like(out[:used][plan.rows[:used] < 0]))
    ref = reference.grouped_slot_mm(a_slots, w, scales, w_scale, plan.block_expert, used, 128, activation, gated,
                                    out_dtype)
    assert torch.equal(out[used:], torch.zeros_like(out[used:]))
    if dtype == torch.int8 and activation == "none":
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3 * ref.float().abs().max().item())


@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.bfloat16])
def test_combine_sums_each_tokens_slots_in_order(weight_dtype):
    """Each token's k slot rows, each times its pair's routing weight when given (any float dtype),
    summed in float32: its twin's result exactly, and a float64 sum's to the output's rounding."""
    gen = torch.Generator().manual_seed(24)
    routed = torch.randint(0, 3, (61 * 4,), generator=gen)
    plan = moe.route_plan(routed, 3, 128)
    y = (torch.randn(plan.rows.numel(), 130, generator=gen) * 3).to(torch.bfloat16)
    weights = None if weight_dtype is None else (torch.rand(61 * 4, generator=gen) + 0.05).to(weight_dtype)
    got = moe.combine(y, plan.slots, 61, 4, weights)
    assert got.dtype == torch.bfloat16 and got.shape == (61, 130)
    assert torch.equal(got, reference.combine(y, plan.slots, 61, 4, weights))
    rows = y[plan.slots.long()].double() * (1 if weights is None else weights.double()[:, None])
    torch.testing.assert_close(got.double(), rows.view(61, 4, 130).sum(1), rtol=2 ** -8, atol=0)
    for bad in (torch.rand(61 * 4 - 1), torch.randint(0, 3, (61 * 4,)), torch.rand(61 * 8)[::2]):
        with pytest.raises(ValueError, match="tokens \\* k = 244 routing weights"):
            moe.combine(y, plan.slots, 61, 4, bad)


def test_slot_order_refuses_other_plans_in_one_line():
    a, a_scale, w, w_scale, routed = _operands(13, 3, 5, 80, 70, torch.int8, False, seed=25)
    plan = moe.plan_for(routed, 5)  # a few pairs an expert: 16-row blocks
    with pytest.raises(ValueError, match="128-row blocks"):
        moe.grouped_slot_mm(torch.zeros(plan.rows.numel(), 80, dtype=torch.int8), w, torch.ones(plan.rows.numel()),
                            w_scale, plan)
    assert not moe.slot_order_takes(plan, w)


def test_moe_ops_pass_opcheck():
    """The MoE custom ops (route plan, both GEMM orders, gather, combine): schema, fake tensors,
    autograd registration and AOT dispatch with dynamic shapes."""
    from quantkit.kernels import triton_ops

    a, a_scale, w, w_scale, routed, plan = _slot_case(torch.int8, True, seed=26)
    weights = torch.rand(routed.numel(), generator=torch.Generator().manual_seed(27)).to(torch.bfloat16)
    a_slots, scales = moe.gather_slots(a, a_scale, plan, 3, w.shape[0])
    y = moe.grouped_slot_mm(a_slots, w, scales, w_scale, plan, "silu", True)
    index = (plan.rows, plan.block_expert, plan.used, plan.block_m)
    cases = [
        (triton_ops._moe_route_plan_op, (routed, w.shape[0], True)),
        (triton_ops._grouped_scaled_mm_op, (a, w, a_scale, w_scale, routed, 3, "silu", True, torch.bfloat16, None,
                                           *index)),
        (triton_ops._moe_gather_slots_op, (a, a_scale, *index, 3, w.shape[0])),
        (triton_ops._grouped_slot_mm_op, (a_slots, w, scales, w_scale, *index, "silu", True, torch.bfloat16)),
        (triton_ops._moe_combine_op, (y, plan.slots, a.shape[0], 3, weights)),
        (triton_ops._moe_combine_op, (y, plan.slots, a.shape[0], 3, None)),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


def test_slot_order_cached_launches_repeat_tritons_arguments(monkeypatch):
    """gather_slots, the zeroing of the rows past the routing and combine launch through
    launch.CachedLaunch on the GPU path: driven with a recording fake kernel, the first call of a
    key goes through triton and later ones launch directly with the same arguments."""
    from quantkit.kernels import launch
    from tests.kernels.fake_launch import FakeDriver, RecordingKernel
    from tests.kernels.test_call_cache import _check_direct_launch_repeats_triton_path

    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(launch, "_driver", lambda: FakeDriver())
    kernels = {}
    for name in ("_GATHER", "_ZERO_TAIL", "_COMBINE"):
        cached = launch.CachedLaunch(getattr(moe, name).kernel)
        cached.kernel = kernels[name] = RecordingKernel()
        monkeypatch.setattr(moe, name, cached)
    a, a_scale, w, w_scale, routed, plan = _slot_case(torch.int8, True, seed=28)
    weights = torch.rand(routed.numel())
    y = torch.randn(plan.rows.numel(), 40).to(torch.bfloat16)
    for _ in range(3):
        moe.gather_slots(a, a_scale, plan, 3, w.shape[0])
        moe._zero_tail(y, plan)
        moe.combine(y, plan.slots, a.shape[0], 3, weights)
    arg_names = {"_GATHER": moe._gather_slots_kernel.arg_names, "_ZERO_TAIL": moe._zero_tail_kernel.arg_names,
                 "_COMBINE": moe._combine_kernel.arg_names}
    for name, kernel in kernels.items():
        assert len(kernel.triton_calls) == 1 and len(kernel.compiled.runs) == 2, name
        _check_direct_launch_repeats_triton_path(kernel, arg_names[name], 2)


def test_slot_order_refuses_mismatched_scales_in_one_line():
    a, a_scale, w, w_scale, routed, plan = _slot_case(torch.int8, False, seed=29)
    a_slots, scales = moe.gather_slots(a, a_scale, plan, 3, w.shape[0])
    with pytest.raises(ValueError, match="w_scale must be a contiguous float32"):
        moe.grouped_slot_mm(a_slots, w, scales, w_scale.reshape(-1), plan)
