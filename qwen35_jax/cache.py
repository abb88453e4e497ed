"""Device caches: a paged KV pool for the full-attention layers and per-slot GDN states for the linear layers.

Page 0 and the last slot are trash: padding rows of a bucket write there, so real pages and slots never
see padding. The host-side pools (serving/pools.py) never hand them out.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qwen35_jax.config import Qwen35Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    k_pages: jax.Array  # [full_layers, num_pages, page_size, kv_heads, head_dim] model dtype
    v_pages: jax.Array  # [full_layers, num_pages, page_size, kv_heads, head_dim] model dtype
    ssm: jax.Array  # [linear_layers, num_slots, v_heads, dk, dv] recurrent state, CacheSpec.ssm_dtype (fp32 default)
    conv: jax.Array  # [linear_layers, num_slots, K-1, conv_dim] model dtype, oldest input first

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]

    @property
    def num_slots(self) -> int:
        return self.ssm.shape[1]


# The recurrent state's storage types (`--mamba-ssm-cache-dtype`). The kernels compute in fp32 whatever the
# storage. A decode step reads and writes every row's state once: at 4B, 24 layers x 32 heads x 128 x 128 fp32 is
# 50 MB a row, so 100 MB of traffic a row a step against 8.4 GB of weights shared by all rows (batch 64: 6.4 GB;
# batch 256: 25.8 GB). bf16 halves it, and the slot pool with it, at the cost of rounding the state once a step.
SSM_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    num_pages: int
    page_size: int
    num_slots: int
    ssm_dtype: str = "float32"  # one of SSM_DTYPES

    def __post_init__(self):
        if self.ssm_dtype not in SSM_DTYPES:
            raise ValueError(f"the GDN state is stored as one of {SSM_DTYPES}, got {self.ssm_dtype!r}")

    def shapes(self, cfg: Qwen35Config, dtype) -> dict[str, jax.ShapeDtypeStruct]:
        kv = (cfg.num_full_layers, self.num_pages, self.page_size, cfg.num_key_value_heads, cfg.head_dim)
        ssm = (cfg.num_linear_layers, self.num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
               cfg.linear_value_head_dim)  # fmt: skip
        conv = (cfg.num_linear_layers, self.num_slots, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
        return {
            "k_pages": jax.ShapeDtypeStruct(kv, dtype),
            "v_pages": jax.ShapeDtypeStruct(kv, dtype),
            "ssm": jax.ShapeDtypeStruct(ssm, jnp.dtype(self.ssm_dtype)),
            "conv": jax.ShapeDtypeStruct(conv, dtype),
        }

    def nbytes(self, cfg: Qwen35Config, dtype) -> int:
        return sum(s.size * s.dtype.itemsize for s in self.shapes(cfg, dtype).values())


def bytes_per_page(cfg: Qwen35Config, page_size: int, dtype) -> int:
    return CacheSpec(1, page_size, 0).nbytes(cfg, dtype)


def bytes_per_slot(cfg: Qwen35Config, dtype, ssm_dtype: str = "float32") -> int:
    return CacheSpec(0, 1, 1, ssm_dtype).nbytes(cfg, dtype)


def new_cache(cfg: Qwen35Config, spec: CacheSpec, dtype) -> Cache:
    return Cache(**{name: jnp.zeros(s.shape, s.dtype) for name, s in spec.shapes(cfg, dtype).items()})
