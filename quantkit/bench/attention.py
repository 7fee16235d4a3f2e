"""Attention benchmarks: quantkit's Triton prefill / decode attention vs torch SDPA, bf16.

Prefill: causal, 32 query / 8 key-value heads, head_dim 128, sequence 1k..16k, batch chosen so
that every point holds 16k tokens (batch = 16384 // seq). Baseline: ``F.scaled_dot_product_attention``
pinned to the flash backend (``enable_gqa=True``, or K/V expanded to 32 heads outside the
timed region when this torch's flash backend refuses GQA; the row says which). FLOPs counted for
the causal half only: ``2 * 2 * B * Hq * S * S * D / 2``.

Decode: one query token per sequence over a bf16 (B, 8, L, 128) cache, L = 1k..32k, batch 1
and 8. Baseline: SDPA (default backend choice) with q (B, 32, 1, 128) and the cache sliced to L.
Decode is memory-bound: the figure of merit is cache bytes read per second
(``2 * B * Hkv * L * D * 2`` bytes). Times come two ways: eager ``do_bench`` (includes the
Python launch cost, which dominates short caches) and CUDA-graph GPU time, as a decode loop
captured in a graph sees it (``gemm.bench_graph_ms``).

The L2 is cold for every call, as in a model, where a layer's weights and the other layers'
caches pass through it between two reads of one cache: ``do_bench`` clears it before each
repetition, and the graph timer captures a flush before each call and subtracts the flushes'
own time. (Until session 28 the graph times came from ``do_bench_cudagraph``, which does not
flush: caches up to 8k tokens at batch 1 were read from the L2, above HBM's bandwidth.)
Every output is checked against SDPA (the fp32 twin with a window) before it is timed.
Rows go to attention.csv / attention.json with GPU, versions, commit, source digest, date;
attention.png plots TFLOP/s (prefill) and GB/s (decode).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from quantkit.kernels import attention as attention_kernels
from quantkit.kernels import norm as norm_kernels
from quantkit.kernels import reference_attention
from quantkit.kernels import rope as rope_kernels
from quantkit.bench.common import (CheckFailed, bench_ms, environment_metadata, rel_err, require_matplotlib,
                                   require_within, write_rows)
from quantkit.bench.gemm import bench_graph_ms

N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
PREFILL_SEQS = (1024, 2048, 4096, 8192, 16384)
PREFILL_TOKENS = 16384
DECODE_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
DECODE_BATCHES = (1, 8)


# A kernel's output against SDPA's (or the fp32 oracle's) above this: no time is reported.
MAX_REL_ERR = 1e-2


def checked(what: str, err: float) -> float:
    return require_within(what, err, MAX_REL_ERR)


def _flash_sdpa(q, k, v):
    """SDPA pinned to the flash backend; returns (callable, gqa_mode)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def gqa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    try:
        gqa()
        return gqa, "enable_gqa"
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def expanded():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k_full, v_full, is_causal=True)

        return expanded, "expanded_kv"


