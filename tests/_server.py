"""One live server for the HTTP tests: the tiny model behind real uvicorn on a loopback port, in this process
(so tests can look at the engine's pools), shared by every test module that lists this module in
`pytest_plugins`.

It requires an API key, so the wrong-key case can be tested against it; clients get the right one.
"""

from __future__ import annotations

import threading
import time

import pytest

API_KEY = "test-key"
MODEL_NAME = "tiny-test"
ENGINE = dict(max_batch=4, max_prefill_tokens=16, max_model_len=128, prompt_logprobs_chunk=16)
MAX_QUEUE = 64
DEFAULT_CHAT_MAX_TOKENS = 24


class LiveServer:
    def __init__(self, compile_cache: str):
        from qwen35_jax.api import load_model
        from qwen35_jax.serving.factory import EngineConfig, build_engine
        from qwen35_jax.serving.server import (
            OpenAIServer,
            ServerConfig,
            UvicornServer,
            bind,
            create_app,
            listen_url,
        )

        self.compile_cache = compile_cache
        self.model = load_model("tiny", dtype="float32")
        self.engine_config = EngineConfig(compile_cache=compile_cache, **ENGINE)
        self.engine = build_engine(self.model, self.engine_config)
        config = ServerConfig(
            served_model_name=MODEL_NAME, max_model_len=ENGINE["max_model_len"],
            vocab_size=self.model.config.vocab_size, api_key=API_KEY, max_queue=MAX_QUEUE,
            default_chat_max_tokens=DEFAULT_CHAT_MAX_TOKENS, prompt_logprobs=True,
        )  # fmt: skip
        self.server = OpenAIServer(self.engine, self.model.tokenizer, config)
        self.sock = bind("127.0.0.1", 0)
        self.root = listen_url(self.sock)
        self.base_url = f"{self.root}/v1"
        self.api_key = API_KEY
        self.model_name = MODEL_NAME
        self.vocab_size = self.model.config.vocab_size
        self.max_model_len = ENGINE["max_model_len"]
        self.max_queue = MAX_QUEUE
        self.default_chat_max_tokens = DEFAULT_CHAT_MAX_TOKENS
        started = threading.Event()
        self.uvicorn = UvicornServer(create_app(self.server), on_started=started.set)
        self.engine.start()
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        if not started.wait(60):
            raise RuntimeError("uvicorn did not start")

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=120, **kwargs)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def pool_state(self) -> dict[str, int]:
        scheduler = self.engine.scheduler
        return {
            "pages_held": scheduler.page_pool.num_total - scheduler.page_pool.num_free,
            "slots_held": scheduler.slot_pool.num_total - scheduler.slot_pool.num_free,
            "waiting": scheduler.num_waiting,
            "running": scheduler.num_running,
            "generations": len(self.engine.generations),
            "active": self.server.num_active,
        }

    def wait_idle(self, deadline_s: float = 60.0) -> dict[str, int]:
        """Poll until the engine has settled with every page and slot free; returns the last state seen."""
        end = time.monotonic() + deadline_s
        while True:
            state = self.pool_state()
            if not any(state.values()) and not self.engine.has_work():
                return state
            if time.monotonic() > end:
                return state
            time.sleep(0.02)

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()
        self.sock.close()


@pytest.fixture(scope="session")
def live_server(compile_cache_dir) -> LiveServer:
    # The session's one cache (conftest.py): JAX reads the cache folder once per process, so a second
    # folder would be ignored here, and `serve` in a subprocess must be pointed at the folder in use.
    server = LiveServer(compile_cache_dir)
    yield server
    server.close()


@pytest.fixture()
def idle_server(live_server: LiveServer) -> LiveServer:
    """The live server, checked idle (pools full) after the test."""
    yield live_server
    state = live_server.wait_idle()
    assert not any(state.values()), f"server not idle after the test: {state}"
