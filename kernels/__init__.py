"""Token-mixer kernels for Qwen3.5, each beside its pure-JAX reference of the same signature.

`mixers(name)` returns the set the model calls. `ref` is the pure-JAX reference set (every platform).
The Pallas GPU set (`pallas`) is the work of a later change; until it exists, asking for it fails loudly
rather than silently falling back.
"""

from __future__ import annotations

from typing import NamedTuple

from qwen35_jax.kernels.conv1d import causal_conv1d_prefill_ref, causal_conv1d_update_ref
from qwen35_jax.kernels.decode_attention import paged_decode_attention_ref
from qwen35_jax.kernels.gdn_decode import gdn_decode_ref
from qwen35_jax.kernels.gdn_prefill import gdn_chunked_prefill_ref
from qwen35_jax.kernels.prefill_attention import paged_prefill_attention_ref

KERNEL_SETS = ("ref", "pallas")


class Mixers(NamedTuple):
    name: str
    gdn_prefill: object
    gdn_decode: object
    conv_prefill: object
    conv_update: object
    decode_attention: object
    prefill_attention: object


REF = Mixers(
    "ref", gdn_chunked_prefill_ref, gdn_decode_ref, causal_conv1d_prefill_ref, causal_conv1d_update_ref,
    paged_decode_attention_ref, paged_prefill_attention_ref,
)  # fmt: skip


def mixers(name: str) -> Mixers:
    if name == "ref":
        return REF
    if name == "pallas":
        raise NotImplementedError("--kernels pallas: the Pallas GPU kernels are not implemented yet; use ref")
    raise ValueError(f"unknown kernel set {name!r}; choose one of {', '.join(KERNEL_SETS)}")
