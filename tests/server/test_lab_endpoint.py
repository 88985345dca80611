"""POST /v1/lab/run and the files of the /lab page, without a browser and without a model.

The endpoint is the lab behind HTTP: the same options as `run_lab` / `iterserve lab`, the
same result, and bad input answered with a 400 and an OpenAI-style error body that names the
option (never a 422 from FastAPI's own validation, never a 500).
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from iterserve.lab.api import run_lab
from iterserve.server import lab_routes
from iterserve.server.app import create_app


@pytest.fixture(scope="module")
def client() -> TestClient:
    # The app without a model (`iterserve lab --serve`): the lab needs none.
    with TestClient(create_app(None)) as c:
        yield c


def assert_error(resp, *, status: int = 400, param: str | None = None, says: str = "",
                 type: str = "invalid_request_error") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] == type
    assert says.lower() in err["message"].lower(), err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# --- the run -------------------------------------------------------------------------

def test_empty_body_runs_the_reference_case_like_run_lab(client):
    resp = client.post("/v1/lab/run")
    assert resp.status_code == 200
    assert resp.json() == run_lab({})


def test_options_are_run_lab_options_and_the_result_is_its_json(client):
    options = {"batching": "continuous", "max_num_seqs": 4, "requests": 12, "seed": 3,
               "per_request": True}
    resp = client.post("/v1/lab/run", json=options)
    assert resp.status_code == 200
    body = resp.json()
    assert list(body) == ["continuous"]
    assert body == json.loads(json.dumps(run_lab(options)))
    assert len(body["continuous"]["per_request"]) == 12


def test_a_knob_changes_the_figures(client):
    ref = client.post("/v1/lab/run", json={}).json()
    fewer_slots = client.post("/v1/lab/run", json={"max_num_seqs": 4}).json()
    for mode in ("static", "continuous"):
        assert fewer_slots[mode]["slots"] == 4
        assert fewer_slots[mode]["steps"] > ref[mode]["steps"]


# --- bad input -----------------------------------------------------------------------

def test_malformed_json_is_a_400(client):
    resp = client.post("/v1/lab/run", content=b'{"max_num_seqs": 8,',
                       headers={"Content-Type": "application/json"})
    assert_error(resp, says="not valid JSON")


@pytest.mark.parametrize("body, kind", [("[1, 2]", "an array"), ('"both"', "a string"),
                                        ("8", "a number"), ("null", "null")])
def test_a_body_that_is_not_an_object_is_a_400(client, body, kind):
    resp = client.post("/v1/lab/run", content=body.encode(),
                       headers={"Content-Type": "application/json"})
    assert_error(resp, says=f"must be a JSON object of lab options, got {kind}")


def test_an_unknown_option_is_a_400_naming_it(client):
    err = assert_error(client.post("/v1/lab/run", json={"slotz": 8}), param="slotz",
                       says="slotz")
    assert err["code"] == "invalid_lab_option"


@pytest.mark.parametrize("old, new", [("slots", "max_num_seqs"), ("policy", "scheduling_policy"),
                                      ("chunked_prefill", "enable_chunked_prefill")])
def test_a_former_option_name_is_a_400_naming_the_new_one(client, old, new):
    err = assert_error(client.post("/v1/lab/run", json={old: 4}), param=old,
                       says=f"renamed to {new}")
    assert err["code"] == "invalid_lab_option"


@pytest.mark.parametrize("options, param", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": "eight"}, "max_num_seqs"),
    ({"max_num_seqs": 2.5}, "max_num_seqs"),
    ({"batching": "dynamic"}, "batching"),
    ({"short_frac": 1.5}, "short_frac"),
    ({"short": [100, 10]}, "short"),
    ({"arrival_rate": -1}, "arrival_rate"),
    ({"preemption_mode": "drop"}, "preemption_mode"),
    ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill"),
])
def test_a_bad_value_is_a_400_naming_the_option(client, options, param):
    assert_error(client.post("/v1/lab/run", json=options), param=param, says=param)


def test_a_run_too_large_for_http_is_refused_before_it_runs(client):
    too_many = lab_routes.MAX_HTTP_OUTPUT_TOKENS // 500 + 1
    err = assert_error(client.post("/v1/lab/run", json={"requests": too_many}),
                       param="requests", says="at most")
    assert err["code"] == "lab_run_too_large"
    err = assert_error(client.post("/v1/lab/run", json={"lengths": [100_000] * 21}),
                       param="lengths", says="output tokens")


def test_an_oversized_body_is_a_400(client):
    body = b'{"lengths": [' + b"1," * lab_routes.MAX_BODY_BYTES + b"1]}"
    assert_error(client.post("/v1/lab/run", content=body,
                             headers={"Content-Type": "application/json"}), says="bytes")


# --- the page's files ----------------------------------------------------------------

def test_the_page_and_its_files_are_served_from_the_package(client):
    page = client.get("/lab")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert '<script src="/lab/static/lab.js"' in page.text
    assert 'href="/lab/static/lab.css"' in page.text
    js = client.get("/lab/static/lab.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert "/v1/lab/run" in js.text
    css = client.get("/lab/static/lab.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")


def test_the_page_loads_nothing_from_the_internet(client):
    for path in ("/lab", "/lab/static/lab.js", "/lab/static/lab.css"):
        text = client.get(path).text
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in text
        assert "//cdn" not in text


@pytest.mark.parametrize("name", ["lab.html", "missing.js", "../lab_routes.py",
                                  "..%2Flab_routes.py", "%2E%2E%2Flab_routes.py"])
def test_only_the_pages_own_static_files_are_served(client, name):
    resp = client.get(f"/lab/static/{name}")
    assert resp.status_code == 404
    assert "APIRouter" not in resp.text
    assert "error" in resp.json()


def test_an_unknown_static_file_gets_an_error_body(client):
    err = assert_error(client.get("/lab/static/missing.js"), status=404, says="missing.js",
                       type="not_found_error")
    assert err["code"] == "not_found"
