"""Structured output (`response_format`): the packed token mask and its layout, the sampler under a mask, the
grammar state, the engine's handling of grammar requests (each waits for its token; the others keep the
one-step-late pipeline), and the API through the official `openai` client against real uvicorn on the tiny
model: JSON objects and schema-valid answers, streamed and not, beside an unconstrained request whose output
stays what it is alone.

The tiny model has random weights. Unconstrained, it writes noise that no JSON parser takes (each test of an
answer under a grammar has that counterpart), so a valid answer shows the mask at work.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import json
import re

import jax
import jsonschema
import llguidance
import numpy as np
import pytest

from qwen35_jax.sampling import SamplingParams
from qwen35_jax.serving import device_sampling
from qwen35_jax.serving.device_sampling import SamplingRows, pack_mask, unpack_mask
from qwen35_jax.serving.engine import GenerationParams, SamplingRow
from qwen35_jax.serving.parsers import OutputParser, tool_call_grammar
from qwen35_jax.serving.structured_output import GrammarCompiler, GrammarError, GrammarState
from qwen35_jax.tokenizer import Tokenizer

pytest_plugins = ["_server"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
# The tiny model's greedy answer to this prompt closes a free JSON object within 70 tokens (to others it may
# not: a random model can write one string until max_tokens).
JSON_MESSAGES = [{"role": "user", "content": "Give me JSON."}]
TINY_EOS = (2, 0)  # the tiny model's eos_token_ids: <|im_end|>, <|endoftext|>
ENGINE = dict(max_batch=4, max_prefill_tokens=16, max_model_len=128)  # _server.py's limits: step programs are shared


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(Tokenizer.tiny(), 512, TINY_EOS)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def allowed_tokens(words: np.ndarray, vocab: int = 512) -> set[int]:
    return set(np.nonzero(np.asarray(unpack_mask(np.asarray(words)[None], vocab))[0])[0].tolist())


# ---- the mask ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [300, 512])
def test_unpack_mask_inverts_pack_mask(vocab):
    allowed = np.random.default_rng(vocab).random((3, vocab)) < 0.3
    words = pack_mask(allowed)
    assert words.shape == (3, -(-vocab // 32)) and words.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(unpack_mask(words, vocab)), allowed)
    assert (pack_mask(np.ones((1, 512), bool)) == -1).all()  # every bit set: the runner's no-grammar rows


def test_the_layout_is_the_one_llguidance_writes(compiler):
    """The mask llguidance fills equals pack_mask of the tokens the matcher takes one by one, mid-document."""
    state = compiler.json_schema(PERSON).start()
    tokenizer = Tokenizer.tiny()
    for token in tokenizer.encode('{"name": "ab'):
        assert state.accept(token)
    matcher = llguidance.LLMatcher(compiler.tokenizer, llguidance.LLMatcher.grammar_from_json_schema(
        PERSON, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))  # fmt: skip
    assert matcher.consume_tokens(tokenizer.encode('{"name": "ab'))
    takes = np.array([matcher.validate_tokens([t]) == 1 for t in range(512)])
    assert 1 < takes.sum() < 512
    np.testing.assert_array_equal(state.mask, pack_mask(takes))


def rows_with_masks(temperatures: list[float], masks: list[set[int] | None], vocab: int) -> SamplingRows:
    words = device_sampling.mask_words(vocab)
    allowed = np.full((len(masks), words), -1, np.int32)
    for i, mask in enumerate(masks):
        if mask is not None:
            allowed[i] = pack_mask(np.isin(np.arange(vocab), sorted(mask)))
    return SamplingRows.from_rows([SamplingRow(t, 0, 1.0, 0.0, i, 0) for i, t in enumerate(temperatures)],
                                  len(masks), allowed)  # fmt: skip


def test_the_sampler_picks_inside_the_mask_and_reports_the_models_logprobs():
    vocab = 300
    logits = (np.random.default_rng(0).standard_normal((5, vocab)) * 3).astype(np.float32)
    argmax = np.argmax(logits, axis=-1)
    # Masks that leave out each row's argmax, so the unmasked pick would fall outside them.
    masks = [{5, 17}, {int(argmax[1] + 1) % vocab}, None, set(range(0, vocab, 3)) - {int(argmax[3])}, None]
    rows = rows_with_masks([0.0, 1.0, 0.0, 1.0, 1.0], masks, vocab)
    tokens, chosen = (np.asarray(x) for x in jax.jit(device_sampling.resample)(logits, rows, argmax.astype(np.int32)))
    assert tokens[0] == max((5, 17), key=lambda t: logits[0, t]) and tokens[1] == (argmax[1] + 1) % vocab
    assert tokens[2] == argmax[2] and tokens[3] in masks[3]
    for i, mask in enumerate(masks):
        if mask is not None:
            assert argmax[i] not in mask and tokens[i] in mask
    log_softmax = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    np.testing.assert_allclose(chosen, np.asarray(log_softmax)[np.arange(5), tokens], atol=1e-5)


def test_a_repetition_penalty_moves_the_pick_inside_the_mask():
    """vLLM's order: the repetition penalty (then presence/frequency and logit_bias) shapes the logits and the mask
    keeps only the grammar's tokens of what they made. Token 4 is the best overall but outside the mask; token 1,
    the best inside it, is in the prompt, and a penalty of 2 halves it below token 2."""
    vocab = 300
    logits = np.zeros((3, vocab), np.float32)
    logits[:, 4], logits[:, 1], logits[:, 2], logits[:, 3] = 10.0, 5.0, 4.0, 3.0
    words = device_sampling.mask_words(vocab)
    allowed = np.full((3, words), -1, np.int32)
    allowed[:] = pack_mask(np.isin(np.arange(vocab), [1, 2, 3]))
    rows = SamplingRows.from_rows([SamplingRow(0.0, 0, 1.0, 0.0, 0, 0, repetition_penalty=2.0),
                                   SamplingRow(0.0, 0, 1.0, 0.0, 0, 0),
                                   SamplingRow(0.0, 0, 1.0, 0.0, 0, 0, repetition_penalty=2.0)], 3, allowed)  # fmt: skip
    in_prompt = np.zeros((3, vocab), bool)
    in_prompt[:2, 1] = True  # row 2's prompt holds only the masked-out token 4, whose penalty changes nothing
    in_prompt[2, 4] = True
    counts = np.zeros((3, vocab), np.int32)
    tokens, chosen = (np.asarray(x) for x in jax.jit(device_sampling.resample)(
        logits, rows, np.full(3, 4, np.int32), counts, in_prompt))  # fmt: skip
    assert tokens.tolist() == [2, 1, 1]
    log_softmax = np.asarray(logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    np.testing.assert_allclose(chosen, log_softmax[np.arange(3), tokens], atol=1e-5)  # the model's logprobs


# ---- the grammar state ---------------------------------------------------------------------------------


def test_a_state_walks_a_document_to_its_end(compiler):
    grammar = compiler.json_schema(PERSON)
    state, other = grammar.start(), grammar.start()
    assert allowed_tokens(state.mask) == {Tokenizer.tiny().token_id("{")}
    for token in Tokenizer.tiny().encode('{"name": "ada", "age": 36, "ok": true}'):
        assert not state.finished and token in allowed_tokens(state.mask)
        assert state.accept(token)
    assert state.finished and state.error is None
    assert allowed_tokens(other.mask) == {Tokenizer.tiny().token_id("{")}  # a start of its own, not advanced


def test_a_state_refuses_a_token_outside_its_mask(compiler):
    state = compiler.json_schema(PERSON).start()
    refused = next(t for t in range(3, 512) if t not in allowed_tokens(state.mask))
    assert not state.accept(refused) and state.error


def test_eos_is_allowed_exactly_when_the_grammar_accepts(compiler):
    state = compiler.json_schema({"type": "integer"}).start()
    assert not set(TINY_EOS) & allowed_tokens(state.mask)
    assert state.accept(Tokenizer.tiny().encode("7")[0])
    assert set(TINY_EOS) <= allowed_tokens(state.mask) and not state.finished
    assert state.accept(TINY_EOS[0]) and state.finished


@pytest.mark.parametrize("schema, words", [
    ({"type": "objekt"}, "objekt"),
    ({"type": "string", "pattern": "("}, "regex"),
    ({"$ref": "#/definitions/missing"}, "missing"),
    ({"type": "string", "format": "no-such-format"}, "format"),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "."),  # compiles, but cannot start
    ({"type": "integer", "minimum": 5, "maximum": 1}, "Unsatisfiable"),
], ids=["type", "pattern", "ref", "format", "only-itself", "unsatisfiable"])  # fmt: skip
def test_schemas_that_cannot_compile_raise_grammar_error(compiler, schema, words):
    with pytest.raises(GrammarError, match=words):
        compiler.json_schema(schema)


# ---- the engine ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(engines, tiny_model):
    engine = engines.build(tiny_model, **ENGINE)
    yield engine
    engines.release(engine)


class Outputs:
    def __init__(self):
        self.by_id = collections.defaultdict(list)

    def __call__(self, output):
        self.by_id[output.request_id].append(output)

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.by_id[request_id] for t in o.token_ids]

    def text(self, request_id: str) -> str:
        return "".join(o.text for o in self.by_id[request_id])

    def finish(self, request_id: str) -> str:
        return self.by_id[request_id][-1].finish_reason


def run(engine, requests: dict[str, tuple[list[int], GenerationParams]]) -> Outputs:
    outputs = Outputs()
    for request_id, (prompt_ids, params) in requests.items():
        engine.submit(prompt_ids, params, outputs, request_id)
    engine.run_until_done()
    return outputs


def sampling_ids(plan) -> list[str]:
    """Requests whose token the step samples: decode rows and prompts' last chunks."""
    return [row.request_id for row in plan.decode] + [c.request_id for c in plan.prefill if c.is_last]


