"""`blocktune worker` as a newcomer meets it: the line that says it serves, and its refusals
of a pool, a model or a port it cannot use."""

import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from blocktune.tuner.cli import main
from blocktune.tuner.operations import free_port

WORKER = [sys.executable, "-m", "blocktune.tuner.cli", "worker", "--model", "tiny-random"]
SMALL = ["--kv-bytes", "1MiB", "--backend", "torch", "--no-huge-pages", "--threads", "1"]


def read_lines_until(process: subprocess.Popen, text: str, timeout_s: float) -> list[str]:
    """The stderr lines of `process` up to the first holding `text` (all of them if it exits
    or `timeout_s` passes first)."""
    lines: list[str] = []

    def read():
        for line in process.stderr:
            lines.append(line)
            if text in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    return lines


@pytest.mark.slow
def test_the_worker_says_where_it_serves_once_it_answers():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [*WORKER, *SMALL, "--port", str(port)]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = read_lines_until(process, "ready", timeout_s=120)
        ready = lines[-1] if lines else ""
        # Asked at once, as a script that waits for the line does.
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
    assert ready.startswith(f"blocktune worker ready: http://127.0.0.1:{port} "), lines
    assert "model tiny-random, block size 16" in ready
    assert health == 200
    # The limit the API states is the one the line states.
    assert f"max_model_len {models['data'][0]['max_model_len']}:" in ready


def ready_line(monkeypatch, caplog, *flags: str) -> str:
    """The ready line of `blocktune worker --model tiny-random FLAGS`, served by a stand-in
    for uvicorn that listens until the line is logged."""
    import logging
    import socket
    import time

    def serve(_loop, *, host, port, **_):
        with socket.create_server((host, port)):
            deadline = time.monotonic() + 10
            while "ready" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.01)

    monkeypatch.setattr("blocktune.tuner.serving.worker_app.serve_worker", serve)
    with caplog.at_level(logging.INFO, logger="blocktune.worker"):
        assert main(["worker", *SMALL, "--port", str(free_port()), *flags]) == 0
    return next(r.getMessage() for r in caplog.records if "ready" in r.getMessage())


def test_the_ready_line_states_one_max_model_len_and_what_sets_it(monkeypatch, caplog):
    """tiny-random has 4096 positions; 1 MiB holds 2048 tokens of it, so a request may reach
    2049 (its last token needs no slot): the limit the API states and its errors name."""
    line = ready_line(monkeypatch, caplog)
    assert line.endswith(
        "max_model_len 2049: the model's 4096 positions, but the KV pool holds 2048 tokens)"
    )
    caplog.clear()
    line = ready_line(monkeypatch, caplog, "--max-model-len", "512")
    assert line.endswith("max_model_len 512 (--max-model-len), a KV pool of 2048 tokens)")


def test_a_model_the_worker_does_not_know_is_refused_naming_those_it_knows(capsys):
    assert main(["worker", "--model", "smollm3", "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    assert (
        "blocktune worker: model 'smollm3' is neither a known model (tiny-random, smollm2)" in error
    )


def test_a_pool_that_holds_no_block_is_refused_naming_the_flag_and_the_bytes_needed(capsys):
    """tiny-random's K and V take 2 layers x 2 heads x 16 x 4 bytes x 2 = 512 bytes a token;
    the pool is whole blocks of the largest candidate, 128 tokens by default."""
    port = str(free_port())
    assert main(["worker", "--kv-bytes", "1KiB", "--port", port]) == 2
    assert capsys.readouterr().err == (
        "blocktune worker: --kv-bytes 1.0KiB holds no block: one token needs 512 bytes, one "
        "block of 128 tokens (the largest candidate) 65536 (64.0KiB)\n"
    )
