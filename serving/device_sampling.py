"""Per-row sampling on the device: greedy, temperature, top_k, top_p, min_p, a seed per request, a grammar's
token mask, logprobs.

Randomness is keyed by (request seed, index of the token in the request's output), never by the step or
the row, and each token id draws its own noise, so a seeded request samples the same tokens whatever else shares
its batch: a reordering of near-tied logits moves no noise between tokens. The seed is a whole 64-bit integer.
Filters apply in the order temperature -> top_k -> top_p -> min_p over probabilities sorted once per row; the
draw is a Gumbel-max over the kept set. Logprobs are of the unfiltered distribution at temperature 1 (as OpenAI).

A row under a grammar (serving/structured_output.py) carries a packed mask of the tokens it may take: the
tokens outside it are dropped after penalties and logit_bias, before the filters and the pick, so top_k and
top_p act on the allowed tokens. Its logprobs stay the model's (vLLM's default, raw logprobs): a token the
grammar forced may be one the model found unlikely, and its logprob says so.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax.sampling import MAX_LOGIT_BIAS


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingRows:
    temperature: jax.Array  # [R] fp32, 0 = greedy
    top_k: jax.Array  # [R] int32, 0 = off
    top_p: jax.Array  # [R] fp32 in (0, 1]
    min_p: jax.Array  # [R] fp32 in [0, 1)
    seed_hi: jax.Array  # [R] uint32: the high and low words of the request's 64-bit seed (two's complement)
    seed_lo: jax.Array  # [R] uint32
    output_index: jax.Array  # [R] int32: index of the token being sampled in the request's output
    bias_ids: jax.Array  # [R, MAX_LOGIT_BIAS] int32: logit_bias token ids (padding: token 0 with value 0)
    bias_values: jax.Array  # [R, MAX_LOGIT_BIAS] fp32
    presence: jax.Array  # [R] fp32: presence_penalty
    frequency: jax.Array  # [R] fp32: frequency_penalty
    repetition: jax.Array  # [R] fp32: repetition_penalty (1 = off)
    allowed: jax.Array  # [R, W >= ceil(V / 32)] int32: packed token masks (`pack_mask`); all bits set = no grammar

    @staticmethod
    def from_rows(rows: list, pad_to: int, allowed) -> SamplingRows:
        """rows: SamplingParams-like objects with an `output_index` attribute, or None for a padding row;
        padded to pad_to rows. Padding rows are greedy. allowed: the rows' packed masks, [pad_to, words]."""

        def column(name, dtype, default):
            values = [default if r is None else getattr(r, name) for r in rows] + [default] * (pad_to - len(rows))
            return np.asarray(values, dtype=dtype)

        seeds = [0 if r is None else r.seed % 2**64 for r in rows] + [0] * (pad_to - len(rows))
        return SamplingRows(
            temperature=column("temperature", np.float32, 0.0), top_k=column("top_k", np.int32, 0),
            top_p=column("top_p", np.float32, 1.0), min_p=column("min_p", np.float32, 0.0),
            seed_hi=np.asarray([s >> 32 for s in seeds], np.uint32),
            seed_lo=np.asarray([s & 0xFFFFFFFF for s in seeds], np.uint32),
            output_index=column("output_index", np.int32, 0), **_bias_columns(rows, pad_to),
            presence=column("presence_penalty", np.float32, 0.0), frequency=column("frequency_penalty", np.float32, 0.0),
            repetition=column("repetition_penalty", np.float32, 1.0),
            allowed=allowed,
        )  # fmt: skip