def test_a_grammar_request_waits_for_each_token_and_the_others_keep_their_pace(engine, tiny_model, compiler,
                                                                                monkeypatch):  # fmt: skip
    prompt = tiny_model.tokenizer.encode_chat(JSON_MESSAGES)
    free = GenerationParams(max_tokens=40, ignore_eos=True)
    alone = run(engine, {"free": (prompt, free)}).tokens("free")
    plans = []
    launch = engine.runner.launch
    monkeypatch.setattr(engine.runner, "launch", lambda plan, sampling: plans.append(plan) or launch(plan, sampling))
    grammar = GrammarCompiler(tiny_model.tokenizer, tiny_model.config.vocab_size, engine.eos_token_ids)
    outputs = run(engine, {"free": (prompt, free),
                           "json": (prompt, GenerationParams(max_tokens=40, grammar=grammar.json_schema(PERSON)))})  # fmt: skip
    assert outputs.tokens("free") == alone
    assert outputs.finish("json") == "stop"
    jsonschema.validate(json.loads(outputs.text("json")), PERSON)
    # By step id: an idle step (the grammar request alone, waiting for its token) launches nothing.
    with_json = [plan.step_id for plan in plans if "json" in sampling_ids(plan)]
    assert len(with_json) == len(outputs.tokens("json"))
    assert all(later - earlier >= 2 for earlier, later in itertools.pairwise(with_json))  # never two steps in a row
    with_free = [plan.step_id for plan in plans if "free" in sampling_ids(plan)]
    assert with_free == list(range(with_free[0], with_free[0] + len(alone)))  # a row in every step, as alone
    # Without its grammar the same request writes no JSON.
    assert not is_json(run(engine, {"plain": (prompt, GenerationParams(max_tokens=40))}).text("plain"))


