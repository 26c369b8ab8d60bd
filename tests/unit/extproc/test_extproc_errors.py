from __future__ import annotations

import json

import pytest

from epp import errors
from epp.extproc.errors import ERROR_TABLE, error_kind, immediate_response


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (errors.BadRequest("b"), 400),
        (errors.NotFound("n"), 404),
        (errors.PayloadTooLarge("p"), 413),
        (errors.Overloaded("o"), 429),
        (errors.Unavailable("u"), 503),
        (errors.Internal("i"), 500),
        (KeyError("boom"), 500),
    ],
)
def test_error_table(error: Exception, status: int) -> None:
    reply = immediate_response(error)
    ir = reply.immediate_response
    assert ir.status.code == status
    payload = json.loads(ir.body)["error"]
    assert payload["code"] == status and payload["type"] == error_kind(error).type
    if isinstance(error, errors.EppError):
        assert payload["message"] == error.message
    else:  # internals are not leaked
        assert "boom" not in payload["message"]
    assert " " not in ir.details


def test_every_domain_error_is_in_the_table() -> None:
    domain = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.EppError)}
    assert domain - {errors.EppError} == set(ERROR_TABLE)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens?beta=true"])
def test_a_messages_request_gets_anthropics_error_shape(path: str) -> None:
    """What vLLM's Messages endpoint answers: ``{"type": "error", "error": {type, message}}``."""
    ir = immediate_response(errors.NotFound("model 'x' is not served here"), path).immediate_response
    assert ir.status.code == 404
    assert json.loads(ir.body) == {"type": "error", "error": {"type": "not_found_error",
                                                             "message": "model 'x' is not served here"}}  # fmt: skip
    openai = json.loads(immediate_response(errors.NotFound("m"), "/v1/chat/completions").immediate_response.body)
    assert openai["error"]["code"] == 404 and "type" not in openai
