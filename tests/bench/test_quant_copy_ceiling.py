import pytest


def test_copy_ceiling_takes_the_best_of_its_three_copies(monkeypatch):
    from quantkit.bench import quant as bench_quant

    # Fake timers: each runs the copy it is given once (the SM copy under the interpreter) and
    # reports a time of its own; the ceiling is the fastest of the three.
    timed = []

    def graph_timer(fn):
        fn()
        timed.append("graph")
        return 2.0 if len(timed) == 1 else 1.0  # memcpy, then the SM copy

    def do_bench(fn):
        fn()
        timed.append("do_bench")
        return 4.0

    monkeypatch.setattr(bench_quant, "do_bench_ms", do_bench)
    found = bench_quant.copy_ceiling(4000, timer=graph_timer, device="cpu")
    assert timed == ["graph", "graph", "do_bench"]
    assert found["memcpy"] == pytest.approx(4000 / 2e-3 / 1e9) and found["sm"] == pytest.approx(4000 / 1e-3 / 1e9)
    assert found["best"] == found["sm"] > found["memcpy"] > found["memcpy_do_bench"]
    with pytest.raises(ValueError, match="kernel="):
        bench_quant.copy_bandwidth_gbs(64, graph_timer, "cpu", kernel="dma")
