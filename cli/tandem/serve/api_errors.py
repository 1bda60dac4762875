"""The API's errors: OpenAI's error object with an HTTP status, how a value is shown in a
message (never more than 60 characters of it), and a field's JSON text read or refused. One
module below protocol.py and structured.py, which both refuse requests."""
from __future__ import annotations

from tandem import bounded_json


class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with a status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def clip(text: str, limit: int = 60) -> str:
    """A value shown in an error message: never the whole of a huge one."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def kind_of(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def too_deep(path: str, limit: int, param: str | None) -> ApiError:
    """A JSON value nested past the limit: named by its path, refused by the field."""
    return bad(f"{clip(path or 'the request body', 120)} is nested more than {limit} levels "
               "deep (tandem's JSON depth limit, docs/serve.md)", param, "too_deep")


def loads_field(text: str, param: str):
    """A field that carries JSON as text (a schema, a call's arguments), read within the
    depth limit: a 400 naming the field otherwise."""
    try:
        return bounded_json.loads(text)
    except bounded_json.TooDeep as exc:
        raise too_deep(param, exc.limit, param) from None
    except ValueError as exc:
        raise bad(f"'{param}' is not valid JSON: {clip(str(exc))}", param,
                  "invalid_value") from None
