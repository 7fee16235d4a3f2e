"""The Gluon GEMM's host side on a CPU: the module imports anywhere, says it cannot run, validates
its configs. The kernel itself needs a Hopper GPU (benchmarks/gemm_gluon.py checks it there); with
triton 3.6 or 3.9 installed (3.9: the CPU test pin, so in CI), ``test_compiles_for_sm90`` compiles
it offline and reads the PTX; the barrier protocol's formulas run in a CPU model of one program
(``_run_protocol``)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from quantkit.kernels import gemm_gluon

ROOT = Path(__file__).resolve().parents[2]


def test_not_available_without_a_gpu():
    assert gemm_gluon.available() is False


@pytest.mark.skipif(gemm_gluon._GLUON_ERROR is not None, reason="Gluon does not import here")
def test_tma_copies_take_the_installed_releases_names():
    """3.9 renamed the TMA copies and left the 3.6 names as functions that raise: the kernels'
    aliases must be the working ones of whichever triton is installed."""
    from triton.experimental.gluon.language.nvidia.hopper import tma

    renamed = hasattr(tma, "async_load")
    assert gemm_gluon._tma_load is (tma.async_load if renamed else tma.async_copy_global_to_shared)
    assert gemm_gluon._tma_store is (tma.async_store if renamed else tma.async_copy_shared_to_global)


def test_launcher_refuses_without_a_gpu():
    a = torch.zeros(4, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="sm_90"):
        gemm_gluon.gluon_scaled_mm(a, a, torch.ones(4), torch.ones(4))


def test_gated_launcher_refuses_without_a_gpu():
    a = torch.zeros(4, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="sm_90"):
        gemm_gluon.gluon_gated_scaled_mm(a, torch.zeros(8, 32, dtype=torch.int8), torch.ones(4), torch.ones(8))


@pytest.mark.parametrize("name", list(gemm_gluon.CONFIGS) + list(gemm_gluon.GATED_CONFIGS))
def test_configs_fit_in_shared_memory(name):
    config = gemm_gluon.config_named(name)
    assert config.shared_bytes() <= gemm_gluon.SHARED_LIMIT
    assert config.gated == (name in gemm_gluon.GATED_CONFIGS)
    assert name.split("_")[1 if config.gated else 0] in config.name
    assert config.name.startswith("gated_") == config.gated


def test_gated_ring_holds_two_weight_tiles():
    plain = gemm_gluon.GluonConfig(128, 64, 128, stages=4)
    gated = gemm_gluon.GluonConfig(128, 64, 128, stages=4, gated=True)
    assert gated.shared_bytes() - plain.shared_bytes() == 4 * 64 * 128


def test_tuning_buckets_are_not_capped():
    # Past gemm_configs.m_bucket's cap at 4096 the best config changes (M = 16384 once ran the
    # M = 4096 pick, an L2-bound ping-pong config, at 0.82x cuBLAS): every power of two is a key.
    assert [gemm_gluon.tune_bucket(M) for M in (1, 1024, 1025, 4096, 16384, 20000)] == [
        1, 1024, 2048, 4096, 16384, 32768]


def test_tune_candidates_are_configs():
    for names in (gemm_gluon.TUNE_CANDIDATES, gemm_gluon.FP8_TUNE_CANDIDATES):
        assert names and all(not gemm_gluon.CONFIGS[name].gated for name in names)
    assert all(gemm_gluon.GATED_CONFIGS[name].gated for name in gemm_gluon.GATED_TUNE_CANDIDATES)
    assert gemm_gluon.candidates(torch.int8, False) == gemm_gluon.TUNE_CANDIDATES
    assert gemm_gluon.candidates(torch.float8_e4m3fn, False) == gemm_gluon.FP8_TUNE_CANDIDATES
    assert gemm_gluon.candidates(torch.float8_e4m3fn, True) == gemm_gluon.GATED_TUNE_CANDIDATES


@pytest.mark.parametrize("kwargs, message", [
    (dict(stages=8), "shared memory"),
    (dict(consumers=3), "consumers"),
    (dict(consumer_warps=8, block_m=64), "block_m"),
    (dict(epilogue_split=3), "epilogue_split"),
    (dict(block_k=48), "block_k"),
    (dict(tail_order=2), "tail_order=2 needs split_m"),  # one consumer: nobody to order
    (dict(consumers=2, consumer_warps=4, split_m=True, tail_order=4), "tail_order=4"),  # not below stages=4
    (dict(prologue_loads=5), "prologue_loads=5"),
    (dict(tail_halves=True), "tail_halves needs split_m"),  # one consumer: no warpgroup per half
    (dict(consumers=2, consumer_warps=4, split_m=True, tail_halves=True, balanced_grid=True), "balanced_grid=False"),
], ids=["too-many-stages", "three-consumers", "rows-per-warp", "split", "block-k", "tail-unsplit", "tail-stages",
        "prologue-stages", "halves-unsplit", "halves-balanced"])
def test_config_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gemm_gluon.GluonConfig(**kwargs)


@pytest.mark.parametrize("M", [1024, 4096, 16384])
@pytest.mark.parametrize("N, K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_pick_config_returns_a_listed_config(M, N, K):
    assert gemm_gluon.pick_config(N, K, M, torch.float8_e4m3fn) in gemm_gluon.CONFIGS.values()


def _compile(config, dtype: str, activation: int = 2, plain: bool = False, grouped: bool = False):
    """Compile for sm_90 without a GPU (Gluon's own source object, as its JIT builds it). ``plain``:
    no bias, no activation (the epilogue store_warp and lean_start act on); else a bias (not
    gated) and ``activation``. ``grouped``: the mixture of experts' form (no bias)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    operand = gl.int8 if dtype == "i8" else gl.float8e4nv
    chunk_n = config.block_n // config.epilogue_split

    def desc(dt, block, gl_dtype):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
        return f"tensordesc<{dt}[{block[0]}, {block[1]}],{layout!r}>"

    signature = {
        "a_desc": desc(dtype, [config.block_m, config.block_k], operand),
        "w_desc": desc(dtype, [config.block_n, config.block_k], operand),
        "out_desc": desc("bf16", [config.stored_rows, chunk_n], gl.bfloat16),
        "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
        "block_expert_ptr": "*i32", "used_ptr": "*i32", "rows_per_expert": "i32", "stride_se": "i32",
        "num_experts": "i32",
    }
    constants = dict(HAS_BIAS=not (config.gated or plain or grouped), ACTIVATION=0 if plain else activation,
                     GROUP_M=config.group_m, STAGES=config.stages,
                     CONSUMERS=config.consumers, EPILOGUE_SPLIT=config.epilogue_split,
                     EPILOGUE_BUFFERS=config.epilogue_buffers,
                     LOADER_REGS=config.loader_regs, CONSUMER_REGS=config.consumer_regs,
                     GATED=config.gated, EARLY_SCALES=config.early_scales, SPLIT_M=config.split_m,
                     STORE_WARP=config.store_mode, LEAN_START=config.lean_start, TAIL_ORDER=config.tail_order,
                     PROLOGUE_LOADS=config.prologue_loads, TAIL_HALVES=config.tail_halves, GROUPED=grouped,
                     num_warps=config.consumer_warps)
    signature.update({name: "constexpr" for name in constants})
    source = GluonASTSource(gemm_gluon._scaled_mm_kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=config.consumer_warps))


