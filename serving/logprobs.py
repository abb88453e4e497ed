"""Logprobs in the two OpenAI shapes: completions' parallel lists and chat's list of token entries.

Tokens are named by their text, or `bytes:\\xNN..` when a token is part of a multi-byte character (as
OpenAI does); chat entries also carry each token's raw bytes, which byte-level BPE tokenizers give exactly.
"""

from __future__ import annotations

import dataclasses

from qwen35_jax.serving.engine import TokenLogprob
from qwen35_jax.serving.protocol import finite_logprob

# Token names are cached per token id; the cap bounds the cache for a tokenizer with a huge vocabulary.
MAX_CACHED_NAMES = 1 << 20


class LogprobFormatter:
    """Names tokens through one tokenizer (cached) and lays out the engine's `TokenLogprob`s."""

    def __init__(self, tokenizer, names_as_ids: bool = False):
        """names_as_ids: name every token "token_id:N" (vLLM's return_tokens_as_token_ids), whatever its text."""
        self.tokenizer = tokenizer
        self.names_as_ids = names_as_ids
        self._token_text: dict[int, str] = {}
        self._byte_decoder = _byte_decoder() if _is_byte_level(tokenizer) else None

    def token_bytes(self, token_id: int) -> list[int] | None:
        if self.tokenizer is None:
            return None
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return []
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return [self._byte_decoder[c] for c in piece]
        return list(self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or `bytes:\\xNN..` for part of a multi-byte character, which
        keeps such tokens apart in a top_logprobs dict."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._name(token_id)
            if len(self._token_text) < MAX_CACHED_NAMES:
                self._token_text[token_id] = text
        return text

    def _name(self, token_id: int) -> str:
        if self.tokenizer is None or self.names_as_ids:
            return f"token_id:{token_id}"
        raw = bytes(self.token_bytes(token_id))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def completion(self, entries: list[TokenLogprob], texts: list[str], offset: int) -> dict:
        """`texts[i]`: the text that token i added to the output, for `text_offset`, which starts at `offset`."""
        tokens, chosen, tops, offsets = [], [], [], []
        for entry, text in zip(entries, texts, strict=True):
            tokens.append(self.token_text(entry.token_id))
            chosen.append(finite_logprob(entry.logprob))
            top: dict[str, float] = {}
            for token_id, logprob in entry.top:  # most likely first: a name shared by two tokens keeps the higher
                top.setdefault(self.token_text(token_id), finite_logprob(logprob))
            # The sampled token is always there, as in OpenAI's and vLLM's completions: logprobs=N gives up to N + 1
            # entries, and logprobs=0 the sampled token alone.
            top.setdefault(tokens[-1], chosen[-1])
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}

    def echoed_prompt(self, prompt_ids: list[int], entries: list[TokenLogprob], texts: tuple[str, ...], n: int) -> dict:
        """An echoed prompt in the completions shape, offsets from 0: its first token with null logprob and null top
        (nothing precedes it to score it in, as in OpenAI's and vLLM's), then each later token as `completion` lays
        out output tokens, with its top `n`. `entries` score prompt_ids[1:]; `texts[i]`: the text token i adds."""
        scored = [dataclasses.replace(entry, top=entry.top[:n]) for entry in entries]
        rest = self.completion(scored, list(texts[1:]), len(texts[0]))
        first = {"tokens": [self.token_text(prompt_ids[0])], "token_logprobs": [None], "top_logprobs": [None],
                 "text_offset": [0]}  # fmt: skip
        return joined(first, rest)

    def prompt_logprobs(self, entries: list[TokenLogprob], n: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: null for the first prompt token, then per token {token id: {logprob, rank,
        decoded_token}} for the token itself and the top n."""
        out: list[dict | None] = [None]
        for entry in entries:
            ranked = {entry.token_id: (entry.logprob, entry.rank)}
            for rank, (token_id, logprob) in enumerate(entry.top[:n], start=1):
                ranked.setdefault(token_id, (logprob, rank))
            out.append({str(token_id): {"logprob": finite_logprob(logprob), "rank": rank,
                                        "decoded_token": self.token_text(token_id)}
                        for token_id, (logprob, rank) in ranked.items()})  # fmt: skip
        return out

    def chat(self, entries: list[TokenLogprob]) -> dict:
        return {"content": [self._chat_entry(entry) for entry in entries]}

    def _chat_entry(self, entry: TokenLogprob) -> dict:
        top = [self._chat_token(token_id, logprob) for token_id, logprob in entry.top]
        return self._chat_token(entry.token_id, entry.logprob) | {"top_logprobs": top}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        return {"token": self.token_text(token_id), "logprob": finite_logprob(logprob),
                "bytes": self.token_bytes(token_id)}  # fmt: skip


def joined(first: dict, second: dict) -> dict:
    """Two runs of completions logprobs, one after the other (the second's text_offset already continues the first)."""
    return {key: first[key] + second[key] for key in first}


def _is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


def _byte_decoder() -> dict[str, int]:
    """Character -> byte of byte-level BPE, which shows every byte as a printable character: printable
    Latin-1 bytes stand for themselves, the other bytes are shifted to code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table
