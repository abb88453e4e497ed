"""vLLM's request parameters beyond OpenAI's, on the live tiny server through the official `openai` client
(`extra_body`): allowed_token_ids, bad_words, return_token_ids, return_tokens_as_token_ids, chat's echo and
prompt_logprobs, request_id, reasoning_effort, documents, and the parameters taken at their neutral values only;
vLLM's stop_reason on the choices; OpenAI's bookkeeping fields; the /ping route."""

from __future__ import annotations

import re

import httpx
import numpy as np
import openai
import pytest

from qwen35_jax.serving.token_filter import TokenFilter

pytest_plugins = ["_server", "_scripted"]

PROMPT_IDS = [17, 230, 45, 301, 99, 12, 400, 77]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


def greedy(server, **kwargs):
    fields = {"model": server.model_name, "prompt": PROMPT_IDS, "temperature": 0.0, "max_tokens": 16} | kwargs
    extra = {"ignore_eos": True, "return_token_ids": True} | fields.pop("extra_body", {})
    return server.client().completions.create(**fields, extra_body=extra)


def chat(server, **kwargs):
    fields = {"model": server.model_name, "messages": MESSAGES, "temperature": 0.0, "max_tokens": 8} | kwargs
    return server.client().chat.completions.create(**fields)


def contains(ids: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(ids[i : i + len(word)]) == word for i in range(len(ids) - len(word) + 1))


# ---- the token filter on its own ----------------------------------------------------------------------------


def allowed_tokens(mask: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_token_filter_mask():
    """Allowed ids less one-token bad words; a longer word bans its last token only after the rest of it, whatever
    bit of its word that token is (31 is the int32 sign bit); a ban that would leave nothing is not applied."""
    f = TokenFilter.build(100, allowed=[3, 31, 63, 64], bad_words=((64,), (5, 31), (7, 8, 63)))
    assert allowed_tokens(f.mask([]), 100) == {3, 31, 63}
    assert allowed_tokens(f.mask([1, 5]), 100) == {3, 63}
    assert allowed_tokens(f.mask([7, 8]), 100) == {3, 31}
    assert allowed_tokens(f.mask([8, 7]), 100) == {3, 31, 63}
    assert f.waits_for_tokens and not TokenFilter.build(100, allowed=[1]).waits_for_tokens
    grammar = np.zeros_like(f.base)
    grammar[0] = 1 << 3
    assert allowed_tokens(f.mask([], grammar), 100) == {3}
    only = TokenFilter.build(10, allowed=[4], bad_words=((4, 4),))
    assert allowed_tokens(only.mask([4]), 10) == {4}
    with pytest.raises(ValueError, match="no token is left"):
        TokenFilter.build(10, allowed=[4], bad_words=((4,),))


# ---- allowed_token_ids and bad_words ---------------------------------------------------------------------------


def test_allowed_token_ids_limit_greedy_and_sampled_outputs(idle_server):
    plain = greedy(idle_server).choices[0].token_ids
    allowed = sorted(set(range(40, 60)) - set(plain))[:6]
    for temperature in (0.0, 1.0):
        ids = greedy(idle_server, temperature=temperature, extra_body={"allowed_token_ids": allowed}).choices[0]
        assert set(ids.token_ids) <= set(allowed) and len(ids.token_ids) == 16


def test_a_one_token_bad_word_never_appears(idle_server):
    tokenizer = idle_server.model.tokenizer
    plain = greedy(idle_server).choices[0].token_ids
    token = next(t for t in plain if tokenizer.encode(tokenizer.decode([t]).lstrip()) == [t])
    word = tokenizer.decode([token])
    banned = greedy(idle_server, extra_body={"bad_words": [word]}).choices[0]
    assert token not in banned.token_ids and banned.token_ids != plain


def test_a_two_token_bad_word_bans_its_second_token_after_its_first(idle_server):
    tokenizer = idle_server.model.tokenizer
    plain = greedy(idle_server, max_tokens=24).choices[0].token_ids
    word = None
    for i in range(len(plain) - 1):
        text = tokenizer.decode(plain[i : i + 2])
        if text.strip() and tuple(plain[i : i + 2]) in {tuple(tokenizer.encode(p + text.lstrip())) for p in ("", " ")}:
            word = text
            break
    assert word is not None, "no output pair tokenizes back to itself"
    forms = {tuple(tokenizer.encode(p + word.lstrip())) for p in ("", " ")}
    banned = greedy(idle_server, max_tokens=24, extra_body={"bad_words": [word]}).choices[0].token_ids
    assert contains(plain, tuple(plain[i : i + 2]))
    assert not any(contains(banned, form) for form in forms) and banned != plain


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1], "response_format": {"type": "json_object"}}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": [""]}, "bad_words"),
        ({"priority": 1}, "priority"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"request_id": "has space"}, "request_id"),
    ],
)
def test_refused_values_are_400s_naming_the_parameter(idle_server, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        greedy(idle_server, max_tokens=2, extra_body=extra)
    assert caught.value.body["param"] == param


# ---- token ids and logprob names --------------------------------------------------------------------------------


def test_return_token_ids_on_completions(idle_server):
    text = "Hello there, general"
    answer = greedy(idle_server, prompt=text)
    choice = answer.choices[0]
    assert choice.prompt_token_ids == idle_server.model.tokenizer.encode(text)
    assert len(choice.token_ids) == answer.usage.completion_tokens == 16
    assert idle_server.model.tokenizer.decode(choice.token_ids) == choice.text
    stream = greedy(idle_server, prompt=text, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].prompt_token_ids == choice.prompt_token_ids
    assert [t for c in chunks for t in c.token_ids] == choice.token_ids
    assert "token_ids" not in greedy(idle_server, extra_body={"return_token_ids": False}).choices[0].model_extra


def test_return_token_ids_on_chat(idle_server):
    answer = chat(idle_server, extra_body={"return_token_ids": True})
    tokenized = httpx.post(f"{idle_server.root}/tokenize", headers=idle_server.headers(),
                           json={"messages": MESSAGES}).json()  # fmt: skip
    assert answer.model_extra["prompt_token_ids"] == tokenized["tokens"]
    ids = answer.choices[0].token_ids
    assert len(ids) == answer.usage.completion_tokens
    stream = list(chat(idle_server, stream=True, extra_body={"return_token_ids": True}))
    assert stream[0].model_extra["prompt_token_ids"] == tokenized["tokens"]
    assert [t for c in stream if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])] == ids


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(idle_server):
    answer = greedy(idle_server, logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    choice = answer.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert all(re.fullmatch(r"token_id:\d+", name) for top in choice.logprobs.top_logprobs for name in top)
    answer = chat(idle_server, logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                                          "return_token_ids": True})  # fmt: skip
    content = answer.choices[0].logprobs.content
    assert [entry.token for entry in content] == [f"token_id:{t}" for t in answer.choices[0].token_ids]
    assert all(re.fullmatch(r"token_id:\d+", top.token) for entry in content for top in entry.top_logprobs)


