"""Compiled programs kept on disk beside XLA's compilation cache, so that a warm start skips tracing and lowering.

JAX's persistent cache is keyed by the lowered program, so even a warm start traces and lowers every program to find
its entry (0.2-0.7 s of lowering a program for the tiny model on a 2-core CPU). With this store a warm 4B server on
the H200 was ready in 13.6 s, its 60 programs loaded in 5.6 s. The store is keyed by what decides
the programs before any tracing: the engine's sources, the JAX build and device, the XLA flags, the model's config,
dtype and parameter shapes, the kernel set, the cache shapes and the program's own key (`Runner.program_identity`).
A program found here is deserialised (`jax.experimental.serialize_executable`); any other is compiled and saved,
unless XLA's cache served it: XLA:CPU cannot serialise a program it loaded (the copy lacks its compiled functions
and fails when run), so only programs that XLA compiled in this process are stored (`compile_noting_cache`). The
programs XLA's cache serves are lowered on every start, as without the store, until XLA compiles them anew.

`build_engine` uses it on a GPU only (`EngineConfig.program_store`): on a CPU, XLA:CPU programs saved by one
process crashed when another process ran them (docs/performance.md, "tried").

A stored program is trusted as this process's own: the store lives in the user's cache directory, like XLA's. The
newest `KEEP_FINGERPRINTS` identities are kept; older ones (other code versions) are removed as a new one is made.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import pickle
import shutil
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib
from jax.experimental.serialize_executable import deserialize_and_load, serialize

log = logging.getLogger(__name__)

KEEP_FINGERPRINTS = 4
_PACKAGES = ("qwen35_jax", "qwen35_jax.kernels", "qwen35_jax.serving")
# Recorded by JAX in the compiling thread: a compile that asks the persistent cache, and one that the cache served.
CACHE_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_compiling = threading.local()


def _note_event(event: str, **kwargs) -> None:
    if event in (CACHE_REQUEST_EVENT, CACHE_HIT_EVENT):
        _compiling.events = getattr(_compiling, "events", set()) | {event}


jax.monitoring.register_event_listener(_note_event)


def compile_noting_cache(lowered, options: dict | None = None):
    """(lowered.compile(options), whether XLA compiled it here). False when JAX's persistent cache served it, and
    when JAX's in-memory cache of compiled modules returned an executable without asking the persistent cache
    (it may be one the cache served earlier)."""
    _compiling.events = set()
    executable = lowered.compile(options) if options else lowered.compile()
    events = _compiling.events
    return executable, CACHE_REQUEST_EVENT in events and CACHE_HIT_EVENT not in events


def source_digest() -> str:
    """A digest of every Python source of the engine's packages: any code change makes a new store."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        spec = importlib.util.find_spec(package)
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.glob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _cpu_flags() -> str:
    # XLA:CPU code is built for the host's instruction set, which the device kind does not name.
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def platform_identity() -> str:
    """JAX's build, the device, its instruction set on a CPU, and the XLA flags."""
    device = jax.devices()[0]
    parts = [jax.__version__, jaxlib.__version__, device.platform, device.device_kind, device.client.platform_version,
             os.environ.get("XLA_FLAGS", "")]  # fmt: skip
    if device.platform == "cpu":
        parts.append(_cpu_flags())
    return "\n".join(parts)


class ProgramStore:
    """Serialised compiled programs of one engine identity, one file per program name."""

    def __init__(self, root: str | Path, identity: str):
        fingerprint = hashlib.sha256("\n".join((source_digest(), platform_identity(), identity)).encode()).hexdigest()
        self.root = Path(root)
        self.path = self.root / fingerprint[:24]
        self.loaded = 0
        self.saved = 0

    def _file(self, name: str) -> Path:
        return self.path / f"{name}.bin"

    def has(self, name: str) -> bool:
        return self._file(name).exists()

    def load(self, name: str):
        """The compiled program `name`, or None if it is not stored or cannot be loaded here."""
        path = self._file(name)
        if not path.exists():
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
            executable = deserialize_and_load(serialized, in_tree, out_tree)
        except Exception as error:  # a truncated or foreign file: compile instead, and overwrite it
            log.warning("program store: cannot load %s (%s); compiling it", path, error)
            return None
        self.loaded += 1
        return executable

    def save(self, name: str, executable) -> None:
        """Writes the program atomically (a reader never sees half a file); a program XLA cannot serialise is
        skipped with a log line (on a CPU, those with a sort: XLA's `LessThan` comparator is not serialisable)."""
        try:
            blob = pickle.dumps(serialize(executable))
        except Exception as error:
            log.info("program store: cannot serialise %s (%s)", name, error)
            return
        if not self.path.exists():
            self.path.mkdir(parents=True, exist_ok=True)
            self._prune()
        with tempfile.NamedTemporaryFile(dir=self.path, suffix=".tmp", delete=False) as f:
            f.write(blob)
        os.replace(f.name, self._file(name))
        self.saved += 1

    def _prune(self) -> None:
        others = [p for p in self.root.iterdir() if p.is_dir() and p != self.path]
        others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for stale in others[KEEP_FINGERPRINTS - 1 :]:
            shutil.rmtree(stale, ignore_errors=True)
