"""Schemathesis against the live server's own OpenAPI schema, in a reduced mode: a few valid (positive) and
invalid (negative) examples per operation, each of which must be answered without a 5xx. Afterwards the
engine must be idle with its pools full."""

from __future__ import annotations

import collections
import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

pytest_plugins = ["_server"]

# Reduced for the test suite; QWEN35_JAX_FUZZ_EXAMPLES=500 (and QWEN35_JAX_FUZZ_RANDOM=1 for fresh inputs)
# makes a longer hunt.
_PER_MODE = int(os.environ.get("QWEN35_JAX_FUZZ_EXAMPLES", "30"))
EXAMPLES = {"positive": _PER_MODE, "negative": _PER_MODE}
DERANDOMIZE = not os.environ.get("QWEN35_JAX_FUZZ_RANDOM")


@pytest.fixture(scope="module")
def schema(live_server):
    raw = httpx.get(f"{live_server.root}/openapi.json").json()
    return schemathesis.openapi.from_dict(raw)


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def test_the_schema_lists_every_endpoint(schema):
    names = {f"{op.method.upper()} {op.path}" for op in operations(schema)}
    expected = {"GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions", "POST /v1/chat/completions",
                "GET /v1/models/{model_id}", "GET /version", "POST /tokenize", "POST /detokenize", "POST /v1/responses",
                "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}"}  # fmt: skip
    assert expected <= names


@pytest.mark.parametrize("mode", sorted(EXAMPLES))
def test_fuzzing_finds_no_server_error(idle_server, schema, mode):
    generation_mode = schemathesis.GenerationMode(mode)
    headers = idle_server.headers()
    statuses: collections.Counter = collections.Counter()
    for operation in operations(schema):
        if mode == "negative" and not operation.body:
            continue  # no input to make invalid

        # Valid bodies would almost all name a model that does not exist (a 404 tested elsewhere): they get
        # the served model's name, so that the fuzzed parameters reach the engine.
        @settings(max_examples=EXAMPLES[mode], deadline=None, database=None, derandomize=DERANDOMIZE,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=operation.as_strategy(generation_mode=generation_mode))
        def check(case):
            if mode == "positive" and isinstance(case.body, dict):
                case.body["model"] = idle_server.model_name
            response = case.call(base_url=idle_server.root, headers=headers, timeout=120)
            statuses[(case.operation.path, response.status_code)] += 1
            case.validate_response(response, checks=[not_a_server_error])

        check()
    if mode == "positive":  # the fuzz reached the engine, not only the validation layer
        assert statuses[("/v1/completions", 200)] + statuses[("/v1/chat/completions", 200)] > 0, statuses
        assert statuses[("/v1/responses", 200)] > 0, statuses
