"""Fuzzing POST /v1/observations on a real server: no body or header makes it answer 5xx."""

import json
from pathlib import Path

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.serving.sidecar_app import create_sidecar_app
from blocktune.tuner.sidecar.assembly import build_sidecar

POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml")
FIELDS = ["prompt_tokens", "output_tokens", "timestamp", "prefix_group", "extra"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(exclude_categories=()), max_size=20)  # lone surrogates too
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=30,
)
near_valid_items = st.dictionaries(st.sampled_from(FIELDS), scalars, max_size=5)
bodies = (
    json_values.map(lambda v: json.dumps(v).encode())
    | st.lists(near_valid_items, max_size=30).map(lambda v: json.dumps(v).encode())
    | st.lists(near_valid_items, max_size=30).map(
        lambda v: json.dumps({"observations": v}).encode()
    )
    | st.binary(max_size=200)
    | st.just(b"[" * 100_000)  # nesting deeper than the JSON decoder's recursion limit
)
content_types = st.sampled_from(["application/json", "application/json; charset=utf-8"])
refused_types = st.sampled_from(["text/plain", "application/x-www-form-urlencoded", None])
origins = st.sampled_from([None, "own", "http://evil.example", "null"])


def test_no_input_gets_a_server_error(live_server):
    sidecar = build_sidecar(POLICY)
    with live_server(create_sidecar_app(sidecar)) as url, httpx.Client(base_url=url) as client:

        @settings(
            max_examples=150,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(body=bodies, content_type=content_types | refused_types, origin=origins)
        def post(body: bytes, content_type: str | None, origin: str | None) -> None:
            before = len(sidecar.window)
            headers = {} if content_type is None else {"content-type": content_type}
            if origin is not None:
                headers["origin"] = url if origin == "own" else origin
            response = client.post("/v1/observations", content=body, headers=headers)
            assert response.status_code < 500, (response.status_code, response.text)
            if origin not in (None, "own"):
                assert response.status_code == 403
            elif body and not (content_type or "").startswith("application/json"):
                assert response.status_code == 415
            if response.status_code == 200:
                assert len(sidecar.window) == min(1000, before + response.json()["accepted"])
            else:
                assert len(sidecar.window) == before  # nothing partially applied
                assert response.json()["detail"]

        post()
        assert client.get("/healthz").status_code == 200
