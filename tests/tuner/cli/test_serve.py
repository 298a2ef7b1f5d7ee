"""`blocktune serve` as a real process, its refusals, and the policy's sidecar sections."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from blocktune.tuner.cli import build_parser, main
from blocktune.tuner.cli.host_args import with_allowed_hosts
from blocktune.tuner.config.config_files import ConfigError
from blocktune.tuner.config.engine_settings import engine_settings
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.operations import NotReady, free_port, wait_until_ready

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = ROOT / "policies" / "default.yaml"


def start(port: int, state: Path, env: dict, *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "blocktune.tuner.cli", "serve", "--policy", str(DEFAULT)]
    command += ["--port", str(port), "--state-file", str(state), *flags]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process, timeout_s=60, path="/readyz")
    except NotReady as error:
        process.kill()
        raise AssertionError(f"{error}: {process.communicate()[0]}") from None
    return process


def stop(process: subprocess.Popen, sig: int) -> tuple[int, list[dict]]:
    process.send_signal(sig)
    output, _ = process.communicate(timeout=30)
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return process.returncode, events


def test_serve_answers_saves_on_sigterm_and_restores_on_start(tmp_path):
    env = {**os.environ, "BLOCKTUNE_TOKEN": "t0k3n"}
    auth = {"Authorization": "Bearer t0k3n"}
    state, port = tmp_path / "state.json", free_port()
    url = f"http://127.0.0.1:{port}"
    process = start(port, state, env)
    try:
        items = [{"prompt_tokens": 20 + i % 5, "output_tokens": 9} for i in range(150)]
        assert httpx.post(f"{url}/v1/observations", json=items).status_code == 401
        assert httpx.post(f"{url}/v1/observations", json=items, headers=auth).status_code == 200
        assert httpx.get(f"{url}/openapi.json").json()["info"]["title"] == "blocktune sidecar"
        assert "blocktune_observations_total 150.0" in httpx.get(f"{url}/metrics").text
    finally:
        code, events = stop(process, signal.SIGTERM)
    assert code == 0
    assert [e["event"] for e in events][-1] == "sidecar_stopped"
    assert len(json.loads(state.read_text())["window"]["prompt_tokens"]) == 150

    process = start(port, state, env)
    try:
        assert httpx.get(f"{url}/v1/window").json()["count"] == 150
        decision = httpx.post(f"{url}/v1/decide", headers=auth).json()
        assert decision["samples"] == 150
    finally:
        code, events = stop(process, signal.SIGINT)
    assert code == 0
    names = [e["event"] for e in events]
    assert names[:3] == ["state_restored", "serving", "sidecar_started"]
    assert "decision" in names
    assert json.loads(state.read_text())["recommendation"]["samples"] == 150


def test_serve_refuses_a_public_address_without_a_token(monkeypatch, capsys):
    monkeypatch.delenv("BLOCKTUNE_TOKEN", raising=False)
    assert main(["serve", "--policy", str(DEFAULT), "--host", "0.0.0.0"]) == 2
    assert "refusing to bind 0.0.0.0" in capsys.readouterr().err


def test_serve_reports_a_bad_policy(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    text = DEFAULT.read_text()
    bad.write_text(text + "server: {port: 0}\n")
    assert main(["serve", "--policy", str(bad)]) == 2
    line = len(text.splitlines()) + 1
    assert f"{bad}:{line}: server.port: Input should be greater than or equal to 1" in (
        capsys.readouterr().err
    )


SIDECAR_SECTIONS = """
sources:
  push: false
  vllm_metrics: {url: "http://127.0.0.1:8000/metrics", interval: 10s}
  jsonl_log: {path: requests.jsonl, prompt_field: usage.prompt_tokens}