def bench_prefill(seq: int, block_config=None, head_dim: int = HEAD_DIM, window=None) -> dict:
    batch = max(1, PREFILL_TOKENS // seq)
    gen = torch.Generator(device="cuda").manual_seed(seq)
    q = torch.randn(batch, N_Q_HEADS, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, N_KV_HEADS, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, N_KV_HEADS, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = head_dim**-0.5

    def ours():
        return attention_kernels.flash_attention(q, k, v, scale, window, block_config=block_config)

    sdpa, gqa_mode = _flash_sdpa(q, k, v)
    if window is None:
        err = checked(f"prefill S={seq} B={batch} d={head_dim}", rel_err(ours(), sdpa()))
    else:  # SDPA's flash backend has no window: the fp32 twin is the reference
        ref = reference_attention.flash_attention(q.float(), k.float(), v.float(), scale, window)
        err = checked(f"prefill S={seq} B={batch} d={head_dim} window={window}", rel_err(ours(), ref))
    ms = bench_ms(ours)
    flops = 2.0 * 2.0 * batch * N_Q_HEADS * seq * seq * head_dim / 2.0
    row = {
        "kind": "prefill", "batch": batch, "seq": seq, "n_q_heads": N_Q_HEADS, "n_kv_heads": N_KV_HEADS,
        "head_dim": head_dim, "window": window, "block_config": str(block_config or attention_kernels._prefill_config(head_dim)),
        "quantkit_ms": ms, "quantkit_tflops": flops / (ms * 1e-3) / 1e12, "rel_err_vs_sdpa": err,
    }
    if window is None:
        sdpa_ms = bench_ms(sdpa)
        row.update(sdpa_ms=sdpa_ms, sdpa_tflops=flops / (sdpa_ms * 1e-3) / 1e12, ratio=sdpa_ms / ms, sdpa_gqa=gqa_mode)
    return row


def bench_decode(batch: int, length: int, block_config=None, n_splits: int | None = None, eager: bool = True,
                 compare_two_launch: bool = False) -> dict:
    """One decode point vs SDPA. ``compare_two_launch`` also times the unfused combine (second
    kernel) and a second (ours, SDPA) pair after it: the A/B and the run-to-run spread, same tensors."""
    gen = torch.Generator(device="cuda").manual_seed(length + batch)
    q = torch.randn(batch, N_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache = torch.randn(batch, N_KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(batch, N_KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5
    q4 = q[:, :, None, :]

    def ours(fuse_combine=True):
        return attention_kernels.decode_attention(q, k_cache, v_cache, seqlens, scale, block_config=block_config,
                                                  n_splits=n_splits, fuse_combine=fuse_combine)

    def sdpa():
        return F.scaled_dot_product_attention(q4, k_cache, v_cache, enable_gqa=True)

    want = sdpa()[:, :, 0]
    err = checked(f"decode B={batch} L={length}", rel_err(ours(), want))
    bytes_read = 2.0 * batch * N_KV_HEADS * length * HEAD_DIM * 2
    ms, sdpa_ms = (bench_ms(ours), bench_ms(sdpa)) if eager else (float("nan"), float("nan"))
    graph_ms, sdpa_graph_ms = bench_graph_ms(ours), bench_graph_ms(sdpa)
    row = {
        "kind": "decode", "batch": batch, "seq": length, "n_q_heads": N_Q_HEADS, "n_kv_heads": N_KV_HEADS,
        "head_dim": HEAD_DIM, "block_config": str(block_config or attention_kernels._decode_config(HEAD_DIM)),
        "n_splits": n_splits or "plan",
        "quantkit_ms": ms, "sdpa_ms": sdpa_ms, "ratio": sdpa_ms / ms,
        "quantkit_graph_ms": graph_ms, "sdpa_graph_ms": sdpa_graph_ms, "ratio_graph": sdpa_graph_ms / graph_ms,
        "quantkit_graph_gbps": bytes_read / (graph_ms * 1e-3) / 1e9,
        "sdpa_graph_gbps": bytes_read / (sdpa_graph_ms * 1e-3) / 1e9, "rel_err_vs_sdpa": err,
    }
    if compare_two_launch:
        two_launch = functools.partial(ours, fuse_combine=False)
        row["rel_err_two_launch_vs_sdpa"] = checked(f"decode two-launch B={batch} L={length}",
                                                    rel_err(two_launch(), want))
        row["two_launch_graph_ms"] = bench_graph_ms(two_launch)
        row["quantkit_graph_ms_repeat"] = bench_graph_ms(ours)
        row["sdpa_graph_ms_repeat"] = bench_graph_ms(sdpa)
        row["ratio_graph_repeat"] = row["sdpa_graph_ms_repeat"] / row["quantkit_graph_ms_repeat"]
        row["fused_over_two_launch"] = row["two_launch_graph_ms"] / graph_ms
    return row


def run_attention_checks() -> list[dict]:
    """Real-shape correctness on the GPU vs fp32 oracles; raises CheckFailed on a failure."""
    rows = []

    def record(name, err, limit=1e-2):
        rows.append({"check": name, "rel_err": err, "limit": limit, "ok": err < limit})
        print(f"check {name:48s} rel_err={err:.2e} {'ok' if err < limit else 'FAIL'}", flush=True)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    for (batch, hq, hkv, seq, d, window) in [(1, 32, 8, 1000, 128, None), (2, 8, 1, 4097, 64, None),
                                              (1, 4, 1, 2000, 256, 512), (1, 8, 8, 3000, 128, 257)]:
        q, k, v = randn(batch, hq, seq, d), randn(batch, hkv, seq, d), randn(batch, hkv, seq, d)
        out = attention_kernels.flash_attention(q, k, v, d**-0.5, window)
        ref = reference_attention.flash_attention(q.float(), k.float(), v.float(), d**-0.5, window)
        record(f"prefill b{batch} h{hq}x{hkv} s{seq} d{d} w{window}", rel_err(out, ref))
    lens = [1, 777, 2048, 13]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = randn(sum(lens), 32, 128), randn(sum(lens), 8, 128), randn(sum(lens), 8, 128)
    out = attention_kernels.flash_attention(q, k, v, 0.088, 512, cu, cu, max(lens))
    ref = reference_attention.flash_attention(q.float(), k.float(), v.float(), 0.088, 512, cu, cu)
    record("prefill packed [1,777,2048,13] w512", rel_err(out, ref))
    for (batch, hq, hkv, d, window) in [(8, 32, 8, 128, None), (3, 4, 1, 256, 512), (2, 8, 8, 64, None)]:
        capacity = 20000
        seqlens = torch.randint(1, capacity + 1, (batch,), device="cuda", dtype=torch.int32)
        q, kc, vc = randn(batch, hq, d), randn(batch, hkv, capacity, d), randn(batch, hkv, capacity, d)
        out = attention_kernels.decode_attention(q, kc, vc, seqlens, d**-0.5, window)
        ref = reference_attention.decode_attention(q.float(), kc.float(), vc.float(), seqlens, d**-0.5, window)
        record(f"decode b{batch} h{hq}x{hkv} d{d} w{window} cap{capacity}", rel_err(out, ref))
    # The fused combine at the shapes where its tiling differs: 32 splits (batch 1), MQA with 32
    # heads at d=256 (one split per chunk), one split (no combine), and the two-launch variant.
    for (batch, hq, hkv, d, capacity, kwargs) in [
        (1, 32, 8, 128, 32768, {}), (1, 32, 1, 256, 9000, {}), (1, 32, 1, 256, 9000, {"n_splits": 2}),
        (2, 32, 8, 128, 5000, {"n_splits": 1}),
        (8, 32, 8, 128, 20000, {"fuse_combine": False}), (1, 32, 8, 128, 32768, {"fuse_combine": False}),
    ]:
        seqlens = torch.randint(capacity // 2, capacity + 1, (batch,), device="cuda", dtype=torch.int32)
        q, kc, vc = randn(batch, hq, d), randn(batch, hkv, capacity, d), randn(batch, hkv, capacity, d)
        out = attention_kernels.decode_attention(q, kc, vc, seqlens, d**-0.5, **kwargs)
        ref = reference_attention.decode_attention(q.float(), kc.float(), vc.float(), seqlens, d**-0.5)
        record(f"decode b{batch} h{hq}x{hkv} d{d} cap{capacity} {kwargs}", rel_err(out, ref))
    # Replays of one captured graph with new lengths in place: the arrival counters must be back
    # at zero after every replay, or a later replay combines too early (stale or unwritten partials).
    batch, capacity = 4, 8192
    q, kc, vc = randn(batch, 32, 128), randn(batch, 8, capacity, 128), randn(batch, 8, capacity, 128)
    seqlens = torch.full((batch,), capacity, device="cuda", dtype=torch.int32)
    attention_kernels.decode_attention(q, kc, vc, seqlens, 0.088)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention_kernels.decode_attention(q, kc, vc, seqlens, 0.088)
    worst = 0.0
    for replay in range(20):
        seqlens.copy_(torch.randint(1, capacity + 1, (batch,), device="cuda", dtype=torch.int32))
        q.copy_(randn(batch, 32, 128))
        graph.replay()
        ref = reference_attention.decode_attention(q.float(), kc.float(), vc.float(), seqlens, 0.088)
        worst = max(worst, rel_err(captured, ref))
    record("decode graph replays x20 b4 new lengths", worst)
    counters = attention_kernels._GROUP_COUNTERS[q.device]
    record("decode arrival counters zero after replays", float(counters.abs().sum().item()), limit=0.5)
    q, k = randn(4, 32, 2048, 128), randn(4, 8, 2048, 128)
    cos, sin = randn(4, 2048, 128), randn(4, 2048, 128)
    got = rope_kernels.apply_rope(q, k, cos, sin)
    want = reference_attention.apply_rope(q.float(), k.float(), cos, sin)
    record("rope 4x2048 32/8 heads d128", max(rel_err(got[0], want[0]), rel_err(got[1], want[1])))
    x, res, w = randn(4096, 4096), randn(4096, 4096), randn(4096)
    got = norm_kernels.rms_norm(x, w, 1e-6, res, 1.0)
    want = reference_attention.rms_norm(x, w, 1e-6, res, 1.0)
    record("rms_norm+residual 4096x4096 gemma", max(rel_err(got[0], want[0]), rel_err(got[1], want[1])))
    got = norm_kernels.layer_norm(x, w, res[0], 1e-5)
    record("layer_norm 4096x4096", rel_err(got[0], F.layer_norm(x.float(), (4096,), w.float(), res[0].float(), 1e-5)))
    failed = [r["check"] for r in rows if not r["ok"]]
    if failed:
        raise CheckFailed(f"GPU checks failed: {failed}")
    return rows


def _write(rows: list[dict], out_dir: Path, meta: dict, plot: bool) -> None:
    write_rows(out_dir, "attention", rows, meta, lead=("kind", "batch", "seq"))
    if not plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_p, ax_d) = plt.subplots(1, 2, figsize=(12, 4.5))
    pre = [r for r in rows if r["kind"] == "prefill" and r.get("window") is None and "sdpa_ms" in r]
    ax_p.plot([r["seq"] for r in pre], [r["quantkit_tflops"] for r in pre], "o-", label="quantkit Triton")
    ax_p.plot([r["seq"] for r in pre], [r["sdpa_tflops"] for r in pre], "s--", label="SDPA flash")
    ax_p.set(xscale="log", xlabel="sequence length", ylabel="TFLOP/s", title="causal prefill, 32/8 heads, d=128, bf16")
    ax_p.legend()
    for batch in sorted({r["batch"] for r in rows if r["kind"] == "decode"}):
        dec = [r for r in rows if r["kind"] == "decode" and r["batch"] == batch]
        ax_d.plot([r["seq"] for r in dec], [r["quantkit_graph_gbps"] for r in dec], "o-", label=f"quantkit B={batch}")
        ax_d.plot([r["seq"] for r in dec], [r["sdpa_graph_gbps"] for r in dec], "s--", label=f"SDPA B={batch}")
    ax_d.set(xscale="log", xlabel="cache length", ylabel="GB/s (CUDA graph)", title="decode attention, 32/8 heads, d=128")
    ax_d.legend()
    fig.suptitle(f"{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  {meta['date'][:10]}")
    fig.tight_layout()
    fig.savefig(out_dir / "attention.png", dpi=110)
    plt.close(fig)


def run_attention_benchmark(
    out_dir: str | os.PathLike = "benchmarks/results",
    plot: bool = True,
    prefill_seqs=PREFILL_SEQS,
    decode_lengths=DECODE_LENGTHS,
    decode_batches=DECODE_BATCHES,
    checks: bool = True,
) -> list[dict]:
    """Benchmark prefill and decode attention vs SDPA; write CSV/JSON/PNG; return the rows.

    ``checks``: first the real-shape GPU checks of the attention, RoPE and norm kernels
    (attention_checks.json; a failure stops the run before any timing).
    """
    if not torch.cuda.is_available():
        raise ValueError("the attention benchmark needs a CUDA GPU; run it on the GPU machine")
    if plot:
        require_matplotlib()
    out_dir = Path(out_dir)
    if checks:
        check_rows = run_attention_checks()
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "attention_checks.json").write_text(json.dumps(check_rows, indent=1, default=str))
    meta = environment_metadata()
    meta["timer"] = "eager: triton do_bench (L2 cleared per repetition); graph: gemm.bench_graph_ms (L2 flushed per call)"
    rows = []
    for seq in prefill_seqs:
        row = bench_prefill(seq)
        rows.append(row)
        print(f"prefill S={seq:6d} B={row['batch']:2d}: quantkit {row['quantkit_tflops']:6.1f} TFLOP/s, "
              f"SDPA flash {row['sdpa_tflops']:6.1f} ({row['sdpa_gqa']}), ratio {row['ratio']:.3f}, "
              f"err {row['rel_err_vs_sdpa']:.1e}", flush=True)
    for batch in decode_batches:
        for length in decode_lengths:
            row = bench_decode(batch, length, compare_two_launch=True)
            rows.append(row)
            print(f"decode B={batch} L={length:6d}: eager {row['quantkit_ms'] * 1e3:7.1f} us vs SDPA "
                  f"{row['sdpa_ms'] * 1e3:7.1f} us ({row['ratio']:.2f}x); graph {row['quantkit_graph_ms'] * 1e3:7.1f} "
                  f"us vs {row['sdpa_graph_ms'] * 1e3:7.1f} us ({row['ratio_graph']:.2f}x), "
                  f"{row['quantkit_graph_gbps']:6.0f} GB/s, err {row['rel_err_vs_sdpa']:.1e}; two-launch "
                  f"{row['two_launch_graph_ms'] * 1e3:7.1f} us (fused {row['fused_over_two_launch']:.3f}x); repeat "
                  f"{row['quantkit_graph_ms_repeat'] * 1e3:7.1f} vs {row['sdpa_graph_ms_repeat'] * 1e3:7.1f} us "
                  f"({row['ratio_graph_repeat']:.3f}x)", flush=True)
    _write(rows, out_dir, meta, plot)
    return rows