def test_an_accepting_grammar_lets_eos_end_the_answer(engine, tiny_model):
    """+100 on EOS: the grammar holds it back until the integer has a digit, then the answer ends on it."""
    grammar = GrammarCompiler(tiny_model.tokenizer, tiny_model.config.vocab_size, engine.eos_token_ids)
    prompt = tiny_model.tokenizer.encode_chat(JSON_MESSAGES)
    bias = SamplingParams(logit_bias=((TINY_EOS[0], 100.0),))
    outputs = run(engine, {"int": (prompt, GenerationParams(12, bias, grammar=grammar.json_schema({"type": "integer"}))),
                           "plain": (prompt, GenerationParams(12, bias))})  # fmt: skip
    assert outputs.finish("int") == "stop" and outputs.tokens("int")[-1] == TINY_EOS[0]
    assert isinstance(json.loads(outputs.text("int")), int) and 2 <= len(outputs.tokens("int")) <= 3
    assert outputs.tokens("plain") == [TINY_EOS[0]] and outputs.text("plain") == ""  # unmasked, EOS comes first


def test_max_tokens_cuts_a_grammar_answer(engine, tiny_model):
    grammar = GrammarCompiler(tiny_model.tokenizer, tiny_model.config.vocab_size, engine.eos_token_ids)
    prompt = tiny_model.tokenizer.encode_chat(JSON_MESSAGES)
    outputs = run(engine, {"cut": (prompt, GenerationParams(4, grammar=grammar.json_schema(PERSON)))})
    assert outputs.finish("cut") == "length" and len(outputs.tokens("cut")) == 4
    assert outputs.text("cut").startswith('{"') and not is_json(outputs.text("cut"))


