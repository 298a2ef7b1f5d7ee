"""The guards both HTTP services share, on a real sidecar and a real worker over loopback:
JSON-only bodies, same-origin requests, standard JSON, safe 422s, read timeout and limits."""

import asyncio
import socket
from pathlib import Path

import httpx
import pytest

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_weights
from blocktune.tuner.config.policy import ServerSettings, load_policy
from blocktune.tuner.serving.http import guarded_app, host_name
from blocktune.tuner.serving.sidecar_app import create_sidecar_app
from blocktune.tuner.serving.worker_app import create_worker_app
from blocktune.tuner.sidecar.assembly import build_sidecar

POLICY = load_policy(Path(__file__).resolve().parents[3] / "policies" / "default.yaml")
JSON = {"content-type": "application/json"}
OBSERVATION = b'[{"prompt_tokens": 12, "output_tokens": 3}]'
COMPLETION = b'{"prompt_ids": [1, 2, 3], "max_tokens": 2}'


@pytest.fixture(scope="module")
def engine_loop():
    loop = EngineLoop(
        Engine(load_weights("tiny-random"), EngineConfig(block_size=8, num_blocks=64))
    )
    loop.start()
    yield loop
    loop.stop()


@pytest.fixture(params=["sidecar", "worker"])
def service(request, engine_loop, live_server):
    """(base URL, the path a body goes to, a valid body, how many bodies took effect)."""
    if request.param == "sidecar":
        sidecar = build_sidecar(POLICY)
        with live_server(create_sidecar_app(sidecar)) as url:
            yield url, "/v1/observations", OBSERVATION, lambda: len(sidecar.window)
    else:
        done = engine_loop.state()["completed"]
        with live_server(
            create_worker_app(engine_loop, model_name="tiny-random", tokenizer=None)
        ) as url:
            yield (
                url,
                "/v1/completions",
                COMPLETION,
                lambda: engine_loop.state()["completed"] - done,
            )


@pytest.mark.parametrize(
    "headers",
    [{"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}],
)
def test_a_body_not_declared_json_is_refused(service, headers):
    url, path, body, applied = service
    response = httpx.post(url + path, content=body, headers=headers)
    assert response.status_code == 415
    assert "Content-Type: application/json" in refusal(response)
    assert applied() == 0
    assert httpx.post(url + path, content=body, headers=JSON).status_code == 200
    assert applied() == 1


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1"])
def test_a_foreign_origin_is_refused_and_the_own_one_served(service, origin):
    url, path, body, applied = service
    response = httpx.post(url + path, content=body, headers={**JSON, "origin": origin})
    assert response.status_code == 403 and origin in refusal(response)
    assert httpx.get(f"{url}/healthz", headers={"origin": origin}).status_code == 403
    assert applied() == 0
    own = httpx.post(url + path, content=body, headers={**JSON, "origin": url})
    assert own.status_code == 200 and applied() == 1


def test_only_loopback_host_names_are_served_by_default(service):
    url, *_ = service
    rebound = httpx.get(f"{url}/healthz", headers={"host": "evil.example:8787"})
    assert rebound.status_code == 421 and "evil.example" in refusal(rebound)
    for host in ("localhost:1", "127.0.0.1", "[::1]:8787", "LOCALHOST"):
        assert httpx.get(f"{url}/healthz", headers={"host": host}).status_code == 200


REBOUND = {**JSON, "host": "evil.example:8000", "origin": "http://evil.example:8000"}


def test_a_rebound_host_is_refused_even_with_a_token(engine_loop, live_server):
    """A page of a rebound name reads nothing, token or not: the token guards mutations only."""
    worker = create_worker_app(engine_loop, model_name="tiny-random", tokenizer=None, token="t")
    with live_server(worker) as url:
        done = engine_loop.state()["completed"]
        completion = httpx.post(f"{url}/v1/completions", content=COMPLETION, headers=REBOUND)
        assert completion.status_code == 421 and "evil.example" in refusal(completion)
        assert httpx.get(f"{url}/admin/state", headers=REBOUND).status_code == 421
        assert engine_loop.state()["completed"] == done
        own = httpx.post(f"{url}/v1/completions", content=COMPLETION, headers=JSON)
        assert own.status_code == 200
    with live_server(create_sidecar_app(build_sidecar(POLICY), token="t")) as url:
        for path in ("/v1/recommendation", "/v1/window", "/metrics"):
            assert httpx.get(url + path, headers=REBOUND).status_code == 421, path
        assert httpx.get(f"{url}/v1/window").status_code == 200


def test_a_deployment_names_its_allowed_hosts(live_server):
    app = create_sidecar_app(build_sidecar(POLICY), token="t", allowed_hosts=["sidecar.internal"])
    with live_server(app) as url:
        for host in ("sidecar.internal", "Sidecar.Internal:8787"):
            assert httpx.get(f"{url}/v1/window", headers={"host": host}).status_code == 200
        other = httpx.get(f"{url}/v1/window", headers={"host": "other.internal"})
        assert other.status_code == 421 and "--allowed-host" in refusal(other)


@pytest.mark.parametrize(
    "host",
    [
        "evil.example@127.0.0.1",
        "evil.example\\@127.0.0.1",
        "evil.example@127.0.0.1:8787",
        "127.0.0.1/evil",
        "127.0.0.1:80:80",
        "127.0.0.1:x",
        "[::1",
        "[evil.example]",
        "",
    ],
)
def test_a_host_header_that_is_no_host_and_port_is_refused(host, live_server):
    sidecar = build_sidecar(POLICY)
    with live_server(create_sidecar_app(sidecar)) as url:
        response = httpx.post(
            f"{url}/v1/observations", content=OBSERVATION, headers={**JSON, "host": host}
        )
        assert response.status_code == 421 and "not a host[:port]" in refusal(response)
    assert len(sidecar.window) == 0


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:8787", "127.0.0.1"),
        ("LocalHost", "localhost"),
        ("[::1]:80", "::1"),
        ("[0:0::1]", "::1"),
        ("a-b.example:", "a-b.example"),
        ("evil.example@127.0.0.1", None),
        ("evil.example\\@127.0.0.1", None),
        ("user:pw@localhost", None),
        ("host name", None),
        ("%zz", None),
    ],
)
def test_host_name_parses_rfc_9110_hosts(header, name):
    assert host_name(header) == name


