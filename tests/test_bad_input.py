"""Bad input against the live server: every case gets a 4xx in the OpenAI error shape, a good request still
succeeds right after it, and the engine's pools are full again after each case."""

from __future__ import annotations

import json

import httpx
import pytest

pytest_plugins = ["_server"]

MODEL = "tiny-test"  # the served name in _server.py
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GOOD = {"model": MODEL, "prompt": [10, 11, 12], "max_tokens": 2}
CHAT_GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT_BOMB = "word " * 400  # far more than --max-model-len (128) tokens


def completion(**fields):
    return {k: v for k, v in (GOOD | fields).items() if v is not ...}


def ascii_json(body: dict) -> bytes:
    """The body as JSON with ASCII \\u escapes, which can carry what UTF-8 cannot (lone surrogates)."""
    return json.dumps(body).encode()


def chat(**fields):
    return {k: v for k, v in (CHAT_GOOD | fields).items() if v is not ...}


# (id, method, path, body: dict | bytes | None, extra headers (None: no API key at all), expected status)
CASES = [
    ("malformed-json", "POST", COMPLETIONS, b'{"model": "tiny-test", "prompt": ', {}, 400),
    ("body-not-an-object", "POST", COMPLETIONS, b"[1, 2, 3]", {}, 400),
    ("empty-body", "POST", COMPLETIONS, b"", {}, 400),
    ("nan-literal", "POST", COMPLETIONS, b'{"model": "tiny-test", "prompt": [1], "temperature": NaN}', {}, 400),
    ("prompt-wrong-type", "POST", COMPLETIONS, completion(prompt=5), {}, 400),
    ("prompt-float-ids", "POST", COMPLETIONS, completion(prompt=[1.5, 2.0]), {}, 400),
    # Valid JSON (ASCII \u escapes) whose strings hold lone UTF-16 surrogates, which no tokenizer takes.
    ("prompt-lone-surrogate", "POST", COMPLETIONS, ascii_json(completion(prompt="x\ud800y")), {}, 400),
    ("prompt-list-lone-surrogate", "POST", COMPLETIONS, ascii_json(completion(prompt=["\udc00"])), {}, 400),
    ("prompt-surrogate-streamed", "POST", COMPLETIONS, ascii_json(completion(prompt="\ud800", stream=True)), {}, 400),
    ("chat-lone-surrogate", "POST", CHAT, ascii_json(chat(messages=[{"role": "user", "content": "\ud83d"}])), {}, 400),
    (
        "chat-part-lone-surrogate",
        "POST",
        CHAT,
        ascii_json(chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}])),
        {},
        400,
    ),
    (
        "tool-description-lone-surrogate",
        "POST",
        CHAT,
        ascii_json(chat(tools=[{"type": "function", "function": {"name": "f", "description": "\ud800"}}])),
        {},
        400,
    ),
    (
        "tokenize-messages-lone-surrogate",
        "POST",
        "/tokenize",
        ascii_json({"model": MODEL, "messages": [{"role": "system", "content": "\udc00"}]}),
        {},
        400,
    ),
    ("max-tokens-string", "POST", COMPLETIONS, completion(max_tokens="5"), {}, 400),
    ("max-tokens-bool", "POST", COMPLETIONS, completion(max_tokens=True), {}, 400),
    ("temperature-string", "POST", COMPLETIONS, completion(temperature="hot"), {}, 400),
    ("stream-not-bool", "POST", COMPLETIONS, completion(stream="yes"), {}, 400),
    ("missing-prompt", "POST", COMPLETIONS, completion(prompt=...), {}, 400),
    ("model-null-is-not-a-name", "POST", COMPLETIONS, completion(model=5), {}, 400),
    ("missing-messages", "POST", CHAT, chat(messages=...), {}, 400),
    ("max-tokens-zero-without-echo", "POST", COMPLETIONS, completion(max_tokens=0), {}, 400),
    ("chat-max-tokens-zero", "POST", CHAT, chat(max_tokens=0), {}, 400),
    ("max-tokens-negative", "POST", COMPLETIONS, completion(max_tokens=-5), {}, 400),
    ("max-tokens-huge", "POST", COMPLETIONS, completion(max_tokens=10**9), {}, 400),
    ("max-tokens-astronomic", "POST", COMPLETIONS, completion(max_tokens=10**40), {}, 400),
    ("chat-max-tokens-huge", "POST", CHAT, chat(max_tokens=10**6), {}, 400),
    ("temperature-negative", "POST", COMPLETIONS, completion(temperature=-0.5), {}, 400),
    ("temperature-too-high", "POST", COMPLETIONS, completion(temperature=2.5), {}, 400),
    ("top-p-zero", "POST", COMPLETIONS, completion(top_p=0), {}, 400),
    ("top-p-above-one", "POST", COMPLETIONS, completion(top_p=1.5), {}, 400),
    ("top-k-below-minus-one", "POST", COMPLETIONS, completion(top_k=-2), {}, 400),
    ("min-p-one", "POST", COMPLETIONS, completion(min_p=1.0), {}, 400),
    ("seed-out-of-range", "POST", COMPLETIONS, completion(seed=2**70), {}, 400),
    ("seed-above-int64", "POST", COMPLETIONS, completion(seed=2**63), {}, 400),
    ("seed-below-int64", "POST", COMPLETIONS, completion(seed=-(2**63) - 1), {}, 400),
    ("unknown-model", "POST", COMPLETIONS, completion(model="gpt-4"), {}, 404),
    ("chat-unknown-model", "POST", CHAT, chat(model="nope"), {}, 404),
    ("empty-messages", "POST", CHAT, chat(messages=[]), {}, 400),
    ("bad-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), {}, 400),
    ("message-content-int", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), {}, 400),
    ("message-without-content", "POST", CHAT, chat(messages=[{"role": "user"}]), {}, 400),
    (
        "image-content-part",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        {},
        400,
    ),
    ("prompt-ids-over-max-model-len", "POST", COMPLETIONS, completion(prompt=[7] * 200), {}, 400),
    ("text-prompt-over-max-model-len", "POST", COMPLETIONS, completion(prompt=TEXT_BOMB), {}, 400),
    ("chat-over-max-model-len", "POST", CHAT, chat(messages=[{"role": "user", "content": TEXT_BOMB}]), {}, 400),
    ("huge-body", "POST", COMPLETIONS, b'{"model": "tiny-test", "prompt": "' + b"a" * (5 << 20) + b'"}', {}, 413),
    ("token-id-outside-vocab", "POST", COMPLETIONS, completion(prompt=[1, 2, 10**6]), {}, 400),
    ("token-id-negative", "POST", COMPLETIONS, completion(prompt=[1, -3]), {}, 400),
    ("empty-token-list", "POST", COMPLETIONS, completion(prompt=[]), {}, 400),
    ("empty-text-prompt", "POST", COMPLETIONS, completion(prompt=""), {}, 400),
    ("prompts-with-an-empty-one", "POST", COMPLETIONS, completion(prompt=["a", ""]), {}, 400),
    ("prompt-batch-empty", "POST", COMPLETIONS, completion(prompt=[[]]), {}, 400),
    ("wrong-api-key", "POST", COMPLETIONS, completion(), {"Authorization": "Bearer wrong"}, 401),
    ("missing-api-key", "POST", COMPLETIONS, completion(), None, 401),
    ("models-without-key", "GET", "/v1/models", None, None, 401),
    ("n-0", "POST", COMPLETIONS, completion(n=0), {}, 400),
    ("chat-n-too-many", "POST", CHAT, chat(n=10**4), {}, 400),
    ("n-beyond-the-queue", "POST", COMPLETIONS, completion(n=128), {}, 429),
    ("echo-logprobs-21", "POST", COMPLETIONS, completion(echo=True, logprobs=21), {}, 400),
    ("prompt-logprobs-21", "POST", COMPLETIONS, completion(prompt_logprobs=21), {}, 400),
    ("prompt-logprobs-negative", "POST", COMPLETIONS, completion(prompt_logprobs=-1), {}, 400),
    ("chat-prompt-logprobs-above-20", "POST", CHAT, chat(prompt_logprobs=21), {}, 400),
    ("chat-echo-not-bool", "POST", CHAT, chat(echo="yes"), {}, 400),
    ("chat-reasoning-effort-unknown", "POST", CHAT, chat(reasoning_effort="max"), {}, 400),
    ("allowed-token-ids-outside-vocabulary", "POST", COMPLETIONS, completion(allowed_token_ids=[-1]), {}, 400),
    ("bad-words-not-strings", "POST", COMPLETIONS, completion(bad_words=[1]), {}, 400),
    ("metadata-not-strings", "POST", CHAT, chat(metadata={"a": 1}), {}, 400),
    ("best-of", "POST", COMPLETIONS, completion(best_of=3), {}, 400),
    ("suffix", "POST", COMPLETIONS, completion(suffix="end"), {}, 400),
    ("presence-penalty-above-2", "POST", COMPLETIONS, completion(presence_penalty=2.5), {}, 400),
    ("frequency-penalty-below-minus-2", "POST", CHAT, chat(frequency_penalty=-3.0), {}, 400),
    ("repetition-penalty-zero", "POST", COMPLETIONS, completion(repetition_penalty=0), {}, 400),
    ("repetition-penalty-negative", "POST", CHAT, chat(repetition_penalty=-1.0), {}, 400),
    (
        "repetition-penalty-infinite",
        "POST",
        COMPLETIONS,
        b'{"model": "tiny-test", "prompt": [1], "repetition_penalty": Infinity}',
        {},
        400,
    ),
    ("logit-bias-not-an-id", "POST", COMPLETIONS, completion(logit_bias={"abc": 10}), {}, 400),
    ("logit-bias-outside-vocab", "POST", COMPLETIONS, completion(logit_bias={"999999": 10}), {}, 400),
    ("logit-bias-above-100", "POST", CHAT, chat(logit_bias={"5": 101}), {}, 400),
    ("logit-bias-too-many", "POST", COMPLETIONS, completion(logit_bias={str(i): 1 for i in range(300)}), {}, 400),
    ("unknown-field", "POST", COMPLETIONS, completion(frobnicate=True), {}, 400),
    ("modalities-audio", "POST", CHAT, chat(modalities=["text", "audio"]), {}, 400),
    ("audio-output", "POST", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), {}, 400),
    (
        "refusal-part-in-a-user-message",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]),
        {},
        400,
    ),
    ("completion-logprobs-21", "POST", COMPLETIONS, completion(logprobs=21), {}, 400),
    ("top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=3), {}, 400),
    ("top-logprobs-30", "POST", CHAT, chat(logprobs=True, top_logprobs=30), {}, 400),
    ("tool-without-name", "POST", CHAT, chat(tools=[{"type": "function", "function": {}}]), {}, 400),
    ("tools-not-a-list", "POST", CHAT, chat(tools={"type": "function"}), {}, 400),
    ("tool-choice-required", "POST", CHAT, chat(tool_choice="required"), {}, 400),
    ("response-format-unknown-type", "POST", CHAT, chat(response_format={"type": "regex"}), {}, 400),
    (
        "response-format-bad-schema",
        "POST",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}),
        {},
        400,
    ),
    (
        "response-format-schema-not-an-object",
        "POST",
        COMPLETIONS,
        completion(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
        {},
        400,
    ),
    (
        "response-format-with-forced-tool-call",
        "POST",
        CHAT,
        chat(
            response_format={"type": "json_object"},
            tool_choice="required",
            tools=[{"type": "function", "function": {"name": "f"}}],
        ),
        {},
        400,
    ),
    ("too-many-stop-strings", "POST", COMPLETIONS, completion(stop=[f"s{i}" for i in range(17)]), {}, 400),
    ("empty-stop-string", "POST", COMPLETIONS, completion(stop=""), {}, 400),
    ("stop-token-id-outside-vocab", "POST", COMPLETIONS, completion(stop_token_ids=[5, 100000]), {}, 400),
    ("stream-options-without-stream", "POST", COMPLETIONS, completion(stream_options={"include_usage": True}), {}, 400),
    ("template-kwargs-override-messages", "POST", CHAT, chat(chat_template_kwargs={"messages": []}), {}, 400),
    ("unknown-route", "POST", "/v1/embeddings", {"model": MODEL, "input": "x"}, {}, 404),
    ("wrong-method", "GET", COMPLETIONS, None, {}, 405),
]


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.root, timeout=60) as client:
        yield client


