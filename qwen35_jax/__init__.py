"""qwen35-jax: a serving engine for the Qwen3.5 model family in JAX/XLA.

`qwen35_jax.load_model(path_or_preset, dtype="bfloat16")` is the stable entry point (see api.py). It is
imported lazily so that the host-only parts (the scheduler) import without JAX.
"""

__all__ = ["LoadedModel", "load_model"]


def __getattr__(name: str):
    if name in __all__:
        from qwen35_jax import api

        return getattr(api, name)
    raise AttributeError(f"module 'qwen35_jax' has no attribute {name!r}")
