"""vLLM's `allowed_token_ids` and `bad_words` as a packed token mask for the sampler row program.

The mask has device_sampling's layout (token t is bit t % 32 of word t // 32), so a request's filter and its
grammar (structured_output.py) combine by a bitwise and. A bad word of one token is cleared from the mask once;
a longer one bans its last token only where the output so far ends with the rest of it, so a request with such
a word needs each sampled token read back before its next row (`waits_for_tokens`), as a grammar does. As in
vLLM, bad words are matched against the output's tokens, not the prompt's.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qwen35_jax.serving.device_sampling import pack_mask


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFilter:
    base: np.ndarray  # [words] int32: the allowed tokens less the one-token bad words
    sequences: tuple[tuple[int, ...], ...]  # the bad words of two tokens or more

    @classmethod
    def build(cls, vocab_size: int, allowed: list[int] | None = None,
              bad_words: tuple[tuple[int, ...], ...] = ()) -> TokenFilter:  # fmt: skip
        """allowed: the only tokens sampling may pick (None: all); bad_words: token sequences that the output must
        not contain. Raises ValueError when nothing is left to pick."""
        keep = np.ones(vocab_size, bool)
        if allowed is not None:
            keep[:] = False
            keep[np.asarray(allowed, np.int64)] = True
        for word in bad_words:
            if len(word) == 1:
                keep[word[0]] = False
        if not keep.any():
            raise ValueError("no token is left to sample: every allowed token is a bad word")
        return cls(pack_mask(keep), tuple(dict.fromkeys(w for w in bad_words if len(w) > 1)))

    @property
    def waits_for_tokens(self) -> bool:
        """The mask depends on the output's last tokens."""
        return bool(self.sequences)

    def mask(self, output_ids: list[int], grammar_mask: np.ndarray | None = None) -> np.ndarray:
        """The packed mask of the tokens allowed after `output_ids` (under `grammar_mask` too, when given). A ban
        that would leave no token at all is not applied: the answer then continues rather than fail."""
        mask = self.base if grammar_mask is None else self.base & grammar_mask
        banned = [word[-1] for word in self.sequences if _ends_with(output_ids, word[:-1])]
        if not banned:
            return mask
        out = mask.copy()
        bits = out.view(np.uint32)
        for token in banned:
            bits[token >> 5] &= ~np.uint32(1 << (token & 31))
        return out if out.any() else mask


def _ends_with(ids: list[int], tail: tuple[int, ...]) -> bool:
    return len(ids) >= len(tail) and tuple(ids[len(ids) - len(tail) :]) == tail
