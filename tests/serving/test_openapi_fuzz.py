"""The OpenAPI document against the server, driven by schemathesis: for a bounded number of
generated requests per operation, no 5xx, and every response (status, media type, body, headers)
is one the document describes. The bodies are also checked for leaked internals."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import (  # noqa: E402
    MODEL_NAME,
    InProcessServer,
    find_leaks,
    http_status_counts,
    parse_metrics,
)

EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def fuzz_server(make_inprocess_server: Callable[..., InProcessServer]) -> InProcessServer:
    # Short generations and small limits: the fuzzer explores the edges, not the throughput.
    return make_inprocess_server(max_tokens_limit=8, max_n=2, max_prompts=4, max_top_logprobs=2)


@schemathesis.check
def no_internals(ctx: Any, response: Any, case: Any) -> bool | None:
    leaks = find_leaks(response.content)
    if leaks:
        raise AssertionError(f"response body leaks {', '.join(leaks)}")
    return None


def _pinned_to(doc: dict[str, Any], model: str) -> dict[str, Any]:
    """A copy of `doc` whose model fields and path parameters name only `model`, so the cases
    reach the engine instead of stopping at 404."""
    doc = copy.deepcopy(doc)
    for schema in doc["components"]["schemas"].values():
        if "model" in schema.get("properties", {}):
            schema["properties"]["model"] = {"type": "string", "enum": [model]}
    for operations in doc["paths"].values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "model_name":
                    parameter["schema"] = {"type": "string", "enum": [model]}
                elif parameter["name"] == "model_version":
                    parameter["schema"] = {"type": "string", "enum": ["1", "2"]}
    return doc


@pytest.mark.parametrize("pin_model", [False, True], ids=["any-model", "served-model"])
def test_every_response_is_documented_and_none_is_a_5xx(
    fuzz_server: InProcessServer, pin_model: bool
) -> None:
    doc = fuzz_server.app.openapi()
    schema = schemathesis.openapi.from_dict(_pinned_to(doc, MODEL_NAME) if pin_model else doc)
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        response_headers_conformance,
        no_internals,
    ]
    before = http_status_counts(parse_metrics(fuzz_server.app.state.metrics.render().decode()))
    failures = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 16
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def fuzz(case: Any) -> None:
            case.call_and_validate(base_url=fuzz_server.base_url, timeout=60, checks=checks)

        try:
            fuzz()
        except Exception as exc:  # every operation is fuzzed; all failures are reported
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    assert not failures, "\n\n".join(failures)
    after = http_status_counts(parse_metrics(fuzz_server.app.state.metrics.render().decode()))
    sent = {code: after[code] - before.get(code, 0) for code in after}
    print(f"responses by status: {sent}")
    assert sum(sent.values()) >= 100, "the fuzzer sent too few requests"
    if pin_model:
        assert sent.get("200", 0) >= 10, "few requests reached the model"
    fuzz_server.wait_idle()


def test_the_document_names_real_statuses_and_media_types(fuzz_server: InProcessServer) -> None:
    doc = fuzz_server.app.openapi()
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            statuses = set(operation["responses"])
            assert "422" not in statuses, (method, path)  # validation failures are 400s
            assert {"200", "400", "500"} <= statuses, (method, path)
            if method == "post":
                assert "413" in statuses, path
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"application/json", "text/event-stream"} == set(completions["200"]["content"])
    assert {"404", "408", "503"} <= set(completions)
    assert "Retry-After" in completions["503"]["headers"]
    error = completions["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    kserve = doc["paths"]["/v2/models/{model_name}/infer"]["post"]["responses"]["404"]
    assert kserve["content"]["application/json"]["schema"]["$ref"].endswith("/KServeError")