def test_the_worker_guards_refuse_with_openai_error_objects(engine_loop, live_server):
    with live_server(
        create_worker_app(engine_loop, model_name="tiny-random", tokenizer=None)
    ) as url:
        answers = {
            413: httpx.post(f"{url}/v1/completions", content=b" " * (2 << 20), headers=JSON),
            415: httpx.post(f"{url}/v1/completions", content=COMPLETION),
            403: httpx.post(
                f"{url}/v1/completions", content=COMPLETION, headers={**JSON, "origin": "null"}
            ),
            421: httpx.get(f"{url}/v1/models", headers={"host": "evil.example"}),
        }
    for status, response in answers.items():
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, status
        assert error["type"] == "invalid_request_error" and error["message"], status


@pytest.mark.parametrize(
    "body",
    [
        b'[{"prompt_tokens": NaN, "output_tokens": 3}]',
        b'{"prompt_ids": [1], "max_tokens": NaN}',
        b'{"prompt": "\\ud800", "max_tokens": 2}',
        b'{"prompt": "\xff", "max_tokens": 2}',
        b"[" * 1000,
    ],
)
def test_a_body_that_is_not_standard_json_is_a_400(service, body):
    url, path, _, applied = service
    response = httpx.post(url + path, content=body, headers=JSON)
    assert response.status_code == 400
    assert refusal(response).startswith("the body is not standard JSON: ")
    assert "line 1 column" in refusal(response)
    assert applied() == 0


def refusal(response: httpx.Response) -> str:
    """The reason of a refusal: FastAPI's `detail` (sidecar) or OpenAI's error message (worker)."""
    body = response.json()
    return body["detail"] if "detail" in body else body["error"]["message"]


def test_a_422_leaves_out_values_that_are_not_json(engine_loop, live_server):
    with live_server(
        create_worker_app(engine_loop, model_name="tiny-random", tokenizer=None)
    ) as url:
        huge = httpx.post(
            f"{url}/v1/completions", content=b'{"prompt_ids": [1], "top_p": 1e400}', headers=JSON
        )
        assert huge.status_code == 422  # 1e400 reads as infinity: no JSON to echo
        error = huge.json()["error"]  # strict JSON: the response parsed
        assert error["param"] == "top_p" and "inf" not in huge.text.lower()
        plain = httpx.post(f"{url}/v1/completions", json={"prompt_ids": [1], "top_p": "x"})
        assert plain.status_code == 422 and plain.json()["error"]["param"] == "top_p"


def raw_connection(url: str, timeout_s: float = 10.0) -> socket.socket:
    """A socket to `url`'s server; a read waits `timeout_s` (beyond the limit under test)."""
    host, port = url.removeprefix("http://").split(":")
    connection = socket.create_connection((host, int(port)))
    connection.settimeout(timeout_s)
    return connection


def read_until_closed(connection: socket.socket) -> bytes | None:
    """Everything the server sends until it closes the connection; None if it never does."""
    received = b""
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except TimeoutError:
        return None
    finally:
        connection.close()
    return received


def test_a_stalled_request_and_an_idle_connection_are_closed(live_server):
    settings = ServerSettings(read_timeout="0.5s", keep_alive="5s")
    with live_server(create_sidecar_app(build_sidecar(POLICY)), settings) as url:
        stalled = raw_connection(url)
        head = b"POST /v1/observations HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        stalled.sendall(head + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n[{")
        assert read_until_closed(stalled) == b""
        assert read_until_closed(raw_connection(url)) == b""  # never sends a byte
        half_head = raw_connection(url)
        half_head.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        assert read_until_closed(half_head) == b""
        assert httpx.get(f"{url}/healthz").status_code == 200


def test_an_idle_keep_alive_connection_is_closed_after_keep_alive(live_server):
    settings = ServerSettings(read_timeout="30s", keep_alive="0.3s")
    with live_server(create_sidecar_app(build_sidecar(POLICY)), settings) as url:
        connection = raw_connection(url, timeout_s=3.0)  # uvicorn's own default is 5 s
        connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = read_until_closed(connection)  # the answer, then the close
        assert answer is not None and answer.startswith(b"HTTP/1.1 200")
        assert answer.endswith(b'{"status":"ok"}')


def test_an_answer_that_takes_longer_than_the_read_timeout_is_not_cut(live_server):
    app = guarded_app()

    @app.post("/slow")
    async def slow(body: dict) -> dict:
        await asyncio.sleep(1.0)  # five read timeouts: the request itself arrived at once
        return body

    with live_server(app, ServerSettings(read_timeout="0.2s")) as url:
        response = httpx.post(f"{url}/slow", json={"n": 1})
    assert response.status_code == 200 and response.json() == {"n": 1}


def test_connections_beyond_the_limit_are_closed_at_once(live_server):
    settings = ServerSettings(read_timeout="30s", max_connections=3)
    with live_server(create_sidecar_app(build_sidecar(POLICY)), settings) as url:
        held = [raw_connection(url) for _ in range(3)]
        assert read_until_closed(raw_connection(url)) == b""
        held[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert read_until_closed(held[0]).startswith(b"HTTP/1.1 200")
        for connection in held[1:]:
            connection.close()
