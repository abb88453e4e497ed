"""Errors in the OpenAI shape: `APIError`, the body every 4xx/5xx carries, and one message for a pydantic
validation failure.

Every input problem is answered with a 4xx in this shape; a 5xx means a bug or a failed engine.
"""

from __future__ import annotations

ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
               500: "internal_server_error", 503: "service_unavailable"}  # fmt: skip


ERROR_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
               413: "request_too_large", 429: "queue_full", 500: "internal_error", 503: "unavailable"}  # fmt: skip


class APIError(Exception):
    """An error answer: raised anywhere under a route, turned into `error_body` by the app's handler."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    code = code or ERROR_CODES.get(status, str(status))
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Parameters that take one of several shapes: pydantic reports one error per shape, this says it once.
SHAPES = {
    "prompt": "must be a string, a non-empty list of token ids (integers), or a batch: a list of strings or a list of token-id lists",
    "stop": "must be a non-empty string or a list of at most 16 non-empty strings",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors of one request body: the first error, said for a person."""
    errors = [_without_union_member(error) for error in errors]
    missing = [error["loc"][-1] for error in errors if error.get("type") == "missing" and error.get("loc")]
    if len(missing) > 1 and len(missing) == len(errors) and len({tuple(error["loc"][:-1]) for error in errors}) == 1:
        # A body that fits none of a route's forms (/tokenize: a prompt or messages): name what each one needs.
        return f"missing required parameter: give one of {', '.join(repr(str(m)) for m in missing)}", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    shape = next((name for name in SHAPES if name in loc), None)
    if shape is not None and len(errors) > 1:
        where = ".".join(loc[: loc.index(shape) + 1])
        return f"{where} {SHAPES[shape]}", param
    message = _single_message(first, loc)
    if message is not None:
        return message
    return _list_message(errors), param


def _without_union_member(error: dict) -> dict:
    """FastAPI puts the model's name into the location of an error against one form of a union body
    (`body.TokenizeChatRequest.messages`): a class name is no parameter, so it goes."""
    loc = tuple(error.get("loc", ()))
    if len(loc) > 1 and loc[0] == "body" and isinstance(loc[1], str) and loc[1][:1].isupper():
        return {**error, "loc": ("body", *loc[2:])}
    return error


def _single_message(error: dict, loc: list[str]) -> tuple[str, str | None] | None:
    """The message of an error kind that has its own wording, or None."""
    kind = error.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', error.get('msg'))}", None
    if kind == "extra_forbidden":
        return f"unknown parameter {'.'.join(loc)!r}: this server does not support it", ".".join(loc)
    if kind == "model_attributes_type" and not loc:
        return "the request body must be a JSON object (sent with Content-Type: application/json)", None
    if kind == "missing" and not loc:
        return "the request body is missing: send a JSON object", None
    if kind == "missing":
        return f"missing required parameter {'.'.join(loc)!r}", ".".join(loc)
    return None


def _list_message(errors: list[dict]) -> str:
    """The first four errors, each with where it is."""
    parts = []
    for error in errors[:4]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {error.get('msg')}")
    more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
    return "invalid request: " + "; ".join(parts) + more