# ---- chat: echo and prompt logprobs ------------------------------------------------------------------------------

CONTINUED = [*MESSAGES, {"role": "assistant", "content": "Hello and"}]


def test_chat_echo_leads_the_answer_with_the_assistant_message_it_continues(idle_server):
    fields = {"messages": CONTINUED, "extra_body": {"add_generation_prompt": False, "continue_final_message": True,
                                                    "ignore_eos": True}}  # fmt: skip
    plain = chat(idle_server, **fields).choices[0].message.content
    fields["extra_body"] |= {"echo": True}
    echoed = chat(idle_server, **fields).choices[0].message.content
    assert echoed == "Hello and" + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(idle_server, stream=True, **fields) if c.choices)
    assert streamed == echoed
    # A last message that is not the assistant's is not echoed.
    assert chat(idle_server, extra_body={"echo": True}).choices[0].message.content == chat(
        idle_server).choices[0].message.content  # fmt: skip


def test_chat_prompt_logprobs_match_completions_on_the_same_prompt(idle_server):
    """The chat answer's prompt_logprobs are those that completions give for the rendered prompt's ids (the same
    programs score the same ids, so they agree to the float)."""
    answer = chat(idle_server, max_tokens=2, extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    ids = answer.model_extra["prompt_token_ids"]
    entries = answer.model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    completion = greedy(idle_server, prompt=ids, max_tokens=2, extra_body={"prompt_logprobs": 1})
    assert entries == completion.choices[0].model_extra["prompt_logprobs"]
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token) in entry
    stream = [c for c in chat(idle_server, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})]
    assert [c.model_extra["prompt_logprobs"] for c in stream if c.model_extra.get("prompt_logprobs")] == [entries]


# ---- ids, template arguments and accepted fields ------------------------------------------------------------------


def test_request_id_names_the_answer_and_may_repeat(idle_server):
    first = chat(idle_server, extra_body={"request_id": "job-42"})
    again = greedy(idle_server, max_tokens=2, extra_body={"request_id": "job-42"})
    assert first.id == "chatcmpl-job-42" and again.id == "cmpl-job-42"


