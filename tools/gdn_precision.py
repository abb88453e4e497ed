"""Which matmuls of the Pallas GDN chunked prefill need more than bf16 operands: a CPU emulation.

Runs the kernel in Pallas interpret mode on fp32 inputs (so every product is exact) and rounds the operands of
chosen products to bf16 or to TF32 (10 mantissa bits, round to nearest even), one product site at a time, then
reports the relative RMS error of the output (and the max error of the final state) against the fp32 reference.
Inputs are drawn as the 4B golden gate's random model draws them (A = U(1, 16), strong decay).

    python tools/gdn_precision.py --tokens 512
    python tools/gdn_precision.py --tokens 512 --cases kernel    # the kernel's precision forms only

Two tables (--cases): "kernel", precision forms on bf16 inputs, each site rounded as that form rounds it: "tf32"
(the kernel's: TF32 except the `_coarse` products and Q K^T on the raw inputs, bf16) and two it does not take,
"bf16" (every operand in bf16, as flash-linear-attention does; the 4B golden gate fails with it) and "tf32 + bf16
output" (Q K^T, Q S and A V' in bf16, the rest as "tf32"), which asks whether the output's products could run in
bf16 because their errors do not feed the recurrence (no: it keeps 95% of bf16's output error, docs/accuracy.md);
and "sites", one product site at a time in the other precision. The emulation rounds only matmul operands: it does
not model what a bf16 form would store between passes in bf16 (W, U, Q_c S_c, V'; the kernel stores W so), so it
slightly flatters the bf16 forms; and it rounds the state update's two bf16 parts of V' as the site's precision says (TF32
leaves the high part exact and rounds the low one), close to the kernel's exact bf16 parts.

Sites are named by the kernel function that calls `_dot` and, where one function holds several, by the
statement (matched in the source); a refactor of the kernel can move them, which the script reports as an
unknown site rather than guessing.
"""

from __future__ import annotations

import argparse
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qwen35_jax.kernels.gdn_prefill as gp

SITES = {  # site name -> (calling function, fragments of the calling line (any of them), or () for any line)
    "solve A and A X (WY kernel)": ("_", ("k_beta, k,", "keys[b]", "(block,")),
    "solve W, U = inverse @ rhs": ("_", ("inverses[a]",)),
    "Q K^T": ("accumulate", ("qk =",)),
    "Q S": ("chunk_step", ("q_ref",)),
    "A V'": ("_", ("out = q_state_ref",)),
    "state update": ("_next_state", ()),
    "W S": ("chunk_step", ("w_ref",)),
}
COARSE_SITES = ("solve A and A X (WY kernel)", "W S", "Q S")  # the products the kernel multiplies at `_coarse(dots)`
# Q K^T multiplies the raw q and k: on bf16 inputs the kernel takes bf16 operands there, which are exact.
RAW_SITES = ("Q K^T",)
# The products whose errors do not feed the recurrence: the output kernel's Q K^T and A V', and Q S, which the walk
# makes off its chain for the output kernel.
OUTPUT_SITES = ("Q K^T", "Q S", "A V'")
PRECISIONS = {  # label -> (the products' precision, the output kernel's: None = the same) on bf16 inputs
    "bf16": ("bf16", None),
    "tf32": ("tf32", None),
    "tf32 + bf16 output": ("tf32", "bf16"),
}


def kernel_modes(dots: str, output_dots: str | None) -> dict[str, str]:
    """Each site's operand rounding in the form (dots, output_dots)."""
    modes = {}
    for site in SITES:
        if site in COARSE_SITES or site in RAW_SITES:
            modes[site] = gp._coarse(dots)
        elif site in OUTPUT_SITES:
            modes[site] = output_dots or dots
        else:
            modes[site] = dots
    return modes