server: {host: 127.0.0.1, port: 9000, state_file: state.json, initial_block_size: 32}
auth: {token_env: MY_TOKEN}
"""


def test_policy_sidecar_sections_and_their_defaults(tmp_path):
    default = load_policy(DEFAULT)
    assert default.sources.push and default.sources.vllm_metrics is None
    assert (default.server.host, default.server.port) == ("127.0.0.1", 8787)
    assert default.auth.token_env == "BLOCKTUNE_TOKEN" and default.actuator.kind == "none"
    assert engine_settings(default).block_size == 16
    path = tmp_path / "p.yaml"
    path.write_text(DEFAULT.read_text() + SIDECAR_SECTIONS)
    policy = load_policy(path)
    assert policy.sources.vllm_metrics.interval.total_seconds() == 10
    assert policy.sources.jsonl_log.prompt_field == "usage.prompt_tokens"
    assert policy.sources.jsonl_log.output_field == "output_tokens"
    assert engine_settings(policy).block_size == 32 and policy.auth.token_env == "MY_TOKEN"
    narrow = tmp_path / "narrow.yaml"
    narrow.write_text(DEFAULT.read_text().replace("[8, 16, 32, 64, 128]", "[32, 64]"))
    assert engine_settings(load_policy(narrow)).block_size == 32


@pytest.mark.parametrize(
    ("extra", "key", "message"),
    [
        ("sources: {push: false}\n", "sources", "no source is on"),
        ("sources: {vllm_metrics: {url: 'ftp://x/metrics'}}\n", "sources.vllm_metrics.url", "http"),
        (
            "sources: {jsonl_log: {path: a, prompt_field: 'usage..p'}}\n",
            "sources.jsonl_log",
            "dotted",
        ),
        ("server: {initial_block_size: 256}\n", "(top level)", "not among the candidates"),
        ("actuator: {kind: http}\n", "actuator", "needs the worker's url"),
        ("actuator: {url: 'http://127.0.0.1:8000'}\n", "actuator", "kind is none"),
        (
            "actuator: {kind: http, url: 'http://127.0.0.1:8000'}\n"
            "sources: {vllm_metrics: {url: 'http://127.0.0.1:8001/metrics'}}\n",
            "(top level)",
            "fixes its block size",
        ),
        ("auth: {token: abc}\n", "auth.token", "Extra inputs"),
        (
            "server: {allowed_hosts: ['http://x:80']}\n",
            "server.allowed_hosts[0]",
            "without scheme or port",
        ),
        (
            "server: {allowed_hosts: [a.b, '[fd00:::1::]']}\n",
            "server.allowed_hosts[1]",
            "not an IPv6 address",
        ),
    ],
)
def test_policy_check_covers_the_sidecar_sections(tmp_path, capsys, extra, key, message):
    path = tmp_path / "policy.yaml"
    path.write_text(DEFAULT.read_text() + extra)
    with pytest.raises(ConfigError):
        load_policy(path)
    assert main(["policy", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f": {key}" in out and message in out


def test_allowed_hosts_from_the_policy_and_the_flag(tmp_path):
    path = tmp_path / "p.yaml"
    hosts = "server: {allowed_hosts: [Tuner.Internal, '[FD00:0::1]', 10.0.0.5]}\n"
    path.write_text(DEFAULT.read_text() + hosts)
    server = load_policy(path).server
    assert server.allowed_hosts == ("tuner.internal", "fd00::1", "10.0.0.5")
    args = build_parser().parse_args(
        ["worker", "--allowed-host", "Proxy.Example", "--allowed-host", "[::2]"]
    )
    assert with_allowed_hosts(server, args).allowed_hosts == ("proxy.example", "::2")
    assert with_allowed_hosts(server, build_parser().parse_args(["worker"])) == server
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--policy", "p", "--allowed-host", "a.b:80"])


def test_serve_answers_the_hosts_it_is_told_to(tmp_path):
    env = {**os.environ, "BLOCKTUNE_TOKEN": "t0k3n"}
    port = free_port()
    process = start(port, tmp_path / "state.json", env, "--allowed-host", "tuner.internal")
    try:
        url = f"http://127.0.0.1:{port}/v1/window"
        assert httpx.get(url, headers={"host": f"tuner.internal:{port}"}).status_code == 200
        assert httpx.get(url, headers={"host": "evil.example"}).status_code == 421
    finally:
        code, events = stop(process, signal.SIGTERM)
    assert code == 0
    serving = next(e for e in events if e["event"] == "serving")
    assert serving["allowed_hosts"] == ["loopback", "tuner.internal"]


def test_serve_saves_on_sighup_as_on_sigterm(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "BLOCKTUNE_TOKEN"}
    state, port = tmp_path / "state.json", free_port()
    process = start(port, state, env)
    try:
        items = [{"prompt_tokens": 20 + i % 5, "output_tokens": 9} for i in range(40)]
        assert httpx.post(f"http://127.0.0.1:{port}/v1/observations", json=items).status_code == 200
    finally:
        code, events = stop(process, signal.SIGHUP)  # the terminal it ran in was closed
    assert code == 0
    assert [e["event"] for e in events][-1] == "sidecar_stopped"
    assert len(json.loads(state.read_text())["window"]["prompt_tokens"]) == 40
