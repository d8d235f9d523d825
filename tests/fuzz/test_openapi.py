"""Every operation of the published OpenAPI document, fuzzed by schemathesis against a live
router: valid and invalid requests alike get documented statuses and content types, errors in
OpenAI's shape, never a 5xx from the router itself and never an engine-internal field."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import CheckContext, not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from carryover.bench.procs import Process
from carryover.router.http.api_schema import openapi_document

# schemathesis gives every operation's test one node id, which pytest-xdist schedules once:
# this module runs in make test's session without workers.
pytestmark = pytest.mark.serial

SCHEMA = schemathesis.openapi.from_dict(openapi_document())
FORBIDDEN = ("kv_transfer_params", "remote_block_ids", "remote_engine_id", "remote_host")


def no_engine_internals(
    ctx: CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> None:
    text = response.text
    if case.path == "/openapi.json":
        return  # the document names the field it refuses
    if response.status_code == 400 and "kv_transfer_params" in text:
        return  # the refusal of a client's kv_transfer_params names the field
    for field in FORBIDDEN:
        assert field not in text, f"{field} in a response"


def openai_error_shape(
    ctx: CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> None:
    if response.status_code >= 400:
        error = json.loads(response.text)["error"]
        assert error["code"] == response.status_code and isinstance(error["message"], str)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    no_engine_internals,
    openai_error_shape,
]


def test_the_published_document_is_the_one_tested(router: Process) -> None:
    assert httpx.get(router.url + "/openapi.json").json() == openapi_document()


@SCHEMA.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_every_operation_holds_its_schema(case: schemathesis.Case, router: Process) -> None:
    response = case.call(base_url=router.url, timeout=60)
    case.validate_response(response, checks=CHECKS)
