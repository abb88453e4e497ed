"""The vLLM utility routes beside the OpenAI API, on the live tiny server: `/tokenize` (a prompt, or a conversation
through the chat template), `/detokenize`, `/version`, retrieving the served model (`GET /v1/models/{id}`), and
vLLM's chat parameters `add_generation_prompt` and `continue_final_message`."""

from __future__ import annotations

import httpx
import openai
import pytest

pytest_plugins = ["_server"]

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.root}{path}", json=body, timeout=60)


def test_tokenize_a_prompt_gives_the_tokenizers_ids(idle_server):
    tokenizer = idle_server.model.tokenizer
    text = "Hello there, tokenizer! ünïcode 123"
    response = post(idle_server, "/tokenize", {"model": idle_server.model_name, "prompt": text})
    assert response.status_code == 200
    body = response.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == idle_server.max_model_len and body["token_strs"] is None


def test_token_strs_are_the_vocabulary_entries(idle_server):
    backend = idle_server.model.tokenizer.backend
    body = post(idle_server, "/tokenize", {"prompt": "Hello there", "return_token_strs": True}).json()
    assert body["token_strs"] == [backend.id_to_token(i) for i in body["tokens"]]


def test_tokenize_a_conversation_counts_what_a_chat_completion_prefills(idle_server):
    """The chat form renders the template as /v1/chat/completions does: its count is that answer's prompt_tokens."""
    body = post(idle_server, "/tokenize", {"messages": MESSAGES}).json()
    answer = idle_server.client().chat.completions.create(model=idle_server.model_name, messages=MESSAGES,
                                                          max_tokens=1, temperature=0.0)  # fmt: skip
    assert body["count"] == answer.usage.prompt_tokens
    plain = post(idle_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert plain["count"] < body["count"] and body["tokens"][: plain["count"]] == plain["tokens"]


def test_detokenize_inverts_tokenize(idle_server):
    text = "Round trip: <think> tags, spaces  and ünïcode."
    tokens = post(idle_server, "/tokenize", {"prompt": text}).json()["tokens"]
    response = post(idle_server, "/detokenize", {"model": idle_server.model_name, "tokens": tokens})
    assert response.status_code == 200 and response.json() == {"prompt": text}


CONTINUED = [*MESSAGES, {"role": "assistant", "content": "Hello, I am"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def test_continue_final_message_continues_the_answer(idle_server):
    """The chat answer continues the client's partial assistant message: the same greedy tokens as a completion of
    the conversation rendered and cut after that message's text (/tokenize's tokens)."""
    tokens = post(idle_server, "/tokenize", {"messages": CONTINUED, **CONTINUE}).json()["tokens"]
    assert (
        post(idle_server, "/detokenize", {"tokens": tokens})
        .json()["prompt"]
        .endswith("<|im_start|>assistant\nHello, I am")
    )
    client = idle_server.client()
    chat = client.chat.completions.create(model=idle_server.model_name, messages=CONTINUED, max_tokens=8,
                                          temperature=0.0, logprobs=True, extra_body=CONTINUE)  # fmt: skip
    completion = client.completions.create(model=idle_server.model_name, prompt=tokens, max_tokens=8, temperature=0.0,
                                           logprobs=0)  # fmt: skip
    assert chat.usage.prompt_tokens == len(tokens)
    assert [t.token for t in chat.choices[0].logprobs.content] == completion.choices[0].logprobs.tokens


def test_add_generation_prompt_false_ends_the_prompt_after_the_last_turn(idle_server):
    client = idle_server.client()
    chat = client.chat.completions.create(model=idle_server.model_name, messages=MESSAGES, max_tokens=1,
                                          extra_body={"add_generation_prompt": False})  # fmt: skip
    plain = post(idle_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert chat.usage.prompt_tokens == plain["count"]


@pytest.mark.parametrize(
    "extra",
    [{"continue_final_message": True}, {**CONTINUE, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     {**CONTINUE, "response_format": {"type": "json_object"}}],
)  # fmt: skip
def test_continue_final_message_refuses_what_it_cannot_continue(idle_server, extra):
    with pytest.raises(openai.BadRequestError) as refused:
        idle_server.client().chat.completions.create(model=idle_server.model_name, messages=CONTINUED, max_tokens=2,
                                                     extra_body=extra)  # fmt: skip
    assert refused.value.body["param"] == "continue_final_message"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
        ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, None),
        ("/tokenize", {"prompt": 5}, 400, None),
        ("/tokenize", {"messages": []}, 400, None),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
        ("/tokenize", {"messages": CONTINUED, "continue_final_message": True}, 400, "continue_final_message"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, None),
        ("/detokenize", {"tokens": "abc"}, 400, None),
    ],
)
def test_bad_tokenization_requests_get_a_4xx_in_the_openai_shape(idle_server, path, body, status, param):
    response = post(idle_server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_version_and_the_served_model_card(idle_server):
    version = httpx.get(f"{idle_server.root}/version").json()["version"]
    assert isinstance(version, str) and version
    client = idle_server.client()
    card = client.models.retrieve(idle_server.model_name)
    assert card.id == idle_server.model_name and card.object == "model"
    assert card == client.models.list().data[0]
    extra = card.model_extra  # vLLM's fields beside OpenAI's
    assert extra["max_model_len"] == idle_server.max_model_len and extra["root"] and extra["parent"] is None
    assert extra["permission"][0]["object"] == "model_permission" and extra["permission"][0]["allow_sampling"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