def test_a_failing_grammar_fails_only_its_request(engine, tiny_model, monkeypatch):
    grammar = GrammarCompiler(tiny_model.tokenizer, tiny_model.config.vocab_size, engine.eos_token_ids)
    prompt = tiny_model.tokenizer.encode_chat(JSON_MESSAGES)
    accept = GrammarState.accept
    # What a matcher that hits one of its limits does: it refuses the token. <|im_start|> never fits in JSON.
    monkeypatch.setattr(GrammarState, "accept", lambda self, token: accept(self, 1))
    outputs = run(engine, {"json": (prompt, GenerationParams(8, grammar=grammar.json_object())),
                           "free": (prompt, GenerationParams(8, ignore_eos=True))})  # fmt: skip
    assert outputs.finish("json") == "error" and "response_format" in outputs.by_id["json"][-1].error
    assert outputs.by_id["json"][-1].error_param == "response_format"  # the request's fault: a 400 below
    assert outputs.finish("free") == "length" and len(outputs.tokens("free")) == 8


def test_a_grammar_failure_answers_a_400_naming_response_format_and_an_engine_failure_a_500():
    from qwen35_jax.serving.engine import RequestOutput
    from qwen35_jax.serving.responses import finish_error

    grammar = finish_error(RequestOutput("r", [], "", None, finish_reason="error", error="dead end",
                                         error_param="response_format"))  # fmt: skip
    assert (grammar.status, grammar.param, grammar.message) == (400, "response_format", "dead end")
    engine = finish_error(RequestOutput("r", [], "", None, finish_reason="error", error="step failed"))
    assert (engine.status, engine.param) == (500, None)


# ---- the API ---------------------------------------------------------------------------------------------


def chat(server, **fields):
    request = {"model": server.model_name, "messages": JSON_MESSAGES, "temperature": 0.0, "max_tokens": 80} | fields
    return server.client().chat.completions.create(**request)


def streamed_text(stream) -> tuple[str, str]:
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate(idle_server, stream, temperature):
    reply = chat(idle_server, response_format=PERSON_FORMAT, temperature=temperature, seed=3, stream=stream)
    text, finish = streamed_text(reply) if stream else (reply.choices[0].message.content,
                                                        reply.choices[0].finish_reason)  # fmt: skip
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    plain = chat(idle_server, temperature=temperature, seed=3).choices[0].message.content
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(plain), PERSON)


def test_json_object_answers_parse(idle_server):
    reply = chat(idle_server, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert not is_json(chat(idle_server).choices[0].message.content)
    choices = chat(idle_server, response_format=PERSON_FORMAT, n=3, temperature=1.0, seed=11).choices
    for choice in choices:  # each choice walks a grammar of its own
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({c.message.content for c in choices}) > 1


def test_completions_take_response_format(idle_server):
    client = idle_server.client()
    fields = dict(model=idle_server.model_name, prompt="A person:", max_tokens=60, temperature=0.0)
    reply = client.completions.create(**fields, extra_body={"response_format": PERSON_FORMAT})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), PERSON)
    assert not is_json(client.completions.create(**fields).choices[0].text)