def tf32(x):
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    bits = (bits + jnp.uint32(0xFFF) + ((bits >> 13) & 1)) & jnp.uint32(0xFFFFE000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def site_of(frame) -> str | None:
    line = (frame.code_context or [""])[0]
    for name, (function, fragments) in SITES.items():
        if frame.function == function and (not fragments or any(f in line for f in fragments)):
            return name
    return None


def emulate(args, modes: dict[str, str], default: str):
    """The kernel's output and state with each site's operands rounded per modes (bf16 | tf32 | fp32)."""
    exact_dot = gp._dot
    unknown = set()

    def dot(a, b, dots, contract=((1,), (0,))):
        frame = inspect.stack()[1]
        site = site_of(frame)
        if site is None:
            unknown.add(f"{frame.function}:{frame.lineno}")
        mode = modes.get(site, default)
        if mode == "tf32":
            return exact_dot(tf32(a), tf32(b), "ieee", contract)
        return exact_dot(a, b, "bf16" if mode == "bf16" else "ieee", contract)

    gp._dot = dot
    try:
        out = jax.jit(functools.partial(gp.gdn_chunked_prefill_pallas, interpret=True))(*args)
    finally:
        gp._dot = exact_dot
    if unknown:
        raise SystemExit(f"products at unknown sites {sorted(unknown)}: update SITES")
    return out


def inputs(tokens: int, seed: int = 0):
    nk, nv, dk, dv = 2, 4, 128, 128
    rng = np.random.default_rng(seed)
    f32 = jnp.float32
    q = jnp.asarray(rng.normal(size=(1, tokens, nk, dk)), jnp.bfloat16).astype(f32)
    k = jnp.asarray(rng.normal(size=(1, tokens, nk, dk)), jnp.bfloat16).astype(f32)
    v = jnp.asarray(jax.nn.silu(rng.normal(size=(1, tokens, nv, dv))), jnp.bfloat16).astype(f32)
    beta = jnp.asarray(jax.nn.sigmoid(rng.normal(size=(1, tokens, nv))), jnp.bfloat16).astype(f32)
    decay_rate = rng.uniform(1, 16, size=nv)
    g = jnp.asarray(-decay_rate * np.log1p(np.exp(rng.normal(size=(1, tokens, nv)) + rng.normal(size=nv))), f32)
    state = jnp.asarray(rng.normal(size=(1, nv, dk, dv)) * 0.1, f32)
    return q, k, v, g, beta, state, jnp.array([tokens], jnp.int32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--cases", nargs="+", default=["kernel", "sites"], choices=["kernel", "sites"],
                        help="kernel: the precision forms (tf32, the kernel's; bf16; tf32 + bf16 output); sites: "
                             "one product site at a time")  # fmt: skip
    args = parser.parse_args()
    data = inputs(args.tokens)
    truth, truth_state = jax.jit(gp.gdn_chunked_prefill_ref)(*data)
    truth, truth_state = np.asarray(truth), np.asarray(truth_state)

    def report(label, out, state):
        out = np.asarray(out, np.float32)
        rms = np.sqrt(np.mean((out - truth) ** 2) / np.mean(truth**2))
        print(
            f"{label:55s} output {100 * rms:.4f}%  state max |err| {np.abs(np.asarray(state) - truth_state).max():.2e}"
        )

    report("bf16 output rounding alone (reference)", truth.astype(jnp.bfloat16), truth_state)
    if "kernel" in args.cases:
        for label, (dots, output_dots) in PRECISIONS.items():
            report(f"form {label}", *emulate(data, kernel_modes(dots, output_dots), "ieee"))
    if "sites" not in args.cases:
        return
    report("every product bf16", *emulate(data, {}, "bf16"))
    for site in SITES:
        report(f"bf16, {site} in TF32", *emulate(data, {site: "tf32"}, "bf16"))
    report("every product TF32", *emulate(data, {}, "tf32"))
    for site in SITES:
        report(f"TF32, {site} in bf16", *emulate(data, {site: "bf16"}, "tf32"))


if __name__ == "__main__":
    main()
