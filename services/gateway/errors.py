"""OpenAI-shaped errors: ApiError (a status and {"error": {message, type, param, code}}) and the common 400s."""
from __future__ import annotations

from typing import Any

from shared.sampling import SamplingError, type_error


class ApiError(Exception):
    """An error returned to the client as {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.headers = headers or {}  # beside Retry-After: e.g. Accept-Encoding with a 415

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def api_type_error(param: str, expected: str, value: Any) -> ApiError:
    return sampling_api_error(type_error(param, expected, value))


def sampling_api_error(exc: SamplingError) -> ApiError:
    return ApiError(400, exc.message, param=exc.param, code=exc.code)


def array_too_long(param: str, max_length: int, length: int) -> ApiError:
    return ApiError(400, f"Invalid '{param}': array too long. Expected an array with maximum length {max_length}, "
                         f"but got an array with length {length} instead.", param=param, code="array_above_max_length")


def unsupported_parameter(param: str) -> ApiError:
    return ApiError(400, f"Unsupported parameter: '{param}' is not supported by this server.", param=param,
                    code="unsupported_parameter")
