"""Qwen3.5 text decoder in Flax NNX, as pure functions of (params, cache, step inputs).

The modules declare every tensor once, in HF's layout and under HF's names, so the checkpoint key of a
parameter is its module path (see weights.py). The layers run as a `lax.scan` over repeated groups
(3 Gated DeltaNet layers + 1 gated full-attention layer on published models), so compile time does not
grow with depth. One step may carry decode rows and prefill rows together (batch.StepInputs): dense
layers run once over all tokens, the token mixers run per side through the kernel set (`kernels.Mixers`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from qwen35_jax.batch import StepInputs
from qwen35_jax.cache import Cache
from qwen35_jax.config import LINEAR, Qwen35Config
from qwen35_jax.kernels import Mixers
from qwen35_jax.kernels.linear import linear_ref, silu_mul
from qwen35_jax.kernels.residual_norm import add_partials, rms_norm

# Fused weights (`fuse_weights`): each fused projection and the checkpoint's weights it concatenates, rows in
# this order. The checkpoint layout (weights.py) is always the unfused one.
FUSED_MLP = {"gate_up_proj": ("gate_proj", "up_proj")}
FUSED_QKV = {
    "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
}
FUSED = {**FUSED_MLP, **FUSED_QKV}
FUSED_QKV_MAX_ROWS = 256  # the largest decode batch measured faster fused; prefill-sized inputs split (_projections)


def _param(shape, dtype) -> nnx.Param:
    # Values are filled from a checkpoint or by weights.random_params; modules are built abstractly.
    return nnx.Param(jnp.zeros(shape, dtype))


# x [..., in] @ weight[out, in]^T, the HF layout, with fp32 accumulation and x's dtype out (XLA's dot): the
# products' default where no kernel set is given (a step passes its `Mixers.linear`).
matmul = linear_ref


class Residual(NamedTuple):
    """The residual stream between layers: h plus the output of the product that ends a sublayer (o_proj,
    out_proj or down_proj), not yet added. `partials` [S, rows, hidden] fp32 are that product's split-K partial
    sums (`linear(..., partials=True)`; None: nothing pending). The add, its rounding and the next RMSNorm are
    one call of the step's `Mixers.add_norm`: XLA's operations in both kernel sets, or one kernel per norm point
    with `add_norm=triton` (`kernels.residual_norm`, measured slower)."""

    h: jax.Array
    partials: jax.Array | None = None

    def resolved(self) -> jax.Array:
        """h with the pending output added (the model's rounding: the product's output, then the sum)."""
        return add_partials(self.h, self.partials)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, dtype):
        self.weight = _param((out_features, in_features), dtype)

    def __call__(self, x, linear=matmul, partials: bool = False):
        """linear: the product's implementation, `matmul`'s signature (the step's `Mixers.linear`); partials:
        return its fp32 partial sums unadded (`Residual`)."""
        return linear(x, self.weight[...], partials=True) if partials else linear(x, self.weight[...])


class Weight(nnx.Module):
    """A module holding one bare `weight` (HF's conv1d and embed_tokens)."""

    def __init__(self, shape, dtype):
        self.weight = _param(shape, dtype)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = _param((dim,), dtype)
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


def add_norm(ctx, residual: Residual, norm: RMSNorm) -> tuple[jax.Array, jax.Array]:
    """(h, norm(h)) with residual's pending output added first, through the step's `Mixers.add_norm`."""
    return ctx.mixers.add_norm(residual.h, residual.partials, norm.weight[...], norm.eps)


class GatedRMSNorm(nnx.Module):
    """The GDN output norm: w * round(norm(o)) * silu(z), the weight not zero-centred (HF rounding order)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = _param((dim,), dtype)
        self.eps = eps

    def __call__(self, x, gate):
        x32 = x.astype(jnp.float32)
        normed = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        scaled = (self.weight[...] * normed).astype(x.dtype)
        return (scaled.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def _add_projections(module, fused_name: str, widths, in_features: int, dtype, fused: bool) -> None:
    """The input projections `FUSED[fused_name]` of `module` (output widths `widths`, in that order): one Linear
    each, the checkpoint's layout, or with `fused` one `fused_name` Linear of them all (`fuse_weights`)."""
    if fused:
        setattr(module, fused_name, Linear(in_features, sum(widths), dtype))
    else:
        for name, width in zip(FUSED[fused_name], widths, strict=True):
            setattr(module, name, Linear(in_features, width, dtype))


def _projections(module, fused_name: str, widths, x, linear) -> list[jax.Array]:
    """The outputs of `_add_projections`' projections over x: one product with the concatenated weight when the
    module holds `fused_name`, one product each otherwise, in the order of `FUSED[fused_name]`.
    Fused input projections (`FUSED_QKV`) over more than FUSED_QKV_MAX_ROWS rows (prefill chunks) multiply each
    part's rows of the fused weight apart: XLA's GEMM over the fused shapes made an 8192-token 4B prefill 173 ms
    against 154 ms on the H200 (docs/performance.md, session 6), while decode batches up to 256 gain from it."""
    if not hasattr(module, fused_name):
        return [getattr(module, name)(x, linear) for name in FUSED[fused_name]]
    bounds = list(itertools.accumulate(widths))[:-1]
    weight = getattr(module, fused_name).weight[...]
    if fused_name in FUSED_QKV and math.prod(x.shape[:-1]) > FUSED_QKV_MAX_ROWS:
        return [linear(x, part) for part in jnp.split(weight, bounds, axis=0)]
    return jnp.split(linear(x, weight), bounds, axis=-1)


class MLP(nnx.Module):
    """down(silu(gate(x)) * up(x)). fused: gate and up as one [2 x intermediate, hidden] weight (`fuse_weights`), one
    product instead of two; the HF checkpoint's two tensors are what is loaded either way."""

    def __init__(self, cfg: Qwen35Config, dtype, fused: bool = False):
        self.widths = (cfg.intermediate_size, cfg.intermediate_size)
        _add_projections(self, "gate_up_proj", self.widths, cfg.hidden_size, dtype, fused)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, dtype)

    def __call__(self, x, linear=matmul):
        """The down product's fp32 partial sums (`Residual`). Fused, the gate/up product returns silu(gate) * up
        (`kernels.linear`, glu_out); unfused, the model computes it."""
        if hasattr(self, "gate_up_proj"):
            act = linear(x, self.gate_up_proj.weight[...], glu_out=True)
            return linear(act, self.down_proj.weight[...], partials=True)
        gate, up = _projections(self, "gate_up_proj", self.widths, x, linear)
        return self.down_proj(silu_mul(gate, up), linear, partials=True)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every layer of one step needs besides its weights: the sides, RoPE tables, KV destinations."""

    inputs: StepInputs
    mixers: Mixers
    cos: jax.Array  # [N, rotary_dim] model dtype
    sin: jax.Array  # [N, rotary_dim]
    kv_page: jax.Array  # [N] page each token's K/V goes to (padding: trash page 0)
    kv_offset: jax.Array  # [N] offset inside that page

    def split(self, x: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
        """Flat token rows [N, ...] -> (decode [B, ...] or None, prefill [P, T, ...] or None)."""
        num_decode = self.inputs.num_decode
        decode = x[:num_decode] if self.inputs.decode is not None else None
        prefill = None
        if self.inputs.prefill is not None:
            side = self.inputs.prefill
            prefill = x[num_decode:].reshape(side.num_rows, side.chunk, *x.shape[1:])
        return decode, prefill

    def split_rows(self, x: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
        """Per-row arrays [B + P, ...] (one entry per request row) -> (decode rows, prefill rows)."""
        num_decode = self.inputs.num_decode
        decode = x[:num_decode] if self.inputs.decode is not None else None
        prefill = x[num_decode:] if self.inputs.prefill is not None else None
        return decode, prefill

    @staticmethod
    def join(decode: jax.Array | None, prefill: jax.Array | None) -> jax.Array:
        parts = [] if decode is None else [decode]
        if prefill is not None:
            parts.append(prefill.reshape(-1, *prefill.shape[2:]))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GdnState:
    """The GDN states of one step's rows (decode rows, then prefill rows), gathered from the slot pools."""

    ssm: jax.Array  # [..., R, v_heads, dk, dv] fp32
    conv: jax.Array  # [..., R, K-1, conv_dim] model dtype


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: Qwen35Config, dtype, fused: bool = False):
        """fused: the qkv, z, b and a projections as one `in_proj` weight (`fuse_weights`)."""
        self.cfg = cfg
        nv = cfg.linear_num_value_heads
        _add_projections(self, "in_proj", self._widths(), cfg.hidden_size, dtype, fused)
        self.conv1d = Weight((cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), dtype)
        self.dt_bias = _param((nv,), dtype)
        self.A_log = _param((nv,), dtype)
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, dtype)
        self.out_proj = Linear(cfg.gdn_value_dim, cfg.hidden_size, dtype)

    def _widths(self) -> tuple[int, ...]:
        cfg = self.cfg
        return cfg.conv_dim, cfg.gdn_value_dim, cfg.linear_num_value_heads, cfg.linear_num_value_heads

    def _split_qkv(self, mixed):
        cfg = self.cfg
        q, k, v = jnp.split(mixed, [cfg.gdn_key_dim, 2 * cfg.gdn_key_dim], axis=-1)
        lead = mixed.shape[:-1]
        return (q.reshape(*lead, cfg.linear_num_key_heads, cfg.linear_key_head_dim),
                k.reshape(*lead, cfg.linear_num_key_heads, cfg.linear_key_head_dim),
                v.reshape(*lead, cfg.linear_num_value_heads, cfg.linear_value_head_dim))  # fmt: skip

    def _decode(self, ctx, mixed, g, beta, ssm, conv, pools, layer):
        weight = self.conv1d.weight[...][:, 0, :]
        if ssm is None:  # "in_pool": the decode rows' states are updated where they live, in the slot pools
            slots = ctx.inputs.decode.slots
            mixed, conv_pool = ctx.mixers.conv_update_pool(mixed, weight, pools.conv, layer, slots)
            q, k, v = self._split_qkv(mixed)
            out, pool = ctx.mixers.gdn_decode_pool(q, k, v, g, beta, pools.ssm, layer, slots)
            return out, None, None, dataclasses.replace(pools, ssm=pool, conv=conv_pool)
        mixed, conv = ctx.mixers.conv_update(mixed, weight, conv)
        q, k, v = self._split_qkv(mixed)
        out, ssm = ctx.mixers.gdn_decode(q, k, v, g, beta, ssm)
        return out, ssm, conv, pools

    def _prefill(self, ctx, mixed, g, beta, ssm, conv, pools, layer):
        lengths = ctx.inputs.prefill.lengths
        weight = self.conv1d.weight[...][:, 0, :]
        mixed, conv = ctx.mixers.conv_prefill(mixed, weight, conv, lengths)
        q, k, v = self._split_qkv(mixed)
        out, ssm = ctx.mixers.gdn_prefill(q, k, v, g, beta, ssm, lengths)
        return out, ssm, conv, pools

    def __call__(self, x, state: GdnState, ctx: StepContext, pools: KVPages, layer):
        """x [N, hidden]; state: this layer's rows (decode rows first, then prefill rows), except that with
        pools.ssm set ("in_pool") state holds the prefill rows only and the decode rows' recurrent and conv
        states are updated in pools.ssm and pools.conv, GDN layer `layer` of them. Returns (out_proj's partial
        sums, new state, pools)."""
        linear = ctx.mixers.linear
        mixed, z, b, a = _projections(self, "in_proj", self._widths(), x, linear)
        beta = jax.nn.sigmoid(b)
        a = a.astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
        if pools.ssm is None:
            ssm_sides, conv_sides = ctx.split_rows(state.ssm), ctx.split_rows(state.conv)
        else:
            ssm_sides, conv_sides = (None, state.ssm), (None, state.conv)
        sides = (ctx.split(mixed), ctx.split(g), ctx.split(beta), ssm_sides, conv_sides)
        outs, ssms, convs = [], [], []
        for run, (mixed_s, g_s, beta_s, ssm_s, conv_s) in zip(
            (self._decode, self._prefill), zip(*sides, strict=True), strict=True
        ):
            if mixed_s is not None:
                out, ssm_s, conv_s, pools = run(ctx, mixed_s, g_s, beta_s, ssm_s, conv_s, pools, layer)
                outs.append(out.reshape(-1, *out.shape[-2:]))
                ssms.append(ssm_s)
                convs.append(conv_s)
        out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]  # [N, nv, dv]
        out = self.norm(out, z.reshape(out.shape)).reshape(x.shape[0], -1)
        return (
            self.out_proj(out, linear, partials=True),
            GdnState(_rows_or(ssms, state.ssm), _rows_or(convs, state.conv)),
            pools,
        )


