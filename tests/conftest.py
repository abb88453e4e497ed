"""Shared test setup: JAX on the CPU unless told otherwise, the `gpu` marker's auto-skip, and engines that
are built once per session and checked for leaks after every test.

GPU tests run with `JAX_PLATFORMS=cuda pytest -m gpu` (the default here is the CPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

# The files that build engines, servers or golden models, longest first (seconds of work on the 2-core CPU, from
# `tools/test.sh --durations=0`). `tools/test.sh` deals whole files (with SAME_WORKER's partners) to two workers in
# this order instead of xdist's, the files with the most tests first: the long units go out first and the short
# files fill in at the end, so that the two workers finish together.
LONGEST_FILES = (
    "test_server.py",  # ~330 s with the files that share its live server (SAME_WORKER)
    "test_golden.py",  # ~280 s
    "test_notebooks.py",  # ~75 s after test_golden.py on its worker (SAME_WORKER), ~145 s on the other
    "test_engine.py",  # ~320 s with test_overlap.py (SAME_WORKER)
    "test_background_compile.py",  # ~155 s
    "test_kernels_gdn_prefill.py",  # ~130 s
    "test_kernels_gdn_decode.py",  # ~125 s
    "test_kernels_in_model.py",
    "test_overlap.py",  # after test_engine.py (SAME_WORKER)
    "test_deterministic.py",
    "test_program_store.py",
)

# Files dealt to the worker of another file, after it:
# - the accuracy notebook runs the full prefills that test_golden.py compiles, and loads them from that worker's
#   compilation cache (tests/test_notebooks.py);
# - the files of tests/_server.py's live server, a session fixture that builds an engine (~50 s of the 2-core CPU),
#   get it built once instead of once on each worker;
# - test_overlap.py's engines have the shapes of test_engine.py's `engine` and load its programs from the cache
#   (65-90 s beside it, 110 s on the other worker).
LIVE_SERVER_FILES = ("test_bad_input.py", "test_bench.py", "test_fuzz.py", "test_responses_api.py",
                     "test_structured_output.py", "test_tokenize.py", "test_vllm_params.py")  # fmt: skip
SAME_WORKER = {
    "test_notebooks.py": "test_golden.py",
    **dict.fromkeys(LIVE_SERVER_FILES, "test_server.py"),
    "test_overlap.py": "test_engine.py",
}


def longest_files_first(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order in a file


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a venv without it does not have
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with SAME_WORKER's files in their partner's work unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFilePairs(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            name = path.rpartition("/")[2]
            return path[: len(path) - len(name)] + SAME_WORKER.get(name, name)

    return LoadFilePairs(config, log)


def pytest_collection_modifyitems(config, items):
    longest_files_first(items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return  # no jax import (and no backend start) for the host-only test files
    import jax

    platform = jax.devices()[0].platform
    if platform != "gpu":
        skip = pytest.mark.skip(reason=f"needs a GPU; JAX runs on {platform} (set JAX_PLATFORMS=cuda)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory) -> str:
    """One persistent XLA compilation cache for the session: an engine whose step programs have the same
    shapes as an earlier engine's (same model, pool and page-table sizes) loads them instead of compiling."""
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="session")
def tiny_model():
    from qwen35_jax.api import load_model

    return load_model("tiny", dtype="float32")


class EngineRegistry:
    """Builds engines and remembers them, so that every test can be checked for leaks on all of them."""

    def __init__(self, compile_cache: str):
        self.compile_cache = compile_cache
        self.engines: list = []
        self.compiled_ahead: set[int] = set()  # ids of engines whose every bucket was compiled at build

    def build(self, model, compile_now: bool = True, **config):
        from qwen35_jax.serving.factory import EngineConfig, build_engine

        # Prompt-logprobs programs only where a test asks for them (the serving default builds them): each engine
        # would compile them again at its own shapes.
        config.setdefault("prompt_logprobs_chunk", 0)
        engine = build_engine(model, EngineConfig(compile_cache=self.compile_cache, **config), compile_now)
        self.engines.append(engine)
        if compile_now:
            self.compiled_ahead.add(id(engine))
        return engine

    def release(self, engine) -> None:
        self.engines.remove(engine)
        self.compiled_ahead.discard(id(engine))


@pytest.fixture(scope="session")
def engines(compile_cache_dir) -> EngineRegistry:
    return EngineRegistry(compile_cache_dir)


def engine_leaks(engine, compiled_ahead: bool) -> list[str]:
    """What an idle engine should not have: held pages or slots, live generations, queued work, and (for an
    engine compiled at build time) any program outside its bucket set."""
    scheduler = engine.scheduler
    problems = []
    if scheduler.page_pool.num_free != scheduler.page_pool.num_total:
        problems.append(f"{scheduler.page_pool.num_total - scheduler.page_pool.num_free} KV pages still held")
    if scheduler.slot_pool.num_free != scheduler.slot_pool.num_total:
        problems.append(f"{scheduler.slot_pool.num_total - scheduler.slot_pool.num_free} GDN slots still held")
    if engine.generations:
        problems.append(f"generations still live: {sorted(engine.generations)}")
    if engine.has_work():
        problems.append("the engine still has work (queued requests, aborts or a step in flight)")
    if compiled_ahead and set(engine.runner.compile_seconds) != set(engine.runner.buckets.keys()):
        extra = set(engine.runner.compile_seconds) - set(engine.runner.buckets.keys())
        problems.append(f"compiled programs outside the bucket set: {sorted(extra)}")
    if compiled_ahead and set(engine.runner.row_compile_seconds) != set(engine.runner.buckets.row_programs()):
        problems.append(f"row programs outside the bucket set: {sorted(engine.runner.row_compile_seconds)}")
    if compiled_ahead and set(engine.runner.prompt_compile_seconds) != set(engine.runner.buckets.prompt_logprobs_chunk):
        problems.append(
            f"prompt-logprobs programs outside the bucket set: {sorted(engine.runner.prompt_compile_seconds)}"
        )
    return problems


def reset_engine(engine) -> None:
    """Abort whatever a failed test left behind, so that the next test starts from an idle engine."""
    for request_id in list(engine.generations):
        engine.abort(request_id)
    for request in list(engine.scheduler.waiting) + list(engine.scheduler.running.values()):
        engine.scheduler.abort(request.request_id)
    engine.run_until_done()


@pytest.fixture(autouse=True)
def check_engines_idle(request):
    """After every test: every engine built so far is idle with all its pages and slots back in the pools."""
    yield
    if "engines" not in request.fixturenames:
        return
    registry: EngineRegistry = request.getfixturevalue("engines")
    problems = []
    for engine in registry.engines:
        leaks = engine_leaks(engine, id(engine) in registry.compiled_ahead)
        problems += [f"engine {id(engine):#x}: {leak}" for leak in leaks]
        if leaks:
            reset_engine(engine)
    assert not problems, "\n".join(problems)