def send(http, server, method, path, body, headers):
    all_headers = {} if headers is None else server.headers() | headers
    if isinstance(body, dict):
        return http.request(method, path, json=body, headers=all_headers)
    if isinstance(body, bytes):
        return http.request(method, path, content=body, headers=all_headers | {"Content-Type": "application/json"})
    return http.request(method, path, headers=all_headers)


@pytest.mark.parametrize(("method", "path", "body", "headers", "status"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_input_gets_a_4xx_in_the_openai_shape(idle_server, http, method, path, body, headers, status):
    response = send(http, idle_server, method, path, body, headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    good = send(http, idle_server, "POST", COMPLETIONS, GOOD, {})
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] >= 1


def test_the_matrix_is_large_enough():
    assert len(CASES) >= 25


def test_errors_name_the_param(idle_server, http):
    expectations = {
        "temperature": completion(temperature=9),
        "max_tokens": completion(max_tokens=10**6),
        "n": completion(n=0),
        "frobnicate": completion(frobnicate=1),
        "model": completion(model="other"),
        "prompt": completion(prompt=[10**6]),
    }
    for param, body in expectations.items():
        error = send(http, idle_server, "POST", COMPLETIONS, body, {}).json()["error"]
        assert error["param"] == param, error


def test_errors_name_the_param_the_client_sent(idle_server, http):
    """The chat's newer max_completion_tokens is named as sent; a /tokenize body of neither form names both forms'
    parameters (not the server's class names)."""
    error = send(http, idle_server, "POST", CHAT, chat(max_completion_tokens=10**6), {}).json()["error"]
    assert error["param"] == "max_completion_tokens" and error["code"] == "context_length_exceeded", error
    error = send(http, idle_server, "POST", "/tokenize", {"model": MODEL}, {}).json()["error"]
    assert "'prompt'" in error["message"] and "'messages'" in error["message"], error
    assert "Request" not in error["message"] and error["param"] is None, error


def test_prompt_over_max_model_len_gives_both_numbers(idle_server, http):
    response = send(http, idle_server, "POST", COMPLETIONS, completion(prompt=[7] * 200), {})
    message = response.json()["error"]["message"]
    assert "200" in message and str(idle_server.max_model_len) in message


def test_prompt_plus_max_tokens_over_max_model_len_gives_the_numbers(idle_server, http):
    response = send(http, idle_server, "POST", COMPLETIONS, completion(prompt=[7] * 100, max_tokens=50), {})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "100" in message and "50" in message and str(idle_server.max_model_len) in message


def test_accepted_harmless_and_neutral_params(idle_server, http):
    """What OpenAI clients send by default must pass: neutral values of unsupported features, `user`."""
    body = completion(n=1, best_of=1, echo=False, presence_penalty=0.0, frequency_penalty=0, logit_bias={},
                      user="someone", top_k=-1, stop=None, repetition_penalty=1)  # fmt: skip
    assert send(http, idle_server, "POST", COMPLETIONS, body, {}).status_code == 200
    body = chat(n=1, tool_choice="none", response_format={"type": "text"}, parallel_tool_calls=False,
                messages=[{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "yo", "refusal": None, "annotations": []},
                          {"role": "user", "content": "again"}])  # fmt: skip
    assert send(http, idle_server, "POST", CHAT, body, {}).status_code == 200


def test_a_null_parameter_is_its_default(idle_server, http):
    """Generated clients send every optional field, null when unset: null is the default, for every type."""
    body = completion(stream=None, ignore_eos=None, min_tokens=None, echo=None, skip_special_tokens=None,
                      include_stop_str_in_output=None, priority=None, seed=None, logprobs=None)  # fmt: skip
    response = send(http, idle_server, "POST", COMPLETIONS, body, {})
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "text_completion"  # stream null: not a stream
    body = chat(stream=None, echo=None, add_generation_prompt=None, modalities=None, audio=None, prediction=None,
                stream_options=None, tools=None, tool_choice=None)  # fmt: skip
    assert send(http, idle_server, "POST", CHAT, body, {}).status_code == 200


def test_clients_neutral_and_hint_fields_pass(idle_server, http):
    """OpenAI's text-only modalities, caching hints on parts and requests, vLLM's grammar-backend name, and an
    assistant's refusal part echoed back in the history."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
                {"role": "user", "content": "again"}]  # fmt: skip
    body = chat(messages=messages, modalities=["text"], prompt_cache_retention="24h",
                guided_decoding_backend="xgrammar")  # fmt: skip
    response = send(http, idle_server, "POST", CHAT, body, {})
    assert response.status_code == 200, response.text
    rendered = send(http, idle_server, "POST", "/tokenize", {"model": MODEL, "messages": messages}, {}).json()
    plain = [messages[0] | {"content": "hi"}, {"role": "assistant", "content": "I cannot."}, messages[2]]
    assert rendered["tokens"] == send(http, idle_server, "POST", "/tokenize", {"model": MODEL, "messages": plain},
                                      {}).json()["tokens"]  # fmt: skip


def test_a_lone_surrogate_in_a_conversation_names_where_it_is(idle_server, http):
    body = ascii_json(chat(messages=[{"role": "user", "content": "ok"},
                                     {"role": "user", "content": [{"type": "text", "text": "x"},
                                                                  {"type": "text", "text": "\ud83d!"}]}]))  # fmt: skip
    error = send(http, idle_server, "POST", CHAT, body, {}).json()["error"]
    assert error["param"] == "messages[1].content[1].text" and "surrogate" in error["message"], error


@pytest.mark.parametrize("path, body", [(COMPLETIONS, completion(model=...)), (CHAT, chat(model=...))],
                         ids=["completions", "chat"])  # fmt: skip
def test_an_omitted_model_means_the_served_one(idle_server, http, path, body):
    response = send(http, idle_server, "POST", path, body, {})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL


def test_pools_are_full_after_the_matrix(idle_server):
    state = idle_server.wait_idle()
    assert not any(state.values()), state
    pages, slots = idle_server.engine.scheduler.page_pool, idle_server.engine.scheduler.slot_pool
    assert pages.num_free == pages.num_total and slots.num_free == slots.num_total


def test_health_and_metrics_need_no_key(live_server):
    assert httpx.get(f"{live_server.root}/health").status_code == 200
    assert httpx.get(f"{live_server.root}/metrics").status_code == 200
    json.loads(httpx.get(f"{live_server.root}/openapi.json").text)


def test_prompt_logprobs_are_a_400_on_a_server_without_their_programs(live_server):
    """A server started without --prompt-logprobs-chunk: echo with logprobs and prompt_logprobs get a 400 that
    names the parameter and the flag; echo alone works."""
    import asyncio
    import dataclasses

    from qwen35_jax.serving import protocol as api
    from qwen35_jax.serving.errors import APIError
    from qwen35_jax.serving.prompts import RequestPreparer

    config = dataclasses.replace(live_server.server.config, prompt_logprobs=False)
    preparer = RequestPreparer(live_server.engine, live_server.model.tokenizer, config)
    for fields, param in ((dict(echo=True, logprobs=0), "logprobs"), (dict(prompt_logprobs=1), "prompt_logprobs")):
        with pytest.raises(APIError) as caught:
            asyncio.run(preparer.completion(api.CompletionRequest(prompt="hi", **fields)))
        assert caught.value.status == 400 and caught.value.param == param
        assert "--prompt-logprobs-chunk" in caught.value.message
    (choice,) = asyncio.run(preparer.completion(api.CompletionRequest(prompt="hi", echo=True)))
    assert choice.echo.text == "hi" and choice.params.prompt_logprobs is None
