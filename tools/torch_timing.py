"""Device time of torch work replayed from a CUDA graph (the fla comparisons of the GDN benchmarks): the graph
removes Python's launch cost, which the JAX side does not pay either (its calls are chained in one program)."""

from __future__ import annotations


def capture(call, iters: int):
    """A CUDA graph of `iters` calls (call it once before, outside, so that Triton autotunes and compiles)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            call()
    return graph


def replay_seconds(graph, iters: int, repeats: int) -> float:
    """Seconds per call: the best of `repeats` replays of a graph of `iters` calls, timed with CUDA events."""
    import torch

    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best / iters
