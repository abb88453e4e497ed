"""qwen35-jax: a serving engine for the Qwen3.5 model family in JAX/XLA."""