def test_a_repetition_penalty_and_echo_beside_a_json_schema(idle_server):
    """repetition_penalty (its prompt mask and the grammar's token mask in one sampler program) with a json_schema
    still gives valid JSON, on chat and on completions with echo and logprobs (the prompt scored in
    prompt-logprobs steps, its last chunk's token picked under the grammar; the text starts with the prompt)."""
    reply = chat(idle_server, response_format=PERSON_FORMAT, extra_body={"repetition_penalty": 1.5})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    prompt = "A person: " * 3  # more than one 16-token prompt-logprobs chunk
    reply = idle_server.client().completions.create(
        model=idle_server.model_name, prompt=prompt, max_tokens=60, temperature=0.0, echo=True, logprobs=1,
        extra_body={"response_format": PERSON_FORMAT, "repetition_penalty": 1.5})  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.text.startswith(prompt)
    jsonschema.validate(json.loads(choice.text.removeprefix(prompt)), PERSON)
    num_prompt = reply.usage.prompt_tokens
    assert num_prompt > 16 and choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == num_prompt + reply.usage.completion_tokens
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])


def test_an_unconstrained_request_beside_structured_ones_is_unchanged(idle_server):
    client = idle_server.client()
    fields = dict(model=idle_server.model_name, prompt=[17, 230, 45, 301, 99], max_tokens=48, temperature=0.0,
                  logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
    alone = client.completions.create(**fields).choices[0]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        structured = [pool.submit(chat, idle_server, response_format=fmt, stream=True)
                      for fmt in (PERSON_FORMAT, {"type": "json_object"})]  # fmt: skip
        beside = pool.submit(client.completions.create, **fields).result().choices[0]
        answers = [streamed_text(future.result()) for future in structured]
    assert beside.text == alone.text
    np.testing.assert_allclose(beside.logprobs.token_logprobs, alone.logprobs.token_logprobs, atol=2e-4)
    assert all(finish == "stop" and is_json(text) for text, finish in answers)


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}, "objekt"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}}, "regex"),
    ({"type": "json_schema"}, "needs a json_schema"),
    ({"type": "json_object", "json_schema": {"name": "x", "schema": {}}}, "only allowed"),
    ({"type": "regex"}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "name"),
], ids=["bad-type", "bad-pattern", "no-schema", "schema-on-object", "unknown-type", "no-name"])  # fmt: skip
def test_bad_response_formats_get_a_400_naming_it(idle_server, response_format, words):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        chat(idle_server, response_format=response_format)
    error = caught.value.body
    assert error["param"].startswith("response_format") and words in error["message"], error


# ---- vLLM's structured_outputs and its guided_* names --------------------------------------------------------

SQL = 'start: "SELECT " name " FROM " name\nname: /[a-z]{1,6}/'
# The same language in GBNF, the EBNF of llama.cpp and xgrammar that vLLM's default backend takes.
SQL_GBNF = 'root ::= "SELECT " name " FROM " name\nname ::= [a-z] | [a-z] [a-z] | [a-z] [a-z] [a-z]'


@pytest.mark.parametrize("constraint, fits", [
    ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
    ({"structured_outputs": {"choice": ["positive", "negative (mixed)"]}}, lambda t: t in ("positive", "negative (mixed)")),
    ({"structured_outputs": {"grammar": SQL}}, lambda t: re.fullmatch("SELECT [a-z]{1,6} FROM [a-z]{1,6}", t)),
    ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"structured_outputs": {"json": json.dumps(PERSON)}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_regex": "[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t)),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_grammar": SQL}, lambda t: re.fullmatch("SELECT [a-z]{1,6} FROM [a-z]{1,6}", t)),
    ({"structured_outputs": {"grammar": SQL_GBNF}}, lambda t: re.fullmatch("SELECT [a-z]{1,3} FROM [a-z]{1,3}", t)),
    ({"guided_grammar": SQL_GBNF}, lambda t: re.fullmatch("SELECT [a-z]{1,3} FROM [a-z]{1,3}", t)),
], ids=["regex", "choice", "lark", "json", "json-text", "guided-regex", "guided-choice", "guided-json",
        "guided-grammar", "gbnf", "guided-gbnf"])  # fmt: skip
