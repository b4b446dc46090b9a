"""The OpenAI error shape `{"error": {"message", "type", "param", "code"}}` and the mapping of pydantic's and
SamplingParams' errors onto it (a 400 that names the offending field)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, ValidationError

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    431: "RequestHeaderFieldsTooLargeError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


RETRY_AFTER_S = 1  # the Retry-After of every 503 (busy, restarting, draining): the openai client retries after it


class OpenAIServingError(Exception):
    """An error the server answers in OpenAI's shape; raised anywhere in the serving path."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param

    def to_response(self) -> ErrorResponse:
        err_type = _ERROR_TYPES.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=err_type, param=self.param, code=self.status))


def _field_path(loc: tuple) -> str:
    # Drop pydantic's union-member tags ("list[int]", "str", "function-after[...]") so the path names the field.
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS)))


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# a model-level check's message starts with the (snake_case) field it is about; pydantic's own messages start with
# a capital ("Field required", "Input should be ..."), which names no field
_FIELD_PATH = re.compile(r"^[a-z_][\w.]*$")
# errors about the body as a whole (not a JSON object, or no body at all)
_BODY_TYPE_ERRORS = {"model_type", "model_attributes_type", "dict_type"}


def _json_kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)


def validation_error_to_serving_error(exc: ValidationError | Sequence[Mapping[str, Any]]) -> OpenAIServingError:
    """Maps pydantic's errors (a ValidationError, or FastAPI's `errors()` list whose paths start with "body") to one
    400 that names the offending field (dotted path, e.g. messages.0.content)."""
    errors = exc.errors() if isinstance(exc, ValidationError) else exc
    by_field: dict[str, str] = {}
    for err in errors:
        loc = tuple(err.get("loc", ()))
        path = _field_path(loc[1:] if loc[:1] == ("body",) else loc)
        if path in by_field:  # a union reports once per member type; the first says enough
            continue
        kind = err.get("type")
        if not path and kind in _BODY_TYPE_ERRORS:
            by_field[""] = f"request body must be a JSON object, got {_json_kind(err.get('input'))}"
        elif not path and kind == "missing":
            by_field[""] = "request body is missing: a JSON object is expected"
        elif kind == "extra_forbidden":
            by_field[path] = "unsupported field: tokenspout does not implement it (see the README, Coming from vLLM)"
        elif kind == "json_invalid":
            by_field[""] = f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        else:
            value = err.get("input")
            got = f" (got {value!r})" if "input" in err and not isinstance(value, dict | list) else ""
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            if not path:  # a model-level check: its message starts with the field it is about
                head = msg.split(":", 1)[0].split(" ", 1)[0]
                if _FIELD_PATH.match(head):
                    path, msg, got = head, msg.removeprefix(head + ":").strip(), ""
            by_field[path] = f"{msg}{got}"
        if len(by_field) == 3:
            break
    message = "; ".join(
        f"{path}: {msg}" if path and not msg.startswith(path.split(".")[0]) else msg for path, msg in by_field.items()
    )
    return OpenAIServingError(message or "invalid request", param=next(iter(by_field), None) or None)


def value_error_to_serving_error(exc: ValueError, fields: set[str]) -> OpenAIServingError:
    """SamplingParams / engine messages start with the field name ("top_p must be in (0, 1], got 2.0"), or with it
    and a colon ("tools: ...")."""
    msg = str(exc)
    head = msg.split(" ", 1)[0].removesuffix(":") if msg else ""  # a field, or a dotted path into one
    return OpenAIServingError(msg or "invalid request", param=head if head.split(".", 1)[0] in fields else None)
