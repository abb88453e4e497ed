"""Token-mixer kernels for Qwen3.5, each beside its pure-JAX reference of the same signature.

`mixers(name)` returns the set the model calls:
- `ref`: the pure-JAX references (every platform).
- `pallas`: the Pallas (Triton lowering) GPU kernels, with prefill attention's chunk part on tokamax's Mosaic GPU
  flash kernel; `mixers("pallas", interpret=True)` runs them in Pallas interpret mode on any platform, which is
  how the CPU tests check that they slot in.
`Mixers` is a NamedTuple, so a test or a benchmark that wants one kernel from another set builds it with
`_replace` (`mixers("pallas")._replace(linear=REF.linear)`). `pallas` compiles through Triton, so only a GPU can
run it outside interpret mode: `check_selectable` refuses it elsewhere, before any weight loads.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from qwen35_jax.kernels import chunk_attention
from qwen35_jax.kernels.attention_inputs import attention_inputs_pallas, attention_inputs_ref
from qwen35_jax.kernels.chunk_attention import prefill_attention_pallas, prefill_attention_ref
from qwen35_jax.kernels.conv1d import (
    causal_conv1d_prefill_pallas,
    causal_conv1d_prefill_ref,
    causal_conv1d_update_pool_pallas,
    causal_conv1d_update_pool_ref,
)
from qwen35_jax.kernels.decode_attention import paged_decode_attention_pallas, paged_decode_attention_ref
from qwen35_jax.kernels.gdn_decode import gdn_decode_pool_gated_pallas, gdn_decode_pool_gated_ref
from qwen35_jax.kernels.gdn_prefill import gdn_chunked_prefill_packed_pallas, gdn_chunked_prefill_packed_ref
from qwen35_jax.kernels.linear import linear_pallas, linear_parts_pallas, linear_parts_ref, linear_ref
from qwen35_jax.kernels.norm_linear import norm_linear_pallas, norm_linear_ref
from qwen35_jax.kernels.residual_norm import residual_norm_pallas, residual_norm_ref

KERNEL_SETS = ("ref", "pallas")


class Mixers(NamedTuple):
    """The kernels a step calls; the decode-side ones update the GDN slot pools in place."""

    name: str
    gdn_prefill: object  # (qkv, g, beta, state, lengths) -> (out, state): chunked, ragged prefill rows; qkv is the
    # conv's output, q, k and v side by side
    gdn_decode: object  # (qkv, ba, ba_col, A_log, dt_bias, pool, layer, slots) -> (out, pool): one token, state in
    # the pool; qkv is the conv's output, q, k and v side by side; the gates come from the in_proj's b and a columns
    # of ba's first B rows (from column ba_col) and the layer's A_log and dt_bias; keywords z, z_col, norm_weight, eps: the output
    # norm (`gated_rms_norm`) with the gate at columns [z_col, z_col + nv dv) of z, applied to the returned out
    conv_prefill: object  # (x, weight, conv_state, lengths) -> (out, conv_state)
    conv_update: object  # (x, weight, pool, layer, slots) -> (out, pool): one token, conv state in the pool; the
    # first slots.shape[0] rows of x
    decode_attention: object  # (q, k_pages, v_pages, layer, page_table, lengths, gate) -> out * sigmoid(gate): the
    # first lengths.shape[0] rows of q and gate
    prefill_attention: object  # (q, k, v, k_pages, v_pages, layer, page_table, start, lengths): chunk + prefix
    linear: object  # the weight products x @ W^T (decode-sized batches; larger ones go to XLA)
    linear_parts: object  # the same as partial sums [S, ..., N] (`residual_norm` adds them up where it reads them)
    residual_norm: object  # (h, parts, weight, eps) -> (h + the parts' sum, its RMSNorm)
    attention_inputs: object  # (qkv product, q_norm, k_norm, cos, sin, k_pages, v_pages, layer, kv_page, kv_offset,
    # heads, kv_heads, eps) -> (q, k, gate, k_pages, v_pages): q and k normalised and rotated, the output gate, the
    # K/V written to the pages
    norm_linear: object  # (h, parts, norm_weight, weight, eps) -> (h + the parts' sum, its RMSNorm @ weight^T):
    # `residual_norm`, then `linear` of the norm, in one kernel for a decode step of a few rows


REF = Mixers(
    "ref", gdn_chunked_prefill_packed_ref, gdn_decode_pool_gated_ref, causal_conv1d_prefill_ref, causal_conv1d_update_pool_ref,
    paged_decode_attention_ref, prefill_attention_ref, linear_ref, linear_parts_ref, residual_norm_ref,
    attention_inputs_ref, norm_linear_ref,
)  # fmt: skip

_PALLAS = (
    gdn_chunked_prefill_packed_pallas, gdn_decode_pool_gated_pallas, causal_conv1d_prefill_pallas, causal_conv1d_update_pool_pallas,
    paged_decode_attention_pallas, prefill_attention_pallas, linear_pallas, linear_parts_pallas, residual_norm_pallas,
    attention_inputs_pallas, norm_linear_pallas,
)  # fmt: skip
# Each kernel is wrapped in its own jax.jit: a step calls the same kernel at the same shapes in many layers
# (24 GDN and 8 attention layers at 4B), and JAX lowers a nested jit once per program and calls it from each
# site, where a bare pallas_call is lowered to Triton again at every site (0.3-0.6 s against 1.0-4.0 s to lower a
# 4B step). XLA inlines the calls, so the compiled program is the same. Built once: jit keys compiled programs on
# the Mixers value, so these must be the same objects every time.
# Arguments that are Python constants of the model.
_STATIC = {
    residual_norm_pallas: ("eps",),
    norm_linear_pallas: ("eps",),
    gdn_decode_pool_gated_pallas: ("ba_col", "z_col", "eps"),
    attention_inputs_pallas: ("heads", "kv_heads", "eps"),
}
PALLAS = Mixers("pallas", *(jax.jit(f, static_argnames=_STATIC.get(f)) for f in _PALLAS))
PALLAS_INTERPRET = Mixers(
    "pallas-interpret",
    *(jax.jit(functools.partial(f, interpret=True), static_argnames=_STATIC.get(f)) for f in _PALLAS),
)


def mixers(name: str, interpret: bool = False) -> Mixers:
    """The kernel set `name`, "ref" or "pallas" (interpret: the Pallas kernels in interpret mode)."""
    if name == "ref":
        return REF
    if name == "pallas":
        return PALLAS_INTERPRET if interpret else PALLAS
    raise ValueError(f"unknown kernel set {name!r}; choose one of {', '.join(KERNEL_SETS)}")


def check_selectable(name: str, platform: str | None = None) -> None:
    """Raises ValueError naming --kernels unless the set exists and runs on `platform` (default: JAX's)."""
    mixers(name)
    platform = platform or jax.default_backend()
    if name == "pallas" and platform != "gpu":
        raise ValueError(
            f"--kernels pallas needs a GPU (the kernels compile through Triton); JAX runs on {platform}: "
            "use --kernels ref"
        )
    if name == "pallas" and platform == "gpu":
        try:
            chunk_attention.tokamax_attention()
        except ImportError as error:
            raise ValueError(f"--kernels {name}: {error}") from None