def test_structured_outputs_constrain_the_answer(idle_server, constraint, fits):
    """Each of vLLM's constraints holds on the answer, which ends with stop; the unconstrained answer to the same
    request is the random model's noise, which none of them takes."""
    reply = chat(idle_server, extra_body=constraint)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and fits(text), text
    plain = chat(idle_server).choices[0].message.content
    with pytest.raises((AssertionError, json.JSONDecodeError, jsonschema.ValidationError)):
        assert fits(plain)


def test_completions_and_responses_take_a_constraint(idle_server):
    client = idle_server.client()
    reply = client.completions.create(model=idle_server.model_name, prompt="Sentiment:", max_tokens=20,
                                      temperature=0.0, extra_body={"guided_choice": ["good", "bad"]})  # fmt: skip
    assert reply.choices[0].text in ("good", "bad") and reply.choices[0].finish_reason == "stop"
    response = client.responses.create(model=idle_server.model_name, input="Give me JSON.", temperature=0.0,
                                       max_output_tokens=80,
                                       text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})  # fmt: skip
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)


@pytest.mark.parametrize("fields, param, words", [
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex", "regex"),
    ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar", "cannot be used"),
    ({"guided_grammar": "root ::= = bad"}, "guided_grammar", "Expected name"),
    ({"structured_outputs": {}}, "structured_outputs", "no constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "set one"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json", "set one"),
    ({"guided_choice": []}, "guided_choice", "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "guided_regex"),
], ids=["bad-regex", "bad-lark", "bad-gbnf", "empty", "two-fields", "two-params", "no-choices", "json-text",
        "min-tokens"])  # fmt: skip
def test_bad_constraints_get_a_400_naming_them(idle_server, fields, param, words):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        chat(idle_server, extra_body=fields)
    error = caught.value.body
    assert error["param"] == param and words in error["message"], error


# ---- forced tool calls ----------------------------------------------------------------------------------

# Parameters whose values a random model closes in a few tokens (an enum and a bounded integer), so that calls
# end before max_tokens; the weather tool's free-text city is walked in the grammar tests only.
FORECAST = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["unit", "days"]}  # fmt: skip
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "where": {"$ref": "#/$defs/Point"}},
           "required": ["city"], "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}},
                                                     "required": ["x"]}}}  # fmt: skip
FUNCTIONS = {"get_weather": {"name": "get_weather", "parameters": WEATHER},
             "forecast": {"name": "forecast", "parameters": FORECAST},
             "ping": {"name": "ping"}}  # fmt: skip
CALL_TAIL = "</function>\n</tool_call>"
WEATHER_CALL = ('get_weather>\n<parameter=city>\nLe Mans\nwest\n</parameter>\n<parameter=days>\n3\n</parameter>\n'
                '<parameter=where>\n{"x": 1.5}\n</parameter>\n' + CALL_TAIL)  # fmt: skip


def walk(grammar, text: str) -> str:
    """'finished', 'open' (the text is a prefix of a sentence) or 'refused' (at some token of it)."""
    state = grammar.start()
    for token in Tokenizer.tiny().encode(text):
        if token not in allowed_tokens(state.mask) or not state.accept(token):
            return "refused"
    return "finished" if state.finished else "open"


@pytest.mark.parametrize("named, text, verdict", [
    (None, WEATHER_CALL, "open"),  # "required" may add further calls, or end
    (None, f"{WEATHER_CALL}\n<tool_call>\n<function=ping>\n<parameter=any key>\nv\n</parameter>\n{CALL_TAIL}", "open"),
    (None, "get_weathr>", "refused"),  # not a tool's name
    (None, f"get_weather>\n{CALL_TAIL}", "refused"),  # city is required
    (None, "get_weather>\n<parameter=city>\nx\n</parameter>\n<parameter=days>\nthree", "refused"),  # an integer
    (None, "forecast>\n<parameter=unit>\nk", "refused"),  # not in the enum
    (None, "forecast>\n<parameter=days>", "refused"),  # the schema's order: unit first
    ("get_weather", WEATHER_CALL.removeprefix("get_weather>\n"), "finished"),  # a named call is one call
    ("get_weather", "<parameter=city>\nx\n</parameter>\n<parameter=where>\n{}", "refused"),  # $defs' x is required
    ("forecast", "<parameter=unit>\nc\n</parameter>\n<parameter=days>\n8", "refused"),  # maximum 7
], ids=["required", "two-calls", "unknown-name", "missing-required", "not-an-integer", "not-in-enum", "order",
        "named", "ref", "maximum"])  # fmt: skip