def mask_words(vocab_size: int) -> int:
    """int32 words of one packed token mask."""
    return -(-vocab_size // 32)


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """[..., V] bool -> [..., ceil(V / 32)] int32 words: token t is bit t % 32 of word t // 32, as llguidance
    writes its masks (the bits past V are clear). The host form of `unpack_mask`."""
    padded = np.zeros((*allowed.shape[:-1], mask_words(allowed.shape[-1]) * 32), bool)
    padded[..., : allowed.shape[-1]] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view("<i4")


def unpack_mask(words: jax.Array, vocab_size: int) -> jax.Array:
    """[R, W] int32 packed masks -> [R, vocab_size] bool."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(bool)


def _bias_columns(rows: list, pad_to: int) -> dict[str, np.ndarray]:
    ids, values = np.zeros((pad_to, MAX_LOGIT_BIAS), np.int32), np.zeros((pad_to, MAX_LOGIT_BIAS), np.float32)
    for i, row in enumerate(rows):
        for j, (token, value) in enumerate(() if row is None else getattr(row, "logit_bias", ())):
            ids[i, j], values[i, j] = token, value
    return {"bias_ids": ids, "bias_values": values}


def _with_bias(logits, rows: SamplingRows):
    return logits.at[jnp.arange(logits.shape[0])[:, None], rows.bias_ids].add(rows.bias_values)


def _keep_mask(sorted_probs, top_k, top_p, min_p):
    """sorted_probs [R, V] descending -> bool mask of kept ranks (rank 0 always kept)."""
    ranks = jnp.arange(sorted_probs.shape[-1])[None, :]
    keep = jnp.where(top_k[:, None] > 0, ranks < top_k[:, None], True)
    exclusive_cumsum = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep &= exclusive_cumsum < top_p[:, None]
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    return keep | (ranks == 0)


def _draw(logits, rows: SamplingRows):
    temperature = jnp.maximum(rows.temperature, 1e-6)[:, None]
    order = jnp.argsort(-logits, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1) / temperature
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep = _keep_mask(probs, rows.top_k, rows.top_p, rows.min_p)
    # The key's data is the 64-bit seed's two words: jax.random.key(seed) for a seed below 2**32.
    keys = jax.vmap(lambda hi, lo, i: jax.random.fold_in(jax.random.wrap_key_data(jnp.stack([hi, lo])), i))(
        rows.seed_hi, rows.seed_lo, rows.output_index
    )
    # Noise by token id, gathered into rank order.
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    sorted_gumbel = jnp.take_along_axis(gumbel, order, axis=-1)
    rank = jnp.argmax(jnp.where(keep, sorted_logits + sorted_gumbel, -jnp.inf), axis=-1)
    return jnp.take_along_axis(order, rank[:, None], axis=-1)[:, 0]


def _logprob_of(logits: jax.Array, tokens: jax.Array, lse: jax.Array | None = None) -> jax.Array:
    """log softmax(logits)[token] per row, from one logsumexp (no [R, V] log-softmax written out); `lse` when the
    caller already has it."""
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return picked - (jax.nn.logsumexp(logits, axis=-1) if lse is None else lse)


def _first_max_and_sum(a, b):
    """Combines two (max, sum of exp(x - max), index of the first max) partials of a row: one pass over the logits
    gives the argmax and the log-sum-exp. NaN wins and the lower index wins ties, as jnp.argmax."""
    a_max, a_sum, a_index = a
    b_max, b_sum, b_index = b
    take_a = (a_max > b_max) | (a_max != a_max)
    top = jnp.where(take_a, a_max, b_max)

    def rescaled(partial_max, partial_sum):  # an empty partial (sum 0, max -inf) adds 0, not exp(-inf + inf)
        return jnp.where(partial_sum == 0, 0.0, partial_sum * jnp.exp(partial_max - top))

    index = jnp.where(take_a | ((a_max == b_max) & (a_index < b_index)), a_index, b_index)
    return top, rescaled(a_max, a_sum) + rescaled(b_max, b_sum), index


# From this many rows greedy() takes its one-pass form. Per call on an H100 (4B vocabulary, fp32 logits), argmax +
# logsumexp against the one pass: 9.5 / 14.4 us at 1 row, 15.5 / 16.9 at 16, 56.4 / 44.0 at 64, 179.9 / 137.5 at
# 256 (`tools/bench_greedy.py`, docs/performance.md). The one pass exponentiates twice an element, so few rows are
# bound by its arithmetic.
ONE_PASS_GREEDY_ROWS = 32


def greedy(logits: jax.Array):
    """logits [R, V] fp32 -> (argmax tokens [R] int32, their logprobs [R]), in the faster form for R rows."""
    return (greedy_one_pass if logits.shape[0] >= ONE_PASS_GREEDY_ROWS else greedy_by_argmax)(logits)


def greedy_by_argmax(logits: jax.Array):
    """`greedy` as an argmax, a gather and a logsumexp: three reads of the logits, each a light kernel."""
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, _logprob_of(logits, tokens)


def greedy_one_pass(logits: jax.Array):
    """`greedy` in one reduction: the chosen logit is the row's max, so its logprob is -log sum exp(logits - max),
    and one pass carries the max, the rescaled sum and the first index (at 256 rows a pass is 254 MB)."""
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    init = (jnp.array(-jnp.inf, logits.dtype), jnp.array(0, logits.dtype), jnp.int32(0))
    _, total, tokens = jax.lax.reduce((logits, jnp.ones_like(logits), index), init, _first_max_and_sum, (1,))
    return tokens, -jnp.log(total)


def top_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int):
    """(the tokens' logprobs [R], top ids [R, num_top] int32, their logprobs), best first. One logsumexp serves
    both, so a chosen token that is in the top list has exactly its logprob there. The top-k over the whole
    vocabulary is a sort in XLA, so the engine runs this only for steps where a request asked for top logprobs."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    top_logits, top_ids = jax.lax.top_k(logits, num_top)
    return _logprob_of(logits, tokens, lse), top_ids.astype(jnp.int32), top_logits - lse[:, None]


def prompt_token_logprobs(logits: jax.Array, targets: jax.Array, num_top: int):
    """logits [T, V] at each position of a prompt chunk, targets [T] the prompt token after each position ->
    (the targets' logprobs [T], their ranks [T] int32 (1 + the tokens of higher logit, as vLLM counts them), top
    ids [T, num_top] int32, their logprobs), from one logsumexp per position, as `top_logprobs`."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[:, None], axis=-1)
    ranks = 1 + jnp.sum(logits > picked, axis=-1, dtype=jnp.int32)
    top_logits, top_ids = jax.lax.top_k(logits, num_top)
    return picked[:, 0] - lse, ranks, top_ids.astype(jnp.int32), top_logits - lse[:, None]


def penalized(logits: jax.Array, rows: SamplingRows, counts: jax.Array, in_prompt: jax.Array) -> jax.Array:
    """logits after each row's penalties: the repetition penalty over the tokens of its prompt (`in_prompt`
    [R, V] bool) and of its output so far (`counts` [R, V]), then presence and frequency over `counts`. A row at
    repetition 1 keeps its logits bit for bit (x / 1 and x * 1 are exact), whatever its slot's mask holds."""
    seen = in_prompt | (counts > 0)
    repetition = rows.repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - rows.frequency[:, None] * counts - rows.presence[:, None] * (counts > 0)


def resample(logits: jax.Array, rows: SamplingRows, tokens: jax.Array, counts: jax.Array | None = None,
             in_prompt: jax.Array | None = None):  # fmt: skip
    """The tokens of rows with temperature > 0 replaced by a draw, and of greedy rows with penalties, a
    logit_bias or a token mask by the argmax of what those make of the logits; returns (tokens [R] int32, their
    logprobs, of the unmodified logits). counts: [R, V] output-token counts of the rows, and in_prompt: [R, V]
    which tokens their prompts hold, for the penalties. vLLM's order: repetition, presence and frequency, then
    logit_bias, then the grammar's mask."""
    shifted = logits if counts is None else penalized(logits, rows, counts, in_prompt)
    shifted = _with_bias(shifted, rows)
    shifted = jnp.where(unpack_mask(rows.allowed, logits.shape[-1]), shifted, -jnp.inf)
    masked = jnp.any(rows.allowed != -1, axis=-1)
    has_bias = jnp.any(rows.bias_values != 0, axis=-1) | (rows.presence != 0) | (rows.frequency != 0) | masked
    has_bias |= rows.repetition != 1
    greedy = jnp.where(has_bias, jnp.argmax(shifted, axis=-1), tokens)
    tokens = jnp.where(rows.temperature > 0, _draw(shifted, rows), greedy).astype(jnp.int32)
    return tokens, _logprob_of(logits, tokens)
