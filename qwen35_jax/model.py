"""Qwen3.5 text decoder in Flax NNX, as pure functions of (params, cache, step inputs).

The modules declare every tensor once, under HF's names, so the checkpoint key of a parameter is its module path
(see weights.py). Each layer's input projections are one fused weight (`fused_parts`: the GDN layer's qkv, z, b and a;
the attention layer's q, k and v; the MLP's gate and up), built at load from the checkpoint's separate tensors: one
product per projection group reads each weight once. One step may carry decode rows and prefill rows together
(batch.StepInputs): dense layers run once over all tokens, the token mixers run per side through the kernel set
(`kernels.Mixers`).

The layer loop follows the layout of the group params: stacked on a leading [groups] axis, the groups run as one
`lax.scan`, so compile time does not grow with depth (the CPU's layout); as a tuple of per-group trees
(`unstack_groups`), as a Python loop, so no layer reads its weights through a slice (the GPU's layout: there the
scan copies each group's weights per iteration, docs/performance.md). `layout_for_platform` picks it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from qwen35_jax.batch import StepInputs
from qwen35_jax.cache import Cache
from qwen35_jax.config import LINEAR, Qwen35Config
from qwen35_jax.kernels import Mixers
from qwen35_jax.kernels.attention_inputs import split_qkv
from qwen35_jax.kernels.decode_attention import output_gate
from qwen35_jax.kernels.gdn_decode import gate_columns, gated_rms_norm, gdn_gates
from qwen35_jax.kernels.linear import linear_parts_ref, linear_ref
from qwen35_jax.kernels.norm_linear import FUSED_MAX_ROWS as NORM_LINEAR_MAX_ROWS
from qwen35_jax.kernels.residual_norm import residual_delta, rms_norm

# The GDN in_proj over more rows than this (prefill chunks) is two products, conv input and z in one and b and a in
# the other (`GatedDeltaNet._in_projections`): XLA's GEMM over the fused [12352, 2560] shape made an 8192-token 4B
# prefill 173 ms against 154 ms with the parts apart on the H200, while decode batches up to 256 gain from one product.
FUSED_IN_PROJ_MAX_ROWS = 256
assert NORM_LINEAR_MAX_ROWS <= FUSED_IN_PROJ_MAX_ROWS  # in_proj is one product there, which `norm_linear` makes


def fused_parts(cfg: Qwen35Config) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each fused projection's checkpoint tensors and their output widths, in the order of its rows."""
    nv, kv_width = cfg.linear_num_value_heads, cfg.num_key_value_heads * cfg.head_dim
    return {
        "in_proj": (("in_proj_qkv", cfg.conv_dim), ("in_proj_z", cfg.gdn_value_dim), ("in_proj_b", nv),
                    ("in_proj_a", nv)),
        "qkv_proj": (("q_proj", cfg.num_attention_heads * cfg.head_dim * 2), ("k_proj", kv_width),
                     ("v_proj", kv_width)),
        "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)),
    }  # fmt: skip