def _ptxas_for_sm90():
    """The ptxas triton itself runs for sm_90 (3.9 takes its newer "ptxas-blackwell" from sm_90 on:
    the other one cannot read 3.9's PTX version), or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(90).path
    except (ImportError, AttributeError, RuntimeError):
        return shutil.which("ptxas", path=str(triton.__path__[0] + "/backends/nvidia/bin"))


COMPILE_CASES = [(name, dtype, "fused") for name in list(gemm_gluon.CONFIGS) + list(gemm_gluon.GATED_CONFIGS)
                 for dtype in ("fp8e4nv", "i8")]
# The plain epilogue too where a config's flags change it (store partition, lean start).
COMPILE_CASES += [(name, dtype, "plain") for name, cfg in gemm_gluon.CONFIGS.items()
                  if cfg.store_warp or cfg.lean_start for dtype in ("fp8e4nv", "i8")]
# The grouped (mixture of experts) form of the configs it runs: plain and gated SiLU.
GROUPED_COMPILED = ("coop2_128x256_g16", "coop_128x256", "pp_128x128", "gated_coop2_128x128", "gated_coop_128x128",
                    "gated_pp_128x64")
COMPILE_CASES += [(name, dtype, "grouped") for name in GROUPED_COMPILED for dtype in ("fp8e4nv", "i8")]
# Every config and dtype compiled in one fresh process. Not in this one: under TRITON_INTERPRET=1,
# once other tests had run interpreted Triton kernels, Gluon's compiler ended up in Triton's
# interpreter (tl.cdiv raising inside triton/runtime/interpreter.py) or not depending on the order
# quantkit's modules happened to be imported in (CI, session 13).
_BUILD_SCRIPT = """
import json, sys
from quantkit.kernels import gemm_gluon
from tests.kernels.test_gemm_gluon import _compile
out, cases = sys.argv[1], json.loads(sys.argv[2])
summary = {}
for name, dtype, epilogue in cases:
    key = name + "-" + dtype + "-" + epilogue
    try:
        kernel = _compile(gemm_gluon.config_named(name), dtype, plain=epilogue == "plain",
                          grouped=epilogue == "grouped")
    except Exception as error:
        summary[key] = {"error": (type(error).__name__ + ": " + str(error))[-4000:]}
        continue
    with open(out + "/" + key + ".ptx", "w") as handle:
        handle.write(kernel.asm["ptx"])
    summary[key] = {"shared": kernel.metadata.shared}
with open(out + "/summary.json", "w") as handle:
    json.dump(summary, handle)
"""


@pytest.fixture(scope="module")
def sm90_builds(tmp_path_factory):
    out = tmp_path_factory.mktemp("sm90")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, str(out), json.dumps(COMPILE_CASES)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)
    if run.returncode:
        pytest.fail(f"the sm_90 build process failed ({run.returncode}): {run.stderr[-4000:]}")
    return out, json.loads((out / "summary.json").read_text())


@pytest.mark.skipif(not triton.__version__.startswith(gemm_gluon.SUPPORTED_TRITON),
                    reason="the kernels are written against the Gluon of triton 3.6 and 3.9")
@pytest.mark.parametrize("name, dtype, epilogue", COMPILE_CASES)
def test_compiles_for_sm90(name, dtype, epilogue, sm90_builds, tmp_path):
    """Asynchronous wgmma for INT8 as for FP8 (one MMA in flight: wait_group 1 in the K loop; gated:
    the gate and up MMAs of a step in flight, wait_group 2, and no wait_group 1 that would retire
    the gate MMA of the step just issued), a producer partition (setmaxnreg), shared memory within
    an H100's, no register spills, no wgmma pipeline that ptxas serialized."""
    config = gemm_gluon.config_named(name)
    out, summary = sm90_builds
    built = summary[f"{name}-{dtype}-{epilogue}"]
    assert "error" not in built, built.get("error")
    ptx = (out / f"{name}-{dtype}-{epilogue}.ptx").read_text()
    assert "wgmma.mma_async" in ptx
    in_flight = 2 if config.gated else 1
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx))
    assert waits == {"0", str(in_flight)}, waits
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert built["shared"] <= gemm_gluon.SHARED_LIMIT
    if epilogue == "plain" and config.store_warp:
        # The store partition stores the staged tile; the consumers' per-chunk path (a store_wait
        # for all but the last BUFFERS - 1 stores before each chunk) is not compiled in.
        assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)
        assert not re.search(r"cp\.async\.bulk\.wait_group\.read\s+[1-9]", ptx)
    ptxas = _ptxas_for_sm90()
    if ptxas:
        (tmp_path / "k.ptx").write_text(ptx)
        log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", "-o", str(tmp_path / "k.cubin"),
                              str(tmp_path / "k.ptx")], capture_output=True, text=True, check=True).stderr
        assert re.search(r"\b0 bytes spill stores", log), log
        # ptxas neither serialized the wgmmas (C7510-C7515) nor added waits of its own (C7517).
        assert "serialized" not in log and "is injected" not in log, log


@pytest.mark.parametrize("tiles, sms, balanced, programs", [
    (2048, 132, False, 132), (2048, 132, True, 128),    # 16384x4096: 16 rounds either way
    (3072, 132, True, 128), (192, 132, True, 96),       # 16384x6144 (24 rounds), 1024x6144 (2)
    (14336, 132, True, 132), (100, 132, True, 100),     # 109 rounds need every SM; fewer tiles than SMs
    (133, 132, True, 67), (1, 132, True, 1)])