def test_the_forced_call_grammar_takes_the_tools_calls_only(compiler, named, text, verdict):
    assert walk(compiler.grammar(tool_call_grammar(FUNCTIONS, named)), text) == verdict


@pytest.mark.parametrize("text, verdict", [
    (WEATHER_CALL, "finished"),  # one whole call ends the answer
    (f"{WEATHER_CALL}\n<tool_call>", "refused"),  # no second call
])  # fmt: skip
def test_without_parallel_calls_required_is_one_call(compiler, text, verdict):
    """parallel_tool_calls=false: tool_choice "required" makes exactly one call, as OpenAI's does."""
    assert walk(compiler.grammar(tool_call_grammar(FUNCTIONS, None, parallel=False)), text) == verdict


def test_a_call_the_grammar_takes_parses_back_to_its_arguments():
    parser = OutputParser(False, FUNCTIONS, prefix="<tool_call>\n<function=")
    delta = parser.push(WEATHER_CALL)
    delta += parser.finish()
    (call,) = delta.tool_calls
    assert call.name == "get_weather" and not delta.content
    assert json.loads(call.arguments) == {"city": "Le Mans\nwest", "days": 3, "where": {"x": 1.5}}


def test_forced_tool_calls_name_a_tool_and_fit_its_schema(engine, tiny_model):
    """The engine under `tool_call_grammar` after the forced head of a call, as the server sends a "required"
    chat request: every call the answer completes names a listed tool and fits its schema, at any temperature.
    The tiny model's random weights name no tool without the grammar. A call that max_tokens cuts is left out.
    Short names: the tiny tokenizer spends about a token a character, and its programs hold 128 tokens."""
    forecast = {"type": "object", "properties": {"u": FORECAST["properties"]["unit"], "d": FORECAST["properties"]["days"]},
                "required": ["u", "d"]}  # fmt: skip
    tools = {
        "fc": {"name": "fc", "parameters": forecast},
        "p": {"name": "p", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
    }
    schemas = {"fc": forecast, "p": {"type": "object", "maxProperties": 0}}
    head = "<tool_call>\n<function="
    prompt = tiny_model.tokenizer.encode_chat([{"role": "user", "content": "Forecast?"}]) + tiny_model.tokenizer.encode(
        head
    )
    grammar = GrammarCompiler(tiny_model.tokenizer, tiny_model.config.vocab_size, engine.eos_token_ids)
    forced = grammar.grammar(tool_call_grammar(tools, None))
    max_tokens = ENGINE["max_model_len"] - len(prompt)
    requests = {f"t{temperature}-{seed}": (prompt, GenerationParams(max_tokens, SamplingParams(temperature, seed=seed),
                                                                    grammar=forced))
                for temperature in (0.0, 1.0) for seed in range(4)}  # fmt: skip
    requests["plain"] = (prompt, GenerationParams(max_tokens))
    outputs = run(engine, requests)
    named = set()
    for request_id in requests:
        parser = OutputParser(False, tools, prefix=head)
        delta = parser.push(outputs.text(request_id))
        delta += parser.finish()
        if request_id == "plain":
            assert not any(call.name in tools for call in delta.tool_calls)
            continue
        complete = delta.tool_calls[:-1] if outputs.finish(request_id) == "length" else delta.tool_calls
        assert delta.tool_calls and (complete or outputs.finish(request_id) == "length")
        for call in complete:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            named.add(call.name)
    assert named == set(tools)  # both schemas were walked to the end