def _rows_or(parts: list, empty: jax.Array) -> jax.Array:
    """The sides' new states joined; "in_pool" decode sides return None, and with no prefill rows the state is
    the (empty) input."""
    parts = [x for x in parts if x is not None]
    return jnp.concatenate(parts) if parts else empty


def rotate_half(x):
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
    """Partial RoPE on the first rotary_dim dims, rotate_half pairs (i, i + rotary_dim/2); x [N, heads, D]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot = (x_rot * cos).astype(x.dtype) + (rotate_half(x_rot) * sin).astype(x.dtype)
    return jnp.concatenate([x_rot.astype(x.dtype), x_pass], axis=-1)


def rope_tables(positions, cfg: Qwen35Config, dtype):
    """cos/sin [N, rotary_dim], computed in fp32 and cast to the model dtype (as HF)."""
    rot = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen35Config, dtype, fused: bool = False):
        """fused: the q (with its gate), k and v projections as one `qkv_proj` weight (`fuse_weights`)."""
        self.cfg = cfg
        heads, dim = cfg.num_attention_heads, cfg.head_dim
        _add_projections(self, "qkv_proj", self._widths(), cfg.hidden_size, dtype, fused)
        self.o_proj = Linear(heads * dim, cfg.hidden_size, dtype)
        self.q_norm = RMSNorm(dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(dim, cfg.rms_norm_eps, dtype)

    def _widths(self) -> tuple[int, ...]:
        cfg = self.cfg
        kv_width = cfg.num_key_value_heads * cfg.head_dim
        return cfg.num_attention_heads * cfg.head_dim * 2, kv_width, kv_width

    def _project(self, x, ctx):
        cfg = self.cfg
        n, dim = x.shape[0], cfg.head_dim
        q_gate, k, v = _projections(self, "qkv_proj", self._widths(), x, ctx.mixers.linear)
        # q_proj rows are interleaved per head: [query_h | gate_h] for each head h.
        q_gate = q_gate.reshape(n, cfg.num_attention_heads, 2 * dim)
        query, gate = q_gate[..., :dim], q_gate[..., dim:].reshape(n, -1)
        k = k.reshape(n, cfg.num_key_value_heads, dim)
        v = v.reshape(n, cfg.num_key_value_heads, dim)
        q = apply_rope(self.q_norm(query), ctx.cos, ctx.sin)
        k = apply_rope(self.k_norm(k), ctx.cos, ctx.sin)
        return q, k, v, gate

    def __call__(self, x, cache: KVPages, layer, ctx: StepContext):
        q, k, v, gate = self._project(x, ctx)
        k_pages = cache.k_pages.at[layer, ctx.kv_page, ctx.kv_offset].set(k)
        v_pages = cache.v_pages.at[layer, ctx.kv_page, ctx.kv_offset].set(v)
        q_d, q_p = ctx.split(q)
        out_d = out_p = None
        if q_d is not None:
            side = ctx.inputs.decode
            out_d = ctx.mixers.decode_attention(q_d, k_pages, v_pages, layer, side.page_table, side.positions + 1)
        if q_p is not None:
            side = ctx.inputs.prefill
            (_, k_p), (_, v_p) = ctx.split(k), ctx.split(v)  # the chunk's own keys, as projected (also paged now)
            out_p = ctx.mixers.prefill_attention(
                q_p, k_p, v_p, k_pages, v_pages, layer, side.page_table, side.start, side.lengths
            )
        out = StepContext.join(out_d, out_p).reshape(x.shape[0], -1)
        out = (out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype)).astype(x.dtype)
        return self.o_proj(out, ctx.mixers.linear, partials=True), dataclasses.replace(
            cache, k_pages=k_pages, v_pages=v_pages
        )


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen35Config, kind: str, dtype, fused_mlp: bool = False, fused_qkv: bool = False):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, dtype, fused_qkv)
        else:
            self.self_attn = Attention(cfg, dtype, fused_qkv)
        self.mlp = MLP(cfg, dtype, fused_mlp)

    def __call__(self, residual: Residual, cache, layer, state, ctx, linear_layer=None):
        """residual in and out: the MLP's output is left pending, for the next layer's add and norm. Linear layers
        read and return their GdnState (and, "in_pool", the slot pool in cache.ssm, their index linear_layer of
        it); the attention layer reads and returns the KV pages (its index: layer)."""
        h, x = add_norm(ctx, residual, self.input_layernorm)
        if hasattr(self, "linear_attn"):
            out, state, cache = self.linear_attn(x, state, ctx, cache, linear_layer)
        else:
            out, cache = self.self_attn(x, cache, layer, ctx)
        h, x = add_norm(ctx, Residual(h, out), self.post_attention_layernorm)
        return Residual(h, self.mlp(x, ctx.mixers.linear)), cache, state


class LayerGroup(nnx.Module):
    """One repeat of the layer pattern: linear_per_group GDN layers, then one full-attention layer."""

    def __init__(self, cfg: Qwen35Config, dtype, fused_mlp: bool = False, fused_qkv: bool = False):
        self.cfg = cfg
        kinds = cfg.layer_types[: cfg.group_size]
        self.layers = nnx.List([DecoderLayer(cfg, kind, dtype, fused_mlp, fused_qkv) for kind in kinds])

    def __call__(self, h: Residual, cache, group, states: GdnState, ctx):
        """states: [linear_per_group, R, ...] for this group's GDN layers; returns them updated."""
        new_states = []
        linear_per_group = len(self.layers) - 1
        for j, layer in enumerate(self.layers):
            state = jax.tree.map(lambda x, j=j: x[j], states) if j < linear_per_group else None
            h, cache, state = layer(h, cache, group, state, ctx, group * linear_per_group + j)
            if state is not None:
                new_states.append(state)
        return h, cache, jax.tree.map(lambda *xs: jnp.stack(xs), *new_states)