def test_program_count(tiles, sms, balanced, programs):
    got = gemm_gluon.program_count(tiles, sms, balanced)
    assert got == programs
    # The rounds (the busiest program's tiles) never grow; balanced, one program fewer would need more.
    rounds = -(-tiles // got)
    assert rounds == -(-tiles // min(sms, tiles))
    assert not balanced or got == 1 or -(-tiles // (got - 1)) > rounds


@pytest.mark.parametrize("tiles, sms, programs, units", [
    (3072, 132, 132, 3108),  # 16384x6144: 23 rounds, then 36 tiles as 72 half tiles
    (3584, 132, 132, 3604),  # 4096x28672: 27 rounds, then 20 tiles as 40 halves
    (2048, 132, 132, 2048),  # 16384x4096: 68 tiles left over, 136 halves would not fit one round
    (192, 132, 132, 252),    # 1024x6144: 60 left over
    (2112, 132, 132, 2112),  # whole rounds only
    (66, 132, 132, 132), (2, 132, 4, 4), (67, 132, 67, 67), (1, 1, 1, 1)])
def test_tail_halves_units_cover_every_tile_once(tiles, sms, programs, units):
    """Program p walks units p, p + programs, ...: every tile is taken whole or as its two halves,
    each exactly once; the halves are the last round, at most one per program, on distinct programs."""
    assert gemm_gluon.program_count(tiles, sms, False, tail_halves=True) == programs
    assert gemm_gluon.unit_count(tiles, programs) == units
    taken = {}
    halves_of = {}
    for p in range(programs):
        walked = [gemm_gluon.unit_tile(u, tiles, units) for u in range(p, units, programs)]
        assert all(half == 2 for _, half in walked[:-1])  # only a program's last unit can be a half
        for tile, half in walked:
            for part in ((0, 1) if half == 2 else (half,)):
                assert (tile, part) not in taken
                taken[tile, part] = p
            if half != 2:
                halves_of.setdefault(tile, set()).add(p)
    assert set(taken) == {(t, part) for t in range(tiles) for part in (0, 1)}
    assert all(len(ps) == 2 for ps in halves_of.values())  # a tile's halves on two programs
    rounds = -(-units // programs)
    assert rounds == -(-tiles // programs)  # never a round more than whole tiles take
    if halves_of:
        assert min(halves_of) == tiles - len(halves_of)  # the last tiles, after every whole one


@pytest.mark.skipif(gemm_gluon._GLUON_ERROR is not None, reason="Gluon does not import here")
def test_weight_descriptor_cached_per_weight_and_released_with_it():
    import gc

    w = torch.zeros(256, 128, dtype=torch.int8)
    first = gemm_gluon._weight_descriptor(w, [128, 128])
    assert gemm_gluon._weight_descriptor(w, [128, 128]) is first
    assert gemm_gluon._weight_descriptor(w, [256, 128]) is not first
    assert first.base.data_ptr() == w.data_ptr() and first.base is not w
    before = len(gemm_gluon._WEIGHT_DESCRIPTORS)
    del w, first
    gc.collect()
    assert len(gemm_gluon._WEIGHT_DESCRIPTORS) == before - 1


# ----------------------------------------------------------------------------------------------
# A model of one program's barrier protocol (no GPU, no Gluon): the loader, the consumers, the
# TMA unit and each consumer's wgmma queue as agents that a random scheduler interleaves, with
# mbarriers that, like the hardware's, tell phases apart only by parity. The kernel's own
# formulas (gemm_gluon.ring_slot_phase, previous_phase, turn_phase) pick slots and parities; the
# model knows which phase each wait means and fails on a wait whose barrier is not at that phase
# or the one just before it (a stale phase of the same parity passes, a missed one hangs), on a
# slot read before its data landed or overwritten while an MMA reads it, and on a deadlock.
# ----------------------------------------------------------------------------------------------


class _Barrier:
    """An mbarrier of ``count`` arrivals per phase: ``done`` phases completed; a wait for parity p
    passes once the phase in progress has the other parity (a fresh one passes a wait for parity 1)."""

    def __init__(self, count=1):
        self.done = 0
        self.count = count
        self.arrivals = 0

    def arrive(self):
        self.arrivals += 1
        if self.arrivals == self.count:
            self.arrivals = 0
            self.done += 1

    def passes(self, parity):
        return (self.done & 1) != parity


def _run_protocol(tiles, k_steps, stages, consumers, rng, ordered=True, split=False, staged=False,
                  guard_staging=True, turns=False, tail=0, prologue=0, skip_prologue=True):
    """``split``: two consumers on halves of every tile (split_m), each releasing every slot
    (empty barriers of 2 arrivals). ``staged`` (store_warp; every consumer on every tile): each
    consumer writes its part of the tile into the staging after waiting on stage[1] (the previous
    tile's stores have read it), then arrives on stage[0]; a store agent waits on stage[0], issues
    the tile's TMA stores (which read the staging until they land, in any order) and arrives on stage[1].
    ``guard_staging=False`` drops the consumers' wait on stage[1] (the model must then fail).
    ``turns`` (staging_turns): one part-sized staging; the parts go in tile, then consumer order, one
    phase of stage[0] (1 arrival) per part; once a part is read out, the store agent arrives on the
    free barrier stage[1 + c] of the consumer c that stages the next part.
    ``tail`` (tail_order, split only): with k_steps >= stages, consumer 1 waits on order[0] before
    its step k_steps - tail of each tile, and consumer 0 arrives there once it has issued its last.
    ``prologue`` (prologue_loads): the first min(k_steps, prologue) copies are in flight before any
    agent runs, and the loader skips those steps (``skip_prologue=False``: it does not, and the model
    must then fail)."""
    ring_slot_phase, previous_phase, turn_phase = (gemm_gluon.ring_slot_phase, gemm_gluon.previous_phase,
                                                   gemm_gluon.turn_phase)
    ready = [_Barrier() for _ in range(stages)]
    empty = [_Barrier(2 if split else 1) for _ in range(stages)]
    order = [_Barrier() for _ in range(consumers)]
    slot_data = [None] * stages  # the K-slice (step) whose data a slot holds
    released = [None] * stages  # the last step released from each slot
    landing = []  # TMA copies in flight: (slot, step)
    in_flight = [[] for _ in range(consumers)]  # each consumer's issued, unretired MMAs: steps
    handed_over = set()  # tiles whose consumer passed the turn on
    consumed = []
    stage = [_Barrier(1 if turns else consumers), _Barrier(), _Barrier()]
    staging = [None] * consumers  # the tile whose part each consumer's staging holds
    storing = []  # TMA stores reading the staging: tiles
    stored = []

    def wait(bar, parity, phase):
        # ``phase``: the phase this wait means (the model's own count; -1: a fresh barrier's
        # pre-completed one). Its parity must be the kernel's, and the barrier must be at that
        # phase or just past it whenever the waiter looks, or parity cannot tell it apart.
        assert parity == phase & 1, (parity, phase)

        def ready_to_go():
            assert bar.done in (phase, phase + 1), f"waits for phase {phase}, barrier has completed {bar.done}"
            return bar.passes(parity)

        return ready_to_go

    issued = min(k_steps, prologue)
    landing.extend((step % stages, step) for step in range(issued))  # the kernel's prologue

    def loader():
        step = 0
        for _ in range(tiles):
            for _ in range(k_steps):
                if step < issued and skip_prologue:
                    step += 1
                    continue
                slot, phase = ring_slot_phase(step, stages)
                yield wait(empty[slot], previous_phase(phase), step // stages - 1)
                assert step < stages or released[slot] == step - stages, "slot refilled before its release"
                landing.append((slot, step))
                step += 1

    def consumer(c):
        for local in (range(tiles) if split else range(c, tiles, consumers)):
            step = local * k_steps
            if consumers == 2 and ordered and not split:
                yield wait(order[c], turn_phase(local), (local - 1) // 2)
                assert local == 0 or local - 1 in handed_over, "turn taken before the previous tile's mainloop"
            tail_on = split and tail and k_steps >= stages
            for ki in range(k_steps):
                if tail_on and c == 1 and ki == k_steps - tail:
                    yield wait(order[0], local & 1, local)
                slot, phase = ring_slot_phase(step, stages)
                yield wait(ready[slot], phase, step // stages)
                assert slot_data[slot] == step, f"step {step} read slot {slot} holding step {slot_data[slot]}"
                in_flight[c].append(step)
                yield lambda: len(in_flight[c]) <= 1  # warpgroup_mma_wait(1)
                if ki > 0:
                    release(c, (step + stages - 1) % stages, step - 1)
                step += 1
            if consumers == 2 and ordered and not split:
                order[1 - c].arrive()
                handed_over.add(local)
            if tail_on and c == 0:
                order[0].arrive()
            yield lambda: not in_flight[c]  # warpgroup_mma_wait(0)
            release(c, (step + stages - 1) % stages, step - 1)
            if staged and turns:
                part = local * consumers + c
                if guard_staging:  # this consumer's free barrier, one phase per tile (see store())
                    yield wait(stage[1 + c], gemm_gluon.previous_phase(local + c), local + c - 1)
                assert not storing and (part == 0 or stored[-1] == part - 1), "staging overwritten before stored"
                staging[0] = part
                stage[0].arrive()
            elif staged:
                if guard_staging:
                    yield wait(stage[1], gemm_gluon.previous_phase(local), local - 1)
                assert not storing and (local == 0 or stored[-1] == local - 1), "staging overwritten before stored"
                staging[c] = local
                stage[0].arrive()

    def store():
        for local in range(tiles):
            if turns:
                for c in range(consumers):
                    part = local * consumers + c
                    yield wait(stage[0], part & 1, part)
                    assert staging[0] == part, f"part {part} stored from staging holding {staging[0]}"
                    storing.append(part)
                    yield lambda: not storing
                    stored.append(part)
                    stage[1 + (c + 1) % consumers].arrive()
                continue
            yield wait(stage[0], local & 1, local)
            assert staging == [local] * consumers, f"tile {local} stored from staging holding {staging}"
            storing.append(local)
            yield lambda: not storing  # tma.store_wait(0): the stores have read the staging
            stored.append(local)
            stage[1].arrive()

    def release(c, slot, step):
        assert slot == step % stages and slot_data[slot] == step and step not in in_flight[c]
        released[slot] = step
        consumed.append(step)
        empty[slot].arrive()

    agents = [loader()] + [consumer(c) for c in range(consumers)] + ([store()] if staged else [])
    waiting = [None] * len(agents)  # the condition each agent is blocked on (None: runnable)
    live = set(range(len(agents)))
    while True:
        moves = [("agent", i) for i in live if waiting[i] is None or waiting[i]()]
        moves += [("land", i) for i in range(len(landing))]
        moves += [("retire", c) for c in range(consumers) if in_flight[c]]
        moves += [("stored", 0)] if storing else []
        if not moves:
            assert not live, f"deadlock: agents {sorted(live)} blocked"
            break
        kind, i = rng.choice(moves)
        if kind == "land":  # TMA copies complete in any order
            slot, step = landing.pop(i)
            assert not any(slot_data[slot] in queue for queue in in_flight), "slot overwritten under an MMA"
            slot_data[slot] = step
            ready[slot].arrive()
        elif kind == "stored":  # the tile's TMA stores have read the staging
            assert staging[0] == storing[0] if turns else staging == [storing[0]] * consumers, \
                "staging changed under its stores"
            storing.pop()
        elif kind == "retire":  # one consumer's wgmmas retire in issue order
            step = in_flight[i].pop(0)
            assert slot_data[step % stages] == step, "an MMA's operands changed before it retired"
        else:
            try:
                waiting[i] = next(agents[i])
            except StopIteration:
                live.discard(i)
                waiting[i] = None
    assert sorted(consumed) == sorted(list(range(tiles * k_steps)) * (2 if split else 1))
    assert stored == (list(range(tiles * (consumers if turns else 1))) if staged else [])


@pytest.mark.parametrize("consumers", [1, 2], ids=["cooperative", "ping-pong"])
def test_barrier_protocol_model(consumers):
    """Random tile counts (odd and even), K-step counts from below to several times the ring,
    random interleavings: no deadlock, every wait unambiguous, every slot read after its fill and
    before its refill. Includes the GPU crash case: 3 tiles of 32 K steps on a 5-deep ring."""
    import random

    rng = random.Random(1234)
    cases = [(3, 32, 5), (2, 32, 5), (1, 1, 2), (4, 1, 2)]
    cases += [(rng.randint(1, 7), rng.randint(1, 30), rng.randint(2, 8)) for _ in range(150)]
    for tiles, k_steps, stages in cases:
        for _ in range(3):
            _run_protocol(tiles, k_steps, stages, consumers, rng)


def test_barrier_protocol_model_split_tiles():
    """Two consumers on halves of every tile (split_m: the coop2 configs), each waiting for and
    releasing every slot: no deadlock, no ambiguous wait, no refill before both released."""
    import random

    rng = random.Random(99)
    cases = [(3, 32, 4), (1, 1, 2), (2, 3, 4), (4, 2, 2)]
    cases += [(rng.randint(1, 6), rng.randint(1, 24), rng.randint(2, 6)) for _ in range(100)]
    for tiles, k_steps, stages in cases:
        for _ in range(3):
            _run_protocol(tiles, k_steps, stages, 2, rng, split=True)


def test_barrier_protocol_model_tail_order():
    """tail_order: consumer 1 holds its last steps of a tile until consumer 0 has issued all of its
    own, with every store mode: no deadlock with the ring, no ambiguous wait on the order barrier
    (consumer 0 never arrives for a tile before consumer 1 has waited for the one before)."""
    import random

    rng = random.Random(21)
    cases = [(3, 32, 4, 2), (1, 32, 4, 3), (5, 4, 4, 3), (4, 5, 4, 1), (2, 3, 4, 3), (6, 2, 2, 1)]
    cases += [(rng.randint(1, 7), rng.randint(1, 24), stages, rng.randint(1, stages - 1))
              for stages in (rng.randint(2, 6) for _ in range(120))]
    for tiles, k_steps, stages, tail in cases:
        for staged, turns in ((False, False), (True, False), (True, True)):
            _run_protocol(tiles, k_steps, stages, 2, rng, split=True, staged=staged, turns=turns, tail=tail)


def test_barrier_protocol_model_prologue_loads():
    """prologue_loads: the first tile's first K steps copied before the partitions start, the
    loader going on after them; with every arrangement. A loader that copied them again would
    refill a slot before its release."""
    import random

    rng = random.Random(5)
    cases = [(3, 32, 4, 1), (1, 2, 4, 4), (2, 1, 2, 2), (4, 5, 5, 3)]
    cases += [(rng.randint(1, 6), rng.randint(1, 20), stages, rng.randint(1, stages))
              for stages in (rng.randint(2, 6) for _ in range(80))]
    for tiles, k_steps, stages, prologue in cases:
        _run_protocol(tiles, k_steps, stages, 1, rng, prologue=prologue)
        _run_protocol(tiles, k_steps, stages, 2, rng, prologue=prologue)
        _run_protocol(tiles, k_steps, stages, 2, rng, split=True, tail=min(stages - 1, 3) if stages > 1 else 0,
                      prologue=prologue)
    with pytest.raises(AssertionError, match="slot overwritten|refilled|waits for phase"):
        for seed in range(20):
            _run_protocol(2, 8, 4, 2, random.Random(seed), split=True, prologue=2, skip_prologue=False)


@pytest.mark.parametrize("consumers, split", [(1, False), (2, True)], ids=["cooperative", "split"])
def test_barrier_protocol_model_store_partition(consumers, split):
    """store_warp: the consumers' whole-tile staging handed to a store partition and back (one
    staging buffer set): no deadlock, no ambiguous wait, no tile staged over one not yet read out
    by its stores, no store of a partly staged tile."""
    import random

    rng = random.Random(7)
    cases = [(3, 32, 3), (1, 1, 2), (5, 1, 2), (2, 3, 3)]
    cases += [(rng.randint(1, 7), rng.randint(1, 12), rng.randint(2, 5)) for _ in range(100)]
    for tiles, k_steps, stages in cases:
        for _ in range(3):
            _run_protocol(tiles, k_steps, stages, consumers, rng, split=split, staged=True)


def test_barrier_protocol_model_store_partition_in_turns():
    """staging_turns: the two warpgroups of a split tile take turns on one part-sized staging
    (consumer 0's part of a tile, then consumer 1's): no deadlock with the ring, no ambiguous wait,
    no part staged over one its stores still read."""
    import random

    rng = random.Random(11)
    cases = [(3, 32, 4), (1, 1, 2), (5, 1, 2), (2, 3, 3)]
    cases += [(rng.randint(1, 7), rng.randint(1, 12), rng.randint(2, 5)) for _ in range(100)]
    for tiles, k_steps, stages in cases:
        for _ in range(3):
            _run_protocol(tiles, k_steps, stages, 2, rng, split=True, staged=True, turns=True)
    with pytest.raises(AssertionError, match="staging"):
        for seed in range(50):
            _run_protocol(4, 2, 2, 2, random.Random(seed), split=True, staged=True, turns=True, guard_staging=False)


def test_barrier_protocol_model_catches_unguarded_staging():
    """Without the wait on stage[1], some interleaving stages a tile over one its stores are still reading."""
    import random

    with pytest.raises(AssertionError, match="staging"):
        for seed in range(50):
            _run_protocol(4, 2, 2, 2, random.Random(seed), split=True, staged=True, guard_staging=False)


def test_barrier_protocol_model_catches_unordered_ping_pong():
    """Without the order barrier (the first ping-pong kernel, which crashed on the GPU at
    M=1024, N=6144, K=4096) consumer 1 waits for a ring phase far ahead of the loader."""
    import random

    rng = random.Random(0)
    with pytest.raises(AssertionError, match="waits for phase"):
        _run_protocol(3, 32, 5, 2, rng, ordered=False)


# ---------------------------------------------------------------- gemm.scaled_mm's dispatch to Gluon


def _operands(M=1024, N=384, K=256, dtype=torch.int8, scalar_a=False):
    a = torch.randint(-127, 128, (M, K), dtype=torch.int8).to(dtype) if dtype == torch.int8 else \
        (torch.randn(M, K) * 3).to(dtype)
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8).to(dtype) if dtype == torch.int8 else \
        (torch.randn(N, K) * 3).to(dtype)
    a_scale = torch.rand(1 if scalar_a else M) + 0.5
    w_scale = torch.rand(N) + 0.5
    return a, w, a_scale, w_scale


def _flags(a_scale, w_scale, gated=False, raw_acc=False):
    return (True, a_scale.numel() != 1, w_scale.numel() != 1, False, 0, raw_acc)


@pytest.fixture
def gluon_capable(monkeypatch):
    """A stand-in for an sm_90 GPU with triton 3.6: what is tested is gemm's rule, not the launch."""
    from quantkit.kernels import gemm_tma

    monkeypatch.setattr(gemm_gluon, "available", lambda: True)
    monkeypatch.setattr(gemm_tma, "descriptors_ok", lambda a, w, out: True)


def test_gluon_takes_per_row_and_column_scales_and_16_bit_outputs(gluon_capable):
    from quantkit.kernels.gemm import gluon_takes

    a, w, a_scale, w_scale = _operands()
    out = torch.empty(a.shape[0], w.shape[0], dtype=torch.bfloat16)
    assert gluon_takes(a, w, out, False, _flags(a_scale, w_scale))
    assert gluon_takes(a, w, out.half(), False, _flags(a_scale, w_scale))
    assert not gluon_takes(a, w, out, False, _flags(a_scale, w_scale, raw_acc=True))  # int32 accumulator
    assert not gluon_takes(a, w, out.float(), False, _flags(a_scale, w_scale))        # fp32 output
    _, _, scalar, _ = _operands(scalar_a=True)
    assert not gluon_takes(a, w, out, False, _flags(scalar, w_scale))                 # static per-tensor scale
    a2, w2, _, _ = _operands(K=264)
    assert not gluon_takes(a2, w2, out, False, _flags(a_scale, w_scale))              # K % 16 != 0


def test_gluon_takes_nothing_without_a_capable_gpu():
    from quantkit.kernels.gemm import gluon_takes

    a, w, a_scale, w_scale = _operands()
    out = torch.empty(a.shape[0], w.shape[0], dtype=torch.bfloat16)
    assert not gluon_takes(a, w, out, False, _flags(a_scale, w_scale))


def test_explicit_gluon_kernel_is_refused_where_it_cannot_run():
    from quantkit.kernels import gemm

    a, w, a_scale, w_scale = _operands(M=13)
    with pytest.raises(ValueError, match="kernel='gluon' needs an sm_90 GPU"):
        gemm.scaled_mm(a, w, a_scale, w_scale, kernel="gluon")


def test_gluon_takes_gated_calls_with_per_row_scales(gluon_capable):
    from quantkit.kernels.gemm import gluon_takes

    a, w, a_scale, w_scale = _operands(N=2 * 384)  # the stacked [gate; up] weight, 2N scales
    out = torch.empty(a.shape[0], 384, dtype=torch.bfloat16)
    assert gluon_takes(a, w, out, True, _flags(a_scale, w_scale))
    assert not gluon_takes(a, w, out, True, _flags(a_scale, torch.ones(1)))           # one weight scale
    assert not gluon_takes(a, w, out.float(), True, _flags(a_scale, w_scale))


@pytest.mark.parametrize("dtype, M, gated, expected", [
    (torch.int8, 1024, True, "gluon"),        # gated INT8 from GLUON_GATED_MIN_M: the Gluon gated mode
    (torch.int8, 4096, True, "gluon"),
    (torch.int8, 257, True, "gluon"),
    (torch.int8, 256, True, "tiled"),         # narrow outputs up to 256 rows: a contest (tiled route)
    (torch.float8_e4m3fn, 4096, True, "gluon"),  # gated FP8 (fast accumulation) from GLUON_GATED_MIN_M
    (torch.float8_e4m3fn, 256, True, "tiled"),
    (torch.int8, 1024, False, "gluon"),
    (torch.float8_e4m3fn, 4096, False, "gluon"),      # plain FP8 (fast accumulation) from GLUON_MIN_M
    (torch.float8_e4m3fn, 257, False, "gluon"),
    (torch.int8, 257, False, "gluon"),
    (torch.float8_e4m3fn, 256, False, "tiled"),       # narrow outputs up to 256 rows: a contest (tiled route)
    (torch.int8, 256, False, "tiled"),
], ids=["int8-gated-1024", "int8-gated-4096", "int8-gated-257", "int8-gated-256", "fp8-gated", "fp8-gated-256",
        "int8-plain",
        "fp8-plain", "fp8-plain-257", "int8-plain-257", "fp8-plain-256", "int8-plain-256"])
def test_auto_pick_routes_to_gluon(gluon_capable, monkeypatch, dtype, M, gated, expected):
    from quantkit.kernels import gemm

    monkeypatch.setattr(gemm, "INTERPRETED", False)
    N = 384
    a, w, a_scale, w_scale = _operands(M=M, N=2 * N if gated else N, dtype=dtype)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    flags = (dtype == torch.int8, True, True, False, 2 if gated else 0, False)
    assert gemm._pick_kernel("auto", a, w, out, gated, None, flags, True) == expected
    if gated:
        assert gemm._pick_kernel("gluon", a, w, out, gated, None, flags, True) == "gluon"


@pytest.mark.parametrize("M, N, K, gated, expected", [
    (96, 28672, 4096, False, "gluon"),   # wide outputs from GLUON_WIDE_MIN_M rows
    (95, 28672, 4096, False, "tiled"),
    (129, 8192, 4096, False, "gluon"),   # exactly GLUON_WIDE_N columns
    (129, 8191, 4096, False, "tiled"),
    (128, 4096, 14336, False, "tiled"),  # a large weight, but 32 tiles of 128 columns at M = 128
    (200, 6144, 4096, False, "tiled"),   # narrower outputs wait for GLUON_MIN_M
    (96, 14336, 4096, True, "gluon"),    # gated: N outputs (the stacked weight has 2N rows)
    (200, 6144, 4096, True, "tiled"),    # 2N = 12288 rows, 6144 outputs
    (255, 2048, 640, True, "tiled"),
    (64, 14336, 4096, True, "tiled"),
], ids=["plain-96", "plain-95", "plain-at-bound", "plain-below-bound", "plain-narrow-long-k", "plain-6144",
        "gated-96", "gated-6144", "gated-small", "gated-64"])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_auto_pick_takes_gluon_early_for_wide_outputs(gluon_capable, monkeypatch, dtype, M, N, K, gated, expected):
    from quantkit.kernels import gemm

    monkeypatch.setattr(gemm, "INTERPRETED", False)
    a = torch.empty(M, K, dtype=dtype)
    w = torch.empty(2 * N if gated else N, K, dtype=dtype)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    flags = (dtype == torch.int8, True, True, False, 2 if gated else 0, False)
    assert gemm.gluon_sized(M, N, gated) == (expected == "gluon")
    assert gemm._pick_kernel("auto", a, w, out, gated, None, flags, True) == expected
    # The promoted FP8 mode has no Gluon form.
    if dtype == torch.float8_e4m3fn:
        assert gemm._pick_kernel("auto", a, w, out, gated, None, flags, False) == "tiled"


@pytest.mark.parametrize("M, N, gated, expected", [
    (129, 4096, False, True),     # the tiled kernel's M bucket of 256, narrow outputs
    (255, 6144, False, True),
    (192, 8191, False, True),
    (128, 4096, False, False),    # M = 128: tiled (the Gluon kernel lost at every narrow output)
    (192, 8192, False, False),    # wide outputs: Gluon without a contest
    (256, 4096, False, True),     # the bucket's top (session 48)
    (257, 4096, False, False),    # GLUON_MIN_M: Gluon without a contest
    (256, 2048, True, True),      # gated too (session 49)
    (257, 2048, True, False),     # gated: Gluon from GLUON_GATED_MIN_M = 257
    (200, 2048, True, True),      # gated: N outputs
    (200, 14336, True, False),
], ids=["plain-129", "plain-255", "plain-narrow", "plain-128", "plain-wide", "plain-256", "plain-257", "gated-256",
        "gated-257", "gated-narrow", "gated-wide"])
def test_contest_covers_the_narrow_outputs_of_the_256_row_bucket(M, N, gated, expected):
    from quantkit.kernels import gemm

    assert gemm.contested(M, N, gated) == expected
    assert not (gemm.contested(M, N, gated) and gemm.gluon_sized(M, N, gated))


def test_gated_scaled_mm_launches_the_gluon_gated_call_and_caches_it(gluon_capable, monkeypatch):
    """gemm.gated_scaled_mm (INT8, M >= GLUON_GATED_MIN_M) asks gemm_gluon.tuned_call for a gated call
    once per signature and launches it with the stacked weight and the (M, N) output; the second
    call of the signature launches the cached call directly."""
    from quantkit.kernels import call_cache, gemm

    monkeypatch.setattr(gemm, "INTERPRETED", False)
    monkeypatch.setattr(gemm, "_check_runnable", lambda a: None)
    monkeypatch.setattr(gemm, "_CALLS", call_cache.SignatureCache())
    launches, tunes = [], []

    class RecordingCall(gemm_gluon.GluonCall):
        def __init__(self):
            pass

        def __call__(self, a, w, out, a_scale, w_scale, bias_arg):
            launches.append((a, w, out, a_scale, w_scale))
            out.fill_(1.0)

    def tuned_call(a, w, out, a_scale, w_scale, bias, activation, gated=False):
        tunes.append((tuple(w.shape), tuple(out.shape), bias, activation, gated))
        return RecordingCall()

    monkeypatch.setattr(gemm_gluon, "tuned_call", tuned_call)
    N = 384
    a, w, a_scale, w_scale = _operands(M=1024, N=2 * N)
    for _ in range(2):
        out = gemm.gated_scaled_mm(a, w, a_scale, w_scale, activation="silu")
        assert out.shape == (1024, N) and bool((out == 1).all())
    assert tunes == [((2 * N, 256), (1024, N), None, "silu", True)]
    assert len(launches) == 2 and all(call[1] is w and call[4] is w_scale for call in launches)


@pytest.mark.parametrize("M", [257, 1024, 4096])
def test_auto_pick_keeps_promoted_fp8_on_triton(gluon_capable, monkeypatch, M):
    """The Gluon kernel accumulates FP8 in the fast mode only: fp8_fast_accum=False stays on the
    Triton kernels (which promote every 128 products), also past GLUON_MIN_M, plain and gated."""
    from quantkit.kernels import gemm

    monkeypatch.setattr(gemm, "INTERPRETED", False)
    a, w, a_scale, w_scale = _operands(M=M, N=384, dtype=torch.float8_e4m3fn)
    out = torch.empty(M, 384, dtype=torch.bfloat16)
    flags = (False, True, True, False, 0, False)
    triton_kind = "persistent" if M >= gemm.PERSISTENT_MIN_M else "tiled"
    assert gemm._pick_kernel("auto", a, w, out, False, None, flags, fp8_fast_accum=False) == triton_kind
    gated_out = torch.empty(M, 192, dtype=torch.bfloat16)  # the gated GEMM's FP8 Triton kernel is the tiled one
    gated_flags = (False, True, True, False, 2, False)
    assert gemm._pick_kernel("auto", a, w, gated_out, True, None, gated_flags, fp8_fast_accum=False) == "tiled"
    picked = gemm._pick(a, w, a_scale, w_scale, None, out, "none", False, False, None, False, "auto")
    assert picked[0] == triton_kind and picked[2] is False
    assert gemm._pick(a, w, a_scale, w_scale, None, out, "none", False, False, None, True, "auto")[0] == "gluon"


def test_explicit_gluon_kernel_refuses_promoted_fp8():
    from quantkit.kernels import gemm

    a, w, a_scale, w_scale = _operands(M=13, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fast mode only"):
        gemm.scaled_mm(a, w, a_scale, w_scale, kernel="gluon", fp8_fast_accum=False)


@pytest.mark.parametrize("dtype, gated, expected", [
    (torch.float8_e4m3fn, False, "FP8_TUNE_CANDIDATES"),
    (torch.int8, False, "TUNE_CANDIDATES"),
    (torch.int8, True, "GATED_TUNE_CANDIDATES"),
    (torch.float8_e4m3fn, True, "GATED_TUNE_CANDIDATES"),
])
def test_tuned_call_times_the_dtypes_candidates_and_keeps_the_fastest_median(monkeypatch, dtype, gated, expected):
    """The first call of a key times every candidate of its dtype and form (with the call's own
    tensors) in TUNE_ROUNDS rounds, the order rotating by one each round, keeps the candidate with
    the fastest median and records the medians; the next call of the key times nothing. One slow
    outlier sample (the last candidate's first round: the fastest median) does not decide it."""
    names = getattr(gemm_gluon, expected)
    rounds = gemm_gluon.TUNE_ROUNDS
    assert rounds >= 3
    samples = {name: [1.0 + 0.1 * i] * rounds for i, name in enumerate(names)}
    fastest = names[-1]
    samples[fastest] = [9.0] + [0.5] * (rounds - 1)
    samples[names[0]] = [0.4] + [2.0] * (rounds - 1)  # one lucky sample: not the pick
    served = {name: iter(values) for name, values in samples.items()}
    launched = []

    class FakeCall:
        def __init__(self, config, M, N, device, has_bias, activation):
            self.config = config

        def __call__(self, a, w, out, a_scale, w_scale, bias_arg):
            launched.append(self.config)

    def bench(fn):
        fn()
        return next(served[next(n for n in names if gemm_gluon.config_named(n) == launched[-1])])

    monkeypatch.setattr(gemm_gluon, "GluonCall", FakeCall)
    monkeypatch.setattr(gemm_gluon, "_graph_bench_ms", bench)
    monkeypatch.setattr(gemm_gluon, "_TUNED", {})
    monkeypatch.setattr(gemm_gluon, "TUNE_TIMES", {})
    a, w, a_scale, w_scale = _operands(M=1024, N=2 * 384 if gated else 384, dtype=dtype)
    out = torch.empty(1024, 384, dtype=torch.bfloat16)
    call = gemm_gluon.tuned_call(a, w, out, a_scale, w_scale, None, "silu" if gated else "none", gated)
    assert call.config == gemm_gluon.config_named(fastest)
    order = [n for turn in range(rounds) for n in names[turn % len(names):] + names[:turn % len(names)]]
    assert launched == [gemm_gluon.config_named(n) for n in order]
    (recorded,) = gemm_gluon.TUNE_TIMES.values()
    assert recorded == {name: sorted(values)[rounds // 2] for name, values in samples.items()}
    launched.clear()
    again = gemm_gluon.tuned_call(a, w, out, a_scale, w_scale, None, "silu" if gated else "none", gated)
    assert again.config == call.config and launched == []


class _Recorded:
    """A launch object standing in for a kernel's (TiledCall / GluonCall), recording its kind."""

    def __init__(self, kind, log):
        self.kind, self.log = kind, log

    def __call__(self, a, w, out, a_scale, w_scale, bias_arg):
        self.log.append(self.kind)
        out.fill_(1.0)


@pytest.fixture
def recorded_kernels(monkeypatch):
    """gemm's GPU path on CPU with a Gluon-capable stand-in: each launch appends its kernel's
    name ("gluon", "tiled", "persistent") to the returned list; a fresh signature cache."""
    from quantkit.kernels import call_cache, gemm, gemm_tma

    monkeypatch.setattr(gemm, "INTERPRETED", False)
    monkeypatch.setattr(gemm, "_check_runnable", lambda a: None)
    monkeypatch.setattr(gemm, "_CALLS", call_cache.SignatureCache())
    monkeypatch.setattr(gemm_gluon, "available", lambda: True)
    picked = []
    monkeypatch.setattr(gemm_gluon, "tuned_call", lambda *args, **kwargs: _Recorded("gluon", picked))
    monkeypatch.setattr(gemm, "_tiled_call", lambda *args, **kwargs: _Recorded("tiled", picked))
    monkeypatch.setattr(gemm_tma, "persistent_call", lambda *args, **kwargs: _Recorded("persistent", picked))
    return picked


@pytest.mark.parametrize("M", [257, 512, 1024])
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_tiled_pick_forced_by_unaligned_pointers_is_not_cached(recorded_kernels, M, dtype):
    """A call whose first use of a signature has a misaligned base pointer runs tiled (TMA needs
    16-byte aligned bases); that pick must not be cached for the signature, or every later aligned
    call would stay tiled. Gluon sizes from GLUON_MIN_M on, not only persistent ones."""
    from quantkit.kernels import gemm

    K, N = 256, 384
    _, w, a_scale, w_scale = _operands(M=M, N=N, K=K, dtype=dtype)
    source, _, _, _ = _operands(M=M, N=N, K=K, dtype=dtype)
    storage = torch.empty(M * K + 16, dtype=torch.int8).view(dtype)
    unaligned = storage[1:1 + M * K].view(M, K)
    unaligned.copy_(source)
    aligned = source.clone()
    assert unaligned.stride() == aligned.stride() and unaligned.data_ptr() % 16
    gemm.scaled_mm(unaligned, w, a_scale, w_scale)
    gemm.scaled_mm(aligned, w, a_scale, w_scale)
    gemm.scaled_mm(aligned, w, a_scale, w_scale)
    assert recorded_kernels == ["tiled", "gluon", "gluon"]


@pytest.fixture
def contest_timer(monkeypatch, recorded_kernels):
    """The contest's timer on the recorded stand-ins: each timed call takes the time ``times`` names
    for its kind. Returns (times, the kinds in timing order); fresh contest tables."""
    from quantkit.kernels import gemm, gemm_tma

    monkeypatch.setattr(gemm, "_CONTESTS", {})
    monkeypatch.setattr(gemm, "CONTEST_TIMES", {})
    times, timed = {}, []

    def fake_bench(fn):
        fn()
        timed.append(recorded_kernels.pop())
        return times[timed[-1]]

    monkeypatch.setattr(gemm_tma, "_graph_bench_ms", fake_bench)
    return times, timed


@pytest.mark.parametrize("winner", ["gluon", "tiled"])
@pytest.mark.parametrize("gated", [False, True])
def test_contest_keeps_the_faster_kernel_per_tuning_key(recorded_kernels, contest_timer, winner, gated):
    """Between CONTEST_MIN_M and GLUON_MIN_M rows, narrow outputs: the first call of a tuning key
    times both kernels' tuned calls in rotated rounds and runs the faster; a later M of the same
    bucket (another signature) reuses the pick without timing; another bucket runs no contest."""
    from quantkit.kernels import gemm

    times, timed = contest_timer
    times.update({"gluon": 1.0, "tiled": 2.0} if winner == "gluon" else {"gluon": 2.0, "tiled": 1.5})
    N = 384
    call = gemm.gated_scaled_mm if gated else gemm.scaled_mm
    for M in (192, 255):
        a, w, a_scale, w_scale = _operands(M=M, N=2 * N if gated else N)
        call(a, w, a_scale, w_scale)
        call(a, w, a_scale, w_scale)
    rounds = gemm.CONTEST_ROUNDS
    assert timed == [["tiled", "gluon"][(r + i) % 2] for r in range(rounds) for i in range(2)]
    assert recorded_kernels == [winner] * 4
    assert len(gemm._CALLS) == 2  # either winner is kept per signature (not re-picked per call)
    (recorded,) = gemm.CONTEST_TIMES.values()
    assert recorded == {"tiled": times["tiled"], "gluon": times["gluon"]}
    recorded_kernels.clear()
    a, w, a_scale, w_scale = _operands(M=128, N=2 * N if gated else N)
    call(a, w, a_scale, w_scale)
    assert recorded_kernels == ["tiled"] and len(timed) == 2 * rounds


def test_contest_refuses_to_time_inside_a_graph_capture(contest_timer, monkeypatch):
    """A contest inside a CUDA graph capture: the tuners' error naming the fix, nothing timed."""
    from quantkit.kernels import gemm

    class CudaOperand:  # the attributes _contest reads, on a "GPU"
        shape, dtype, device, is_cuda = (192, 256), torch.int8, torch.device("cpu"), True

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _, w, a_scale, w_scale = _operands(M=192)
    out = torch.empty(192, 384, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="warm-up call"):
        gemm._contest(CudaOperand(), w, a_scale, w_scale, None, out, "none", False, _flags(a_scale, w_scale), True)
    assert contest_timer[1] == [] and gemm.CONTEST_TIMES == {}


def test_promoted_and_fast_fp8_calls_keep_separate_kernels(recorded_kernels):
    """The same FP8 tensors with fp8_fast_accum=True (Gluon) and False (Triton, which promotes):
    separate signature-cache entries, each call its own kernel, in either order and repeated."""
    from quantkit.kernels import gemm

    a, w, a_scale, w_scale = _operands(M=1024, N=384, dtype=torch.float8_e4m3fn)
    for fast in (False, True, False, True):
        gemm.scaled_mm(a, w, a_scale, w_scale, fp8_fast_accum=fast)
    assert recorded_kernels == ["persistent", "gluon", "persistent", "gluon"]


def test_tuned_call_refuses_to_tune_inside_a_graph_capture(monkeypatch):
    """A first call of a tuning key inside a CUDA graph capture cannot time its candidates: a clear
    error naming the fix (a warm-up call), not a broken capture. A tuned key still launches."""

    class CudaOperand:  # a's attributes tuned_call reads, on a "GPU"
        shape, dtype, device, is_cuda = (1024, 256), torch.int8, torch.device("cpu"), True

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(gemm_gluon, "_TUNED", {})
    monkeypatch.setattr(gemm_gluon, "_graph_bench_ms", lambda fn: pytest.fail("no timing inside a capture"))
    _, w, a_scale, w_scale = _operands(M=1024, N=384)
    out = torch.empty(1024, 384, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="warm-up call"):
        gemm_gluon.tuned_call(CudaOperand(), w, out, a_scale, w_scale, None, "none")
    monkeypatch.setattr(gemm_gluon, "GluonCall", lambda config, *args: config)
    key = (384, 256, gemm_gluon.tune_bucket(1024), torch.int8, False, None, "none", torch.bfloat16,
           torch.device("cpu"), False)
    gemm_gluon._TUNED[key] = gemm_gluon.CONFIGS["pp_128x128"]
    assert gemm_gluon.tuned_call(CudaOperand(), w, out, a_scale, w_scale, None, "none") == gemm_gluon.CONFIGS[
        "pp_128x128"]
