"""vLLM's error envelope: `{"error": {"message", "type", "param", "code": <int status>}}`."""
from __future__ import annotations

import orjson

_TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class SimError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")

    def body(self) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}
        )


def bad_request(message: str, param: str | None = None) -> SimError:
    return SimError(400, message, param=param)


def model_not_found(model: str) -> SimError:
    return SimError(404, f"The model `{model}` does not exist.", param="model")
