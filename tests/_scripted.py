"""A scripted engine behind real uvicorn, shared by the HTTP tests of answer parsing (tool calls, reasoning, the
Responses API's items): the engine is a test double that answers every request with a chosen text, split into
pieces the way a stream of tokens arrives, so that the server's rendering and parsing are what is tested. Test
modules list this module in `pytest_plugins` to get the `scripted` fixture: (engine, openai client, tokenizer)."""

from __future__ import annotations

import threading
import types

import openai
import pytest

from qwen35_jax.serving.engine import RequestOutput

MODEL = "scripted"
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"  # fmt: skip


class ScriptedEngine:
    """What the server needs of an Engine; each request gets `self.answer`, four characters per output."""

    def __init__(self):
        self.answer = ""
        self.prompts: list[list[int]] = []
        self.params: list = []  # each request's GenerationParams
        self.scheduler = types.SimpleNamespace(config=types.SimpleNamespace(max_batch=8))
        self.eos_token_ids = frozenset({2})  # the tiny tokenizer's <|im_end|>

    def is_running(self) -> bool:
        return True

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        pass

    def abort(self, request_id: str) -> None:
        pass

    def submit(self, prompt_ids, params, on_output, request_id, fork_of=None) -> None:
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        pieces = [self.answer[i : i + 4] for i in range(0, len(self.answer), 4)]

        def emit():
            for piece in pieces:
                on_output(RequestOutput(request_id, [0], piece, None))
            on_output(RequestOutput(request_id, [], "", None, "stop", num_prompt_tokens=len(prompt_ids),
                                    num_output_tokens=len(pieces)))  # fmt: skip

        threading.Thread(target=emit, daemon=True).start()


@pytest.fixture(scope="module")
def scripted():
    from qwen35_jax.api import TINY_ASSETS
    from qwen35_jax.serving.server import OpenAIServer, ServerConfig, UvicornServer, bind, create_app, listen_url
    from qwen35_jax.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(TINY_ASSETS)
    engine = ScriptedEngine()
    server = OpenAIServer(engine, tokenizer, ServerConfig(served_model_name=MODEL, max_model_len=4096,
                                                          vocab_size=tokenizer.vocab_size))  # fmt: skip
    sock = bind("127.0.0.1", 0)
    started = threading.Event()
    uvicorn = UvicornServer(create_app(server), on_started=started.set)
    thread = threading.Thread(target=uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert started.wait(30)
    client = openai.OpenAI(base_url=f"{listen_url(sock)}/v1", api_key="unused", max_retries=0, timeout=30)
    yield engine, client, tokenizer
    uvicorn.should_exit = True
    thread.join(10)
    sock.close()