def _param(shape, dtype) -> nnx.Param:
    # Values are filled from a checkpoint or by weights.random_params; modules are built abstractly.
    return nnx.Param(jnp.zeros(shape, dtype))


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The MLP's activation: silu(gate) rounded to the model dtype, times up (the exact product of two bf16
    values fits fp32, so this rounds once, as a bf16 multiply does)."""
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype)
    return (act.astype(jnp.float32) * up.astype(jnp.float32)).astype(up.dtype)


class Linear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, dtype):
        self.weight = _param((out_features, in_features), dtype)

    def __call__(self, x, linear=linear_ref):
        """linear: the product's implementation, `linear_ref`'s signature (the step's `Mixers.linear`)."""
        return linear(x, self.weight[...])

    def parts(self, x, linear_parts=linear_parts_ref):
        """The product as partial sums [S, ..., out] (the step's `Mixers.linear_parts`), for `Mixers.residual_norm`."""
        return linear_parts(x, self.weight[...])


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

    def after_residual(self, h, parts, mixers: Mixers):
        """(h + the product `parts`' sum, the norm of that): the residual add and this norm in one kernel."""
        return mixers.residual_norm(h, parts, self.weight[...], eps=self.eps)

    def into_product(self, h, parts, linear: Linear, mixers: Mixers):
        """(h + the product `parts`' sum, `linear` of the norm of that): the residual add, this norm and the product
        that reads it (`Mixers.norm_linear`: one kernel at a few rows)."""
        return mixers.norm_linear(h, parts, self.weight[...], linear.weight[...], eps=self.eps)


class GatedRMSNorm(nnx.Module):
    """The GDN output norm: w * round(norm(o)) * silu(z), the weight not zero-centred (HF rounding order;
    `gated_rms_norm`). The decode rows' norm runs inside the GDN decode kernel where its tiling allows."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = _param((dim,), dtype)
        self.eps = eps

    def __call__(self, x, gate):
        return gated_rms_norm(x, self.weight[...], gate, self.eps)


def _fused_linear(cfg: Qwen35Config, name: str, in_features: int, dtype) -> Linear:
    return Linear(in_features, sum(width for _, width in fused_parts(cfg)[name]), dtype)


def _part_bounds(cfg: Qwen35Config, name: str) -> list[int]:
    return list(itertools.accumulate(width for _, width in fused_parts(cfg)[name]))[:-1]


def _projections(cfg: Qwen35Config, name: str, module: Linear, x, linear) -> list[jax.Array]:
    """The outputs of fused projection `name` over x, one per checkpoint part: its one product, split."""
    return jnp.split(module(x, linear), _part_bounds(cfg, name), axis=-1)


class MLP(nnx.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one [2 x intermediate, hidden] weight; down's output as partial
    sums (`Linear.parts`), which the next norm adds to the residual."""

    def __init__(self, cfg: Qwen35Config, dtype):
        self.cfg = cfg
        self.gate_up_proj = _fused_linear(cfg, "gate_up_proj", cfg.hidden_size, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, dtype)

    def __call__(self, x, linear=linear_ref, linear_parts=linear_parts_ref, product=None):
        """product: gate_up_proj's output over the fused weight, when the caller made it (x is then unused)."""
        if product is None:
            gate, up = _projections(self.cfg, "gate_up_proj", self.gate_up_proj, x, linear)
        else:
            gate, up = jnp.split(product, _part_bounds(self.cfg, "gate_up_proj"), axis=-1)
        return self.down_proj.parts(silu_mul(gate, up), linear_parts)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every layer of one step needs besides its weights: the sides, RoPE tables, KV destinations."""

    inputs: StepInputs
    mixers: Mixers
    cos: jax.Array  # [N, rotary_dim] model dtype
    sin: jax.Array  # [N, rotary_dim]
    kv_page: jax.Array  # [N] page each token's K/V goes to (padding: trash page 0)
    kv_offset: jax.Array  # [N] offset inside that page
    decode_lengths: jax.Array | None = None  # [B] tokens each decode row attends to, its own included

    def split(self, x: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
        """Flat token rows [N, ...] -> (decode [B, ...] or None, prefill [P, T, ...] or None)."""
        num_decode = self.inputs.num_decode
        decode = x[:num_decode] if self.inputs.decode is not None else None
        prefill = None
        if self.inputs.prefill is not None:
            side = self.inputs.prefill
            prefill = x[num_decode:].reshape(side.num_rows, side.chunk, *x.shape[1:])
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
    """The GDN states of one step's prefill rows, gathered from the slot pools (the decode rows' states are
    updated in the pools in place and never leave them)."""

    ssm: jax.Array  # [..., P, v_heads, dk, dv] fp32
    conv: jax.Array  # [..., P, K-1, conv_dim] model dtype


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: Qwen35Config, dtype):
        self.cfg = cfg
        nv = cfg.linear_num_value_heads
        self.in_proj = _fused_linear(cfg, "in_proj", cfg.hidden_size, dtype)
        self.conv1d = Weight((cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), dtype)
        self.dt_bias = _param((nv,), dtype)
        self.A_log = _param((nv,), dtype)
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, dtype)
        self.out_proj = Linear(cfg.gdn_value_dim, cfg.hidden_size, dtype)

    def _in_projections(self, x, linear):
        """(the product whose first conv_dim columns are the conv's input and the next gdn_value_dim z, the array
        holding b and then a, the column b starts at). The conv and GDN decode kernels read their columns where the
        product wrote them: a slice handed to them would be copied first (12 us a layer at 1024 tokens on the H200).
        Over more than FUSED_IN_PROJ_MAX_ROWS rows the conv input and z, whose width tiles well, are one product and b
        and a another; up to it, all four are one."""
        cfg = self.cfg
        weight = self.in_proj.weight[...]
        qkvz = cfg.conv_dim + cfg.gdn_value_dim
        if math.prod(x.shape[:-1]) > FUSED_IN_PROJ_MAX_ROWS:
            product, ba, ba_col = linear(x, weight[:qkvz]), linear(x, weight[qkvz:]), 0
        else:
            product = ba = linear(x, weight)
            ba_col = qkvz
        return product, ba, ba_col

    def _decode(self, ctx, product, ba, ba_col: int, pools, layer):
        """The decode rows' conv and recurrent states are updated where they live, in the slot pools: one read
        and one write of each (gathering them into the step and scattering them back took three). The kernels take
        the whole product and ba and read their first B rows (the decode rows): slices would be copies. The GDN
        kernel makes the gates from b and a itself, and applies the output norm with z read from the product.
        Returns the normed output [B, nv, dv]."""
        slots, weight = ctx.inputs.decode.slots, self.conv1d.weight[...][:, 0, :]
        mixed, conv_pool = ctx.mixers.conv_update(product, weight, pools.conv, layer, slots)
        out, ssm_pool = ctx.mixers.gdn_decode(mixed, ba, ba_col, self.A_log[...], self.dt_bias[...], pools.ssm, layer,
                                              slots, z=product, z_col=self.cfg.conv_dim,
                                              norm_weight=self.norm.weight[...], eps=self.norm.eps)  # fmt: skip
        return out, dataclasses.replace(pools, ssm=ssm_pool, conv=conv_pool)

    def _prefill(self, ctx, mixed, g, beta, state: GdnState):
        mixed, conv = ctx.mixers.conv_prefill(mixed, self.conv1d.weight[...][:, 0, :], state.conv,
                                              ctx.inputs.prefill.lengths)  # fmt: skip
        out, ssm = ctx.mixers.gdn_prefill(mixed, g, beta, state.ssm, ctx.inputs.prefill.lengths)
        return out, GdnState(ssm, conv)

    def __call__(self, x, state: GdnState | None, ctx: StepContext, pools: KVPages, layer, product=None):
        """x [N, hidden]; state: this layer's prefill rows' states (None in a step without prefill rows); the decode
        rows' states are GDN layer `layer` of pools.ssm and pools.conv; product: in_proj's output over the fused
        weight, when the caller made it (x is then unused). Returns (out_proj's output as partial sums, new state,
        pools)."""
        cfg = self.cfg
        if product is None:
            product, ba, ba_col = self._in_projections(x, ctx.mixers.linear)
        else:
            ba, ba_col = product, cfg.conv_dim + cfg.gdn_value_dim
        outs = []
        if ctx.inputs.decode is not None:
            out, pools = self._decode(ctx, product, ba, ba_col, pools, layer)
            outs.append(out.reshape(out.shape[0], -1))
        if ctx.inputs.prefill is not None:
            mixed_p, ba_p = ctx.split(product)[1], ctx.split(ba)[1]
            a, b = gate_columns(ba_p, ba_col, cfg.linear_num_value_heads)
            g, beta = gdn_gates(a, b, self.A_log[...], self.dt_bias[...])
            out, state = self._prefill(ctx, mixed_p, g, beta, state)
            out = out.reshape(-1, *out.shape[-2:])  # [P T, nv, dv]
            z = ctx.split(product[..., cfg.conv_dim : cfg.conv_dim + cfg.gdn_value_dim])[1]
            outs.append(self.norm(out, z.reshape(out.shape)).reshape(out.shape[0], -1))
        out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]  # [N, nv dv]
        return self.out_proj.parts(out, ctx.mixers.linear_parts), state, pools


def rope_tables(positions, cfg: Qwen35Config, dtype):
    """cos/sin [N, rotary_dim], computed in fp32 and cast to the model dtype (as HF)."""
    rot = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen35Config, dtype):
        self.cfg = cfg
        heads, dim = cfg.num_attention_heads, cfg.head_dim
        self.qkv_proj = _fused_linear(cfg, "qkv_proj", cfg.hidden_size, dtype)
        self.o_proj = Linear(heads * dim, cfg.hidden_size, dtype)
        self.q_norm = RMSNorm(dim, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(dim, cfg.rms_norm_eps, dtype)

    def __call__(self, x, cache: KVPages, layer, ctx: StepContext, product=None):
        """product: qkv_proj's output over the fused weight, when the caller made it (x is then unused). At every
        size it is one product that the attention inputs kernel reads q, k and v out of: per-part products of a
        prefill chunk were merged into that GEMM by XLA anyway, then copied apart for the kernel (three copy kernels
        a layer, ~340 MB moved at 8192 tokens; deviceless compile for the H200)."""
        cfg = self.cfg
        qkv = self.qkv_proj(x, ctx.mixers.linear) if product is None else product
        q, k, gate, k_pages, v_pages = ctx.mixers.attention_inputs(
            qkv, self.q_norm.weight[...], self.k_norm.weight[...], ctx.cos, ctx.sin, cache.k_pages,
            cache.v_pages, layer, ctx.kv_page, ctx.kv_offset, heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads, eps=cfg.rms_norm_eps)  # fmt: skip
        (_, q_p), (_, gate_p) = ctx.split(q), ctx.split(gate)
        out_d = out_p = None
        if ctx.inputs.decode is not None:  # the decode rows are q's first; gated where the kernel merges its splits
            side = ctx.inputs.decode
            out_d = ctx.mixers.decode_attention(q, k_pages, v_pages, layer, side.page_table, ctx.decode_lengths, gate)
        if q_p is not None:
            side = ctx.inputs.prefill
            _, _, v = split_qkv(qkv, cfg.num_attention_heads, cfg.num_key_value_heads)
            (_, k_p), (_, v_p) = ctx.split(k), ctx.split(v)  # the chunk's own keys, as projected (also paged now)
            out_p = ctx.mixers.prefill_attention(q_p, k_p, v_p, k_pages, v_pages, layer, side.page_table, side.start,
                                                 side.lengths)  # fmt: skip
            out_p = output_gate(out_p, gate_p)
        out = StepContext.join(out_d, out_p).reshape(qkv.shape[0], -1)
        out = self.o_proj.parts(out, ctx.mixers.linear_parts)
        return out, dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen35Config, kind: str, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, dtype)
        else:
            self.self_attn = Attention(cfg, dtype)
        self.mlp = MLP(cfg, dtype)

    def __call__(self, h, pending, cache: KVPages, layer, state: GdnState | None, ctx: StepContext, linear_layer=None):
        """h [N, hidden], the residual stream, in and out, with `pending`, the partial sums of the last product
        still to be added to it (the previous layer's MLP output: each add is fused with the norm after it). A
        linear layer reads and returns its prefill rows' GdnState and updates the decode rows' in the pools (its
        index there: linear_layer); the attention layer writes its K/V pages (its index: layer)."""
        gdn = hasattr(self, "linear_attn")
        h, x, product = self._norm(self.input_layernorm, h, pending,
                                   self.linear_attn.in_proj if gdn else self.self_attn.qkv_proj, ctx.mixers)  # fmt: skip
        if gdn:
            out, state, cache = self.linear_attn(x, state, ctx, cache, linear_layer, product=product)
        else:
            out, cache = self.self_attn(x, cache, layer, ctx, product=product)
        h, x, product = self._norm(self.post_attention_layernorm, h, out, self.mlp.gate_up_proj, ctx.mixers)
        return h, self.mlp(x, ctx.mixers.linear, ctx.mixers.linear_parts, product=product), cache, state

    @staticmethod
    def _norm(norm: RMSNorm, h, parts, linear: Linear, mixers: Mixers):
        """(h', x, None): the residual add and `norm`; or, at up to NORM_LINEAR_MAX_ROWS rows, (h', None, the
        product over `linear`'s fused weight that reads the norm) through `Mixers.norm_linear`, one kernel there."""
        if h.shape[0] <= NORM_LINEAR_MAX_ROWS:
            h, product = norm.into_product(h, parts, linear, mixers)
            return h, None, product
        return *norm.after_residual(h, parts, mixers), None


class LayerGroup(nnx.Module):
    """One repeat of the layer pattern: linear_per_group GDN layers, then one full-attention layer."""

    def __init__(self, cfg: Qwen35Config, dtype):
        self.cfg = cfg
        kinds = cfg.layer_types[: cfg.group_size]
        self.layers = nnx.List([DecoderLayer(cfg, kind, dtype) for kind in kinds])

    def __call__(self, h, pending, cache: KVPages, group, states: GdnState | None, ctx: StepContext):
        """h and pending: `DecoderLayer`'s; states: [linear_per_group, P, ...] for this group's GDN layers (None
        without prefill rows); returns them updated."""
        new_states = []
        linear_per_group = len(self.layers) - 1
        for j, layer in enumerate(self.layers):
            linear = j < linear_per_group
            state = jax.tree.map(lambda x, j=j: x[j], states) if linear and states is not None else None
            h, pending, cache, state = layer(h, pending, cache, group, state, ctx, group * linear_per_group + j)
            if linear:
                new_states.append(state)
        return h, pending, cache, None if states is None else jax.tree.map(lambda *xs: jnp.stack(xs), *new_states)


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
        return self.head_logits(self.norm(h))

    def head_logits(self, x):
        """The lm_head's product of the final norm's output x [R, hidden] (`logits`)."""
        head = self.lm_head.weight if hasattr(self, "lm_head") else self.embed_tokens.weight
        return lax.dot_general(x, head[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVPages:
    """The pools the layer loop carries: the paged KV pools, and in a step with decode rows the GDN slot pools,
    in which the decode kernels update those rows' states in place."""

    k_pages: jax.Array
    v_pages: jax.Array
    ssm: jax.Array | None = None
    conv: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The static half of the model: config, dtype and the graph definitions of its two module kinds."""

    cfg: Qwen35Config
    dtype: Any
    top: nnx.GraphDef
    group: nnx.GraphDef

    def _key(self):
        return self.cfg, str(self.dtype)

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, ModelDef) and self._key() == other._key()


def abstract_model(cfg: Qwen35Config, dtype) -> tuple[ModelDef, dict[str, nnx.State]]:
    """Graph definitions and abstract parameter state; group params are stacked on a leading [groups] axis."""
    top_def, top_state = nnx.split(nnx.eval_shape(lambda: Embedding(cfg, dtype)))
    group_def, group_state = nnx.split(nnx.eval_shape(lambda: LayerGroup(cfg, dtype)))
    stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((cfg.num_groups, *s.shape), s.dtype), group_state)
    return ModelDef(cfg, jnp.dtype(dtype), top_def, group_def), {"top": top_state, "groups": stacked}


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
    model: ModelDef,
    params,
    cache: Cache,
    inputs: StepInputs,
    mixers: Mixers,
    all_prefill_logits=False,
) -> tuple[jax.Array, Cache]:
    """One step. Returns fp32 logits [B + P, vocab] (decode rows first, then each prefill row's last
    token; or [B + P*T, vocab] with all_prefill_logits) and the updated cache.

    In a step with both sides, the dense layers run once over the rows of both, so each weight is read once; the
    token mixers run per side, and no side's mixers read the other's outputs, so a concurrent command buffer
    (`--decode-overlap stream`, serving/runner.py) can run the two sides' mixers at once."""
    top = nnx.merge(model.top, params["top"])
    cfg = model.cfg
    cos, sin = rope_tables(_flat(inputs, "positions"), cfg, model.dtype)
    kv_page, kv_offset = _kv_destinations(inputs, cache.page_size)
    decode_lengths = None
    if inputs.decode is not None:  # once a step: XLA's rematerialisation made one kernel of it an attention layer
        decode_lengths = lax.optimization_barrier(inputs.decode.positions + 1)
    ctx = StepContext(inputs, mixers, cos, sin, kv_page, kv_offset, decode_lengths)
    h = top.embed(_flat(inputs, "tokens"))
    has_decode = inputs.decode is not None
    states = _gather_prefill_states(cache, inputs, cfg)
    kv = KVPages(cache.k_pages, cache.v_pages, *((cache.ssm, cache.conv) if has_decode else ()))

    def body(carry, xs):
        h, pending, kv = carry
        group_params, group_index, group_states = xs
        group = nnx.merge(model.group, group_params)
        h, pending, kv, group_states = group(h, pending, kv, group_index, group_states, ctx)
        return (h, pending, kv), group_states

    xs = (params["groups"], jnp.arange(cfg.num_groups, dtype=jnp.int32), states)
    (h, pending, kv), states = _layer_loop(body, (h, _no_pending(h, cfg, mixers), kv), xs)
    ssm_pool, conv_pool = (kv.ssm, kv.conv) if has_decode else (cache.ssm, cache.conv)
    if states is not None:  # the prefill rows' states go back to their slots
        slots = inputs.prefill.slots
        ssm_pool, conv_pool = (
            pool.at[:, slots].set(rows.reshape(cfg.num_linear_layers, *rows.shape[2:]).astype(pool.dtype))
            for pool, rows in ((ssm_pool, states.ssm), (conv_pool, states.conv))
        )
    cache = Cache(k_pages=kv.k_pages, v_pages=kv.v_pages, ssm=ssm_pool, conv=conv_pool)
    if inputs.prefill is None:  # every row's logits: the last MLP's add fused with the final norm, as in the layers
        return top.head_logits(top.norm.after_residual(h, pending, mixers)[1]), cache
    h = h + residual_delta(pending, h.dtype)
    return top.logits(h[_logit_rows(inputs, all_prefill_logits)]), cache


def _no_pending(h, cfg: Qwen35Config, mixers: Mixers) -> jax.Array:
    """Zero partial sums in the form the MLP's down projection gives them, for the first layer's residual add."""
    down_in = jax.ShapeDtypeStruct((*h.shape[:-1], cfg.intermediate_size), h.dtype)
    down_weight = jax.ShapeDtypeStruct((cfg.hidden_size, cfg.intermediate_size), h.dtype)
    parts = jax.eval_shape(mixers.linear_parts, down_in, down_weight)
    return jnp.zeros(parts.shape, parts.dtype)


def _layer_loop(body, carry, xs):
    """xs = (group params, group indices, states), each on a leading [groups] axis, except per-group params
    (`unstack_groups`): a tuple of trees, which the groups run over as a Python loop instead of a scan."""
    group_params, _, states = xs
    if not isinstance(group_params, tuple):
        return lax.scan(body, carry, xs)
    outs = []
    for index, params in enumerate(group_params):
        # The group index goes in as a Python int, so every layer index is a constant of the program: traced, each
        # GDN layer computed its pool index in two kernels of its own (~3 us a layer at batch 1 on the H200).
        carry, out = body(carry, (params, index, jax.tree.map(lambda x, i=index: x[i], states)))
        outs.append(out)
    return carry, jax.tree.map(lambda *ys: jnp.stack(ys), *outs)


def unstack_groups(params, delete_stacked: bool = False) -> dict:
    """params with "groups" as a tuple of per-group trees (one array per tensor and group). Materialises new
    arrays; with delete_stacked each stacked array is freed as soon as it is split, so the peak is the weights plus
    one stacked tensor, not twice the weights (the caller must hold no other use of them)."""
    groups = params["groups"]
    if isinstance(groups, tuple):
        return params
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


def layout_for_platform(params, platform: str | None = None) -> dict:
    """The params in the layout the platform runs fastest: per-group arrays on a GPU, where a scan reads each
    group's weights through a copy (a 4B batch-1 step 4.4 ms of device time against 8.3 ms on the H200); stacked
    elsewhere, where compile time, independent of depth with the scan, is what a small machine waits on. The
    stacked arrays are freed as they are split."""
    if (platform or jax.default_backend()) == "gpu":
        return unstack_groups(params, delete_stacked=True)
    return params


def _gather_prefill_states(cache: Cache, inputs: StepInputs, cfg: Qwen35Config) -> GdnState | None:
    """The prefill rows' GDN states, [groups, linear_per_group, P, ...], read once per step (the loop carries only
    these rows, never the whole pools); a row that starts a new sequence reads zeros. None without prefill rows.
    The recurrent states are fp32 here whatever the pool stores (`CacheSpec.ssm_dtype`)."""
    if inputs.prefill is None:
        return None
    slots, fresh = inputs.prefill.slots, inputs.prefill.fresh

    def rows(pool):
        x = pool[:, slots]
        x = jnp.where(fresh.reshape(1, -1, *([1] * (x.ndim - 2))), jnp.zeros((), x.dtype), x)
        return x.reshape(cfg.num_groups, cfg.linear_per_group, *x.shape[1:])

    return GdnState(rows(cache.ssm).astype(jnp.float32), rows(cache.conv))
