"""Token-mixer kernels for Qwen3.5, each beside its pure-JAX reference of the same signature.

`mixers(name)` returns the set the model calls:
- `ref`: the pure-JAX references (every platform).
- `pallas`: the Pallas (Triton lowering) GPU kernels; `mixers("pallas", interpret=True)` runs them in
  Pallas interpret mode on any platform, which is how the CPU tests check that they slot in.
A set may take single kernels from another, for A/B runs and for finding the kernel that moves a result:
`pallas+linear=ref` is the Pallas set with XLA's weight products. A few kernels also have a named alternative
(`ALTERNATIVES`): `pallas+prefill_attention=triton` is the one-kernel Triton prefill attention in place of the
chunk part on tokamax's Mosaic GPU kernel plus the prefix pass (`kernels/chunk_attention.py`), and
`pallas+add_norm=triton` the residual add and RMSNorm as one kernel (`kernels/residual_norm.py`) in place of XLA's.
`pallas` compiles through Triton, so only a GPU can run it outside interpret mode: the command-line flags
refuse it elsewhere (`check_selectable`), before any weight loads. Its GPU tests pass on the H200 at 4B
shapes (docs/kernels.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax

from qwen35_jax.kernels import chunk_attention
from qwen35_jax.kernels.chunk_attention import (
    paged_prefill_attention_triton,
    prefill_attention_pallas,
    prefill_attention_ref,
)
from qwen35_jax.kernels.conv1d import (
    causal_conv1d_prefill_pallas,
    causal_conv1d_prefill_ref,
    causal_conv1d_update_pallas,
    causal_conv1d_update_pool_pallas,
    causal_conv1d_update_pool_ref,
    causal_conv1d_update_ref,
)
from qwen35_jax.kernels.decode_attention import paged_decode_attention_pallas, paged_decode_attention_ref
from qwen35_jax.kernels.gdn_decode import (
    gdn_decode_pallas,
    gdn_decode_pool_pallas,
    gdn_decode_pool_ref,
    gdn_decode_ref,
)
from qwen35_jax.kernels.gdn_prefill import gdn_chunked_prefill_pallas, gdn_chunked_prefill_ref
from qwen35_jax.kernels.linear import linear_pallas, linear_ref
from qwen35_jax.kernels.residual_norm import add_rms_norm_pallas, add_rms_norm_ref

KERNEL_SETS = ("ref", "pallas")


class Mixers(NamedTuple):
    name: str
    gdn_prefill: object
    gdn_decode: object
    conv_prefill: object
    conv_update: object
    decode_attention: object
    prefill_attention: object  # (q, k, v, k_pages, v_pages, layer, page_table, start, lengths): chunk + prefix
    gdn_decode_pool: object  # the GDN decode updating the slot pool in place (ModelDef.gdn_state "in_pool")
    linear: object  # the weight products x @ W^T of the layers (decode-sized batches; larger ones go to XLA)
    conv_update_pool: object  # the conv update of decode rows in the slot pool, in place (gdn_state "in_pool")
    add_norm: object  # (h, partials, weight, eps) -> (h + the product's output, its RMSNorm): the norm points


REF = Mixers(
    "ref", gdn_chunked_prefill_ref, gdn_decode_ref, causal_conv1d_prefill_ref, causal_conv1d_update_ref,
    paged_decode_attention_ref, prefill_attention_ref, gdn_decode_pool_ref, linear_ref,
    causal_conv1d_update_pool_ref, add_rms_norm_ref,
)  # fmt: skip

_PALLAS = (
    gdn_chunked_prefill_pallas, gdn_decode_pallas, causal_conv1d_prefill_pallas, causal_conv1d_update_pallas,
    paged_decode_attention_pallas, prefill_attention_pallas, gdn_decode_pool_pallas, linear_pallas,
    causal_conv1d_update_pool_pallas,
)  # fmt: skip
# Each kernel is wrapped in its own jax.jit: a step calls the same kernel at the same shapes in many layers
# (24 GDN and 8 attention layers at 4B), and JAX lowers a nested jit once per program and calls it from each
# site, where a bare pallas_call is lowered to Triton again at every site. Lowering a 4B unstacked step
# program for the H200 takes 0.3-0.6 s so, against 1.0-4.0 s with 56 separate Triton lowerings (this
# CPU); XLA inlines the calls, so the compiled program is the same. Built once: jit keys compiled programs on
# the Mixers value, so these must be the same objects every time.
# The products' switches (`kernels.linear`) are Python values the kernel is built from.
_STATIC = {linear_pallas: ("partials", "glu_out")}
# The last field, the add and norm, is XLA's (REF's) in the `pallas` set too: the one-kernel form measured slower
# on the H200 (session 9, `kernels.residual_norm`), and is the named alternative `add_norm=triton`.
PALLAS = Mixers("pallas", *(jax.jit(f, static_argnames=_STATIC.get(f)) for f in _PALLAS), REF.add_norm)
PALLAS_INTERPRET = Mixers(
    "pallas-interpret",
    *(jax.jit(functools.partial(f, interpret=True), static_argnames=_STATIC.get(f)) for f in _PALLAS),
    REF.add_norm,
)
# Named alternatives of single kernels, {field: {name: (kernel, its interpret-mode form)}}, for swaps.
ALTERNATIVES = {
    "add_norm": {
        "triton": (
            jax.jit(add_rms_norm_pallas, static_argnames=("eps",)),
            jax.jit(functools.partial(add_rms_norm_pallas, interpret=True), static_argnames=("eps",)),
        )
    },
    "prefill_attention": {
        "triton": (
            jax.jit(paged_prefill_attention_triton),
            jax.jit(functools.partial(paged_prefill_attention_triton, interpret=True)),
        )
    },
}

_ALTERNATIVE_NAMES = {field: sorted(names) for field, names in ALTERNATIVES.items()}


def _swap_source(field: str, source: str, interpret: bool):
    if source in KERNEL_SETS:
        return getattr(mixers(source, interpret), field)
    return ALTERNATIVES[field][source][interpret]


def mixers(name: str, interpret: bool = False) -> Mixers:
    """The kernel set `name`: "ref", "pallas", or one of them with single kernels swapped ("pallas+linear=ref")."""
    base, *swaps = name.split("+")
    if base == "ref":
        mix = REF
    elif base == "pallas":
        mix = PALLAS_INTERPRET if interpret else PALLAS
    else:
        raise ValueError(f"unknown kernel set {name!r}; choose one of {', '.join(KERNEL_SETS)}")
    for swap in swaps:
        field, _, source = swap.partition("=")
        if field not in Mixers._fields[1:] or source not in KERNEL_SETS + tuple(ALTERNATIVES.get(field, ())):
            raise ValueError(f"kernel set {name!r}: a swap is KERNEL=SET, KERNEL one of {Mixers._fields[1:]}, "
                             f"SET one of {KERNEL_SETS} or a named alternative {_ALTERNATIVE_NAMES}; got {swap!r}")  # fmt: skip
        mix = mix._replace(**{field: _swap_source(field, source, interpret)})
    return mix._replace(name=name) if swaps else mix


def check_selectable(name: str, platform: str | None = None) -> None:
    """Raises ValueError naming --kernels unless the set exists and runs on `platform` (default: JAX's)."""
    mix = mixers(name)
    platform = platform or jax.default_backend()
    if "pallas" in name and platform != "gpu":
        raise ValueError(
            f"--kernels pallas needs a GPU (the kernels compile through Triton); JAX runs on {platform}: "
            "use --kernels ref"
        )
    if platform == "gpu" and mix.prefill_attention is PALLAS.prefill_attention:
        try:
            chunk_attention.tokamax_attention()
        except ImportError as error:
            raise ValueError(f"--kernels {name}: {error}") from None