def test_reasoning_effort_none_renders_the_prompt_without_thinking(idle_server):
    def prompt_ids(**extra):
        return chat(idle_server, max_tokens=1, extra_body={"return_token_ids": True} | extra).model_extra[
            "prompt_token_ids"
        ]

    off = prompt_ids(chat_template_kwargs={"enable_thinking": False})
    assert off != prompt_ids()
    assert prompt_ids(reasoning_effort="none") == off and prompt_ids(reasoning_effort="minimal") == off
    assert prompt_ids(reasoning_effort="high") == prompt_ids()
    # chat_template_kwargs win over reasoning_effort
    on = {"enable_thinking": True}
    assert prompt_ids(reasoning_effort="none", chat_template_kwargs=on) == prompt_ids(chat_template_kwargs=on)


def test_openai_bookkeeping_fields_are_taken(idle_server):
    answer = chat(idle_server, max_tokens=2, metadata={"team": "eval"}, store=False, service_tier="auto",
                  extra_body={"prompt_cache_key": "k", "safety_identifier": "u1", "cache_salt": "salt",
                              "spaces_between_special_tokens": False, "priority": 0, "documents": [{"text": "x"}]})  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length")


# ---- stop_reason -------------------------------------------------------------------------------------------------


def finishes(server, chat: bool = False, **fields) -> list[tuple[str, int | str | None]]:
    """(finish_reason, stop_reason) of one request answered whole, then streamed (its finishing chunk's). As in
    vLLM, every streamed completions chunk carries stop_reason (null before the finish), and of a streamed chat
    answer's chunks only the finishing one does."""
    client = server.client()
    create = client.chat.completions.create if chat else client.completions.create
    prompt = {"messages": MESSAGES} if chat else {"prompt": PROMPT_IDS}
    fields = {"model": server.model_name, "temperature": 0.0, "max_tokens": 8} | prompt | fields
    whole = create(**fields).choices[0]
    *before, last = [chunk.choices[0] for chunk in create(**fields, stream=True) if chunk.choices]
    if chat:
        assert not any("stop_reason" in choice.model_extra for choice in before)
    else:
        assert all(choice.model_extra["stop_reason"] is None for choice in before)
    return [(choice.finish_reason, choice.model_extra["stop_reason"]) for choice in (whole, last)]


def test_stop_reason_is_the_stop_string_that_ended_the_answer(idle_server):
    full = greedy(idle_server, max_tokens=24).choices[0].text
    stop = next(s for s in (full[i : i + 2] for i in range(2, len(full) - 2)) if "\ufffd" not in s and s.strip())
    absent = "no such stop string"
    assert absent not in full
    for extra in ({"ignore_eos": True}, {"ignore_eos": True, "include_stop_str_in_output": True}):
        assert finishes(idle_server, max_tokens=24, stop=[absent, stop], extra_body=extra) == [("stop", stop)] * 2
    # On chat, a token forced by logit_bias whose text is the stop string.
    word = idle_server.model.tokenizer.decode([300])
    assert finishes(idle_server, chat=True, logit_bias={"300": 100}, stop=[absent, word]) == [("stop", word)] * 2


def test_stop_reason_is_the_stop_token_id(idle_server):
    for chat in (False, True):
        answers = finishes(idle_server, chat=chat, logit_bias={"300": 100}, extra_body={"stop_token_ids": [301, 300]})
        assert answers == [("stop", 300)] * 2, chat
        assert all(type(stop_reason) is int for _, stop_reason in answers)


def test_stop_reason_is_null_at_the_length_limit_and_at_the_end_of_sequence(idle_server):
    eos = idle_server.model.tokenizer.eos_token_id
    for chat in (False, True):
        assert finishes(idle_server, chat=chat, max_tokens=3, extra_body={"ignore_eos": True}) == [("length", None)] * 2
        # The end of sequence is no stop token id even when listed as one: vLLM checks it first.
        ended = finishes(idle_server, chat=chat, logit_bias={str(eos): 100}, extra_body={"stop_token_ids": [eos]})
        assert ended == [("stop", None)] * 2, chat


def test_ping(idle_server):
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{idle_server.root}/ping").status_code == 200


def test_include_reasoning_false_leaves_the_reasoning_out(scripted):
    engine, client, _ = scripted
    engine.answer = "<think>\nLet me see.\n</think>\n\nParis."
    kwargs = {"model": "scripted", "messages": [{"role": "user", "content": "Capital of France?"}]}
    assert client.chat.completions.create(**kwargs).choices[0].message.reasoning_content == "Let me see."
    message = client.chat.completions.create(**kwargs, extra_body={"include_reasoning": False}).choices[0].message
    assert message.content == "Paris." and getattr(message, "reasoning_content", None) is None
    stream = client.chat.completions.create(**kwargs, stream=True, extra_body={"include_reasoning": False})
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Paris."
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