class Embedding(nnx.Module):
    def __init__(self, cfg: Qwen35Config, dtype):
        self.embed_tokens = Weight((cfg.vocab_size, cfg.hidden_size), dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype)

    def embed(self, tokens):
        return self.embed_tokens.weight[...][tokens]

    def logits(self, h):
        """[R, hidden] -> fp32 logits [R, vocab] (fp32 accumulation; HF rounds them to the model dtype)."""
        head = self.lm_head.weight if hasattr(self, "lm_head") else self.embed_tokens.weight
        return lax.dot_general(self.norm(h), head[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """The pools the layer loop carries: the paged KV pools, and with gdn_state "in_pool" in a step that has
    decode rows, the GDN recurrent-state pool (the decode rows' states are updated in it in place)."""

    k_pages: jax.Array
    v_pages: jax.Array
    ssm: jax.Array | None = None
    conv: jax.Array | None = None  # with ssm: the GDN conv-state pool, updated in place the same way


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of the model: config, dtype and the graph definitions of its two module kinds."""

    cfg: Qwen35Config
    dtype: Any
    top: nnx.GraphDef
    group: nnx.GraphDef
    # "scan": one lax.scan over the layer groups (compile time independent of depth; the default).
    # "unrolled": a Python loop with static group indices into the stacked weights.
    # "unstacked": a Python loop over per-group weight arrays (`unstack_groups`), so no layer reads its
    # weights through a slice. On the GPU the scan copies one group's weights per iteration (measured,
    # docs/performance.md), so the engine runs "unstacked" there (EngineConfig.layer_loop "auto").
    layer_loop: str = "scan"
    # "gather": the step's GDN states are gathered out of the slot pool, carried, and scattered back.
    # "in_pool": decode rows' recurrent and conv states are updated in their pools by the kernels (one read and
    # write of each instead of three); prefill rows' states are still gathered. "in_pool" is the engine's
    # default (EngineConfig.gdn_state; batch-256 decode 33 against 55 ms on the H200, docs/performance.md).
    gdn_state: str = "gather"
    # The MLP's gate and up projections as one weight (`fuse_weights`; the group graph definition has it too).
    fused_mlp: bool = False
    # The GDN layers' qkv, z, b, a projections as one weight, and the attention layers' q, k, v (`fuse_weights`).
    fused_qkv: bool = False

    def _key(self):
        return self.cfg, str(self.dtype), self.layer_loop, self.gdn_state, self.fused_mlp, self.fused_qkv

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, ModelDef) and self._key() == other._key()


def abstract_model(cfg: Qwen35Config, dtype, fused_mlp: bool = False, fused_qkv: bool = False
                   ) -> tuple[ModelDef, dict[str, nnx.State]]:  # fmt: skip
    """Graph definitions and abstract parameter state; group params are stacked on a leading [groups] axis.
    The checkpoint layout (weights.py) is the unfused one; `fuse_weights` converts loaded params."""
    top_def, top_state = nnx.split(nnx.eval_shape(lambda: Embedding(cfg, dtype)))
    group_def, group_state = nnx.split(nnx.eval_shape(lambda: LayerGroup(cfg, dtype, fused_mlp, fused_qkv)))
    stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((cfg.num_groups, *s.shape), s.dtype), group_state)
    model_def = ModelDef(cfg, jnp.dtype(dtype), top_def, group_def, fused_mlp=fused_mlp, fused_qkv=fused_qkv)
    return model_def, {"top": top_state, "groups": stacked}


def fuse_weights(model_def: ModelDef, params, mlp: bool = False, qkv: bool = False, delete_unfused: bool = False
                 ) -> tuple[ModelDef, dict]:  # fmt: skip
    """(model_def, params) with the MLP's gate and up weights (mlp) and/or the layers' input projections (qkv)
    concatenated into one weight each (`FUSED_MLP`, `FUSED_QKV`: [groups, sum of outs, hidden], rows in the
    listed order), for the stacked group params (before `unstack_groups`). Parts fused already stay fused. With
    delete_unfused each source is freed once concatenated, so the peak is the weights plus one fused weight.
    The layer loop and GDN state mode carry over."""
    if isinstance(params["groups"], tuple):
        raise ValueError("fuse_weights needs the stacked group params: fuse before unstack_groups")
    mlp, qkv = mlp or model_def.fused_mlp, qkv or model_def.fused_qkv
    fused_def, abstract = abstract_model(model_def.cfg, model_def.dtype, fused_mlp=mlp, fused_qkv=qkv)
    fused_def = dataclasses.replace(fused_def, layer_loop=model_def.layer_loop, gdn_state=model_def.gdn_state)
    by_path = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params["groups"])}

    def fill(path, _):
        key = jax.tree_util.keystr(path)
        if key in by_path:  # unfused, or fused already
            return by_path[key]
        fused_name = next(name for name in FUSED if f"'{name}'" in key)
        sources = [by_path[key.replace(f"'{fused_name}'", f"'{name}'")] for name in FUSED[fused_name]]
        fused = jnp.concatenate(sources, axis=1)
        if delete_unfused:
            jax.block_until_ready(fused)
            for source in sources:
                source.delete()
        return fused

    return fused_def, {**params, "groups": jax.tree_util.tree_map_with_path(fill, abstract["groups"])}


def _kv_destinations(inputs: StepInputs, page_size: int) -> tuple[jax.Array, jax.Array]:
    pages, offsets = [], []
    if inputs.decode is not None:
        side = inputs.decode
        idx = jnp.minimum(side.positions // page_size, side.page_table.shape[1] - 1)
        pages.append(jnp.take_along_axis(side.page_table, idx[:, None], axis=1)[:, 0])
        offsets.append(side.positions % page_size)
    if inputs.prefill is not None:
        side = inputs.prefill
        pos = side.positions
        idx = jnp.minimum(pos // page_size, side.page_table.shape[1] - 1)
        page = jnp.take_along_axis(side.page_table, idx, axis=1)
        pages.append(jnp.where(side.valid, page, 0).reshape(-1))
        offsets.append((pos % page_size).reshape(-1))
    return jnp.concatenate(pages), jnp.concatenate(offsets)


def _flat(inputs: StepInputs, name: str) -> jax.Array:
    parts = []
    if inputs.decode is not None:
        parts.append(getattr(inputs.decode, name))
    if inputs.prefill is not None:
        parts.append(getattr(inputs.prefill, name).reshape(-1))
    return jnp.concatenate(parts)


def _logit_rows(inputs: StepInputs, all_prefill: bool) -> jax.Array:
    """Rows of the flat token axis whose logits are wanted: every decode row, and each prefill row's
    last valid token (or every prefill token when all_prefill)."""
    num_decode = inputs.num_decode
    rows = [jnp.arange(num_decode)]
    if inputs.prefill is not None:
        side = inputs.prefill
        if all_prefill:
            rows.append(num_decode + jnp.arange(side.num_rows * side.chunk))
        else:
            rows.append(num_decode + jnp.arange(side.num_rows) * side.chunk + side.last_index)
    return jnp.concatenate(rows)


def forward(
    model: ModelDef, params, cache: Cache, inputs: StepInputs, mixers: Mixers, all_prefill_logits=False
) -> tuple[jax.Array, Cache]:
    """One step. Returns fp32 logits [B + P, vocab] (decode rows first, then each prefill row's last
    token; or [B + P*T, vocab] with all_prefill_logits) and the updated cache."""
    top = nnx.merge(model.top, params["top"])
    positions = _flat(inputs, "positions")
    cos, sin = rope_tables(positions, model.cfg, model.dtype)
    kv_page, kv_offset = _kv_destinations(inputs, cache.page_size)
    ctx = StepContext(inputs, mixers, cos, sin, kv_page, kv_offset)
    h = Residual(top.embed(_flat(inputs, "tokens")))
    cfg = model.cfg
    in_pool = model.gdn_state == "in_pool" and inputs.decode is not None
    slots, states = _gather_states(cache, inputs, cfg, decode_rows=not in_pool)
    kv = KVPages(cache.k_pages, cache.v_pages, *((cache.ssm, cache.conv) if in_pool else ()))

    def body(carry, xs):
        h, kv = carry
        group_params, group_index, group_states = xs
        h, kv, group_states = nnx.merge(model.group, group_params)(h, kv, group_index, group_states, ctx)
        if model.layer_loop == "scan":  # a scan's carry keeps one structure: nothing pending between groups
            h = Residual(h.resolved())
        return (h, kv), group_states

    xs = (params["groups"], jnp.arange(cfg.num_groups, dtype=jnp.int32), states)
    (h, kv), states = _layer_loop(model.layer_loop, body, (h, kv), xs, cfg.num_groups)
    if in_pool:
        ssm_pool, conv_pool, state_slots = kv.ssm, kv.conv, _prefill_slots(inputs)
    else:
        ssm_pool, conv_pool, state_slots = cache.ssm, cache.conv, slots
    if state_slots is not None:  # the rows not updated in place go back to their pools
        ssm_pool, conv_pool = (
            pool.at[:, state_slots].set(rows.reshape(cfg.num_linear_layers, *rows.shape[2:]))
            for pool, rows in ((ssm_pool, states.ssm), (conv_pool, states.conv))
        )
    cache = Cache(k_pages=kv.k_pages, v_pages=kv.v_pages, ssm=ssm_pool, conv=conv_pool)
    return top.logits(h.resolved()[_logit_rows(inputs, all_prefill_logits)]), cache


def _layer_loop(kind: str, body, carry, xs, length: int):
    """xs = (group params, group indices, states), each stacked on a leading [groups] axis, except the params
    of "unstacked", which are a tuple of per-group trees (`unstack_groups`)."""
    if kind == "scan":
        return lax.scan(body, carry, xs)
    assert kind in ("unrolled", "unstacked"), kind
    group_params, *rest = xs
    if kind == "unstacked" and not isinstance(group_params, tuple):
        raise TypeError('layer_loop "unstacked" needs params from unstack_groups(params)')
    outs = []
    for index in range(length):
        params = group_params[index] if kind == "unstacked" else _at(group_params, index)
        carry, out = body(carry, (params, *_at(tuple(rest), index)))
        outs.append(out)
    return carry, jax.tree.map(lambda *ys: jnp.stack(ys), *outs)


def _at(tree, index: int):
    """Entry `index` of every array of a tree stacked on its leading axis (a static slice)."""
    return jax.tree.map(lambda x: x[index], tree)


def unstack_groups(params, delete_stacked: bool = False) -> dict:
    """params with "groups" as a tuple of per-group trees (one array per tensor and group), for the
    "unstacked" layer loop. Materialises new arrays; with delete_stacked each stacked array is freed as
    soon as it is split, so the peak is the weights plus one stacked tensor, not twice the weights (the
    caller must hold no other use of them)."""
    groups = params["groups"]
    leaves, treedef = jax.tree.flatten(groups)
    count = leaves[0].shape[0]
    split = []
    for leaf in leaves:
        split.append([leaf[i] for i in range(count)])
        if delete_stacked:
            jax.block_until_ready(split[-1])
            leaf.delete()
    per_group = tuple(jax.tree.unflatten(treedef, [parts[i] for parts in split]) for i in range(count))
    return {**params, "groups": per_group}


def _prefill_slots(inputs: StepInputs) -> jax.Array | None:
    return None if inputs.prefill is None else inputs.prefill.slots


def _gather_states(cache: Cache, inputs: StepInputs, cfg: Qwen35Config, decode_rows: bool = True):
    """(slots, GdnState): the step's rows of the GDN slot pools, [groups, linear_per_group, R, ...], read once
    per step (the loop carries only these rows, never the whole pools); a row that starts a new sequence
    reads zeros. Without decode_rows the states hold the prefill rows only (gdn_state "in_pool")."""
    slots, fresh = [], []
    if inputs.decode is not None:
        slots.append(inputs.decode.slots)
        fresh.append(jnp.zeros(inputs.num_decode, bool))
    if inputs.prefill is not None:
        slots.append(inputs.prefill.slots)
        fresh.append(inputs.prefill.fresh)
    slots, fresh = jnp.concatenate(slots), jnp.concatenate(fresh)
    skip = 0 if decode_rows else inputs.num_decode

    def rows(pool, skip=0):
        x = pool[:, slots[skip:]]
        x = jnp.where(fresh[skip:].reshape(1, -1, *([1] * (x.ndim - 2))), jnp.zeros((), x.dtype), x)
        return x.reshape(cfg.num_groups, cfg.linear_per_group, *x.shape[1:])

    return slots, GdnState(rows(cache.ssm, skip), rows(cache.conv, skip))
