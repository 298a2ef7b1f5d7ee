"""`blocktune generate` with text, chat and token-id prompts, and the model's own limits for
both engine commands (a 512-position model starts without --max-model-len)."""

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_pretrained
from blocktune.runtime.sampling import SamplingParams
from blocktune.tuner.cli import main


def write_lines(path, *items):
    path.write_text("".join((i if isinstance(i, str) else json.dumps(i)) + "\n" for i in items))
    return path


def run_json(capsys, *args) -> dict:
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_text_chat_and_id_prompts_print_what_the_engine_generates(tmp_path, capsys):
    loaded = load_pretrained("tiny-random")
    chat = [{"role": "user", "content": "Where is my order?"}]
    prompts = write_lines(
        tmp_path / "prompts.jsonl",
        {"prompt": "Hello, café", "max_tokens": 6},
        "",
        {"messages": chat, "max_tokens": 5},
        {"prompt_ids": [5, 6, 7], "max_tokens": 4},
    )
    report = run_json(capsys, "--model", "tiny-random", "--prompts", str(prompts))
    ids = [
        loaded.tokenizer.encode("Hello, café"),
        loaded.tokenizer.apply_chat_template(chat),
        [5, 6, 7],
    ]
    engine = Engine(loaded.model, EngineConfig(block_size=16, num_blocks=256))
    expected = engine.generate(ids, [SamplingParams(max_tokens=n) for n in (6, 5, 4)])
    text, answer, by_id = report["outputs"]
    assert text["prompt"] == "Hello, café" and text["token_ids"] == expected[0].token_ids
    assert text["text"] == loaded.tokenizer.decode(expected[0].token_ids)
    assert answer["prompt"] == "Where is my order?"
    assert answer["text"] == loaded.tokenizer.decode(expected[1].token_ids)
    assert by_id == {"prompt_ids": [5, 6, 7], "token_ids": expected[2].token_ids,
                     "finish_reason": "length"}  # fmt: skip
    assert main(["generate", "--model", "tiny-random", "--prompts", str(prompts)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"[0] 'Hello, café' -> {text['text']!r} (length)"
    assert printed[2] == f"[2] 3 prompt tokens -> {expected[2].token_ids} (length)"


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"prompt_ids": ["1"]}', ":1: prompt_ids.0: Input should be a valid integer"),
        ('{"prompt": "x", "max_tokens": "16"}', ":1: max_tokens: Input should be a valid integer"),
        ('{"prompt": "x", "max_tokens": true}', ":1: max_tokens"),
        ('{"prompt": "x", "temperature": NaN}', ":1: temperature: Input should be a finite"),
        ('{"prompt": "x", "prompt_ids": [1]}', ":1: line: Value error, give exactly one of"),
        ('{"prompt": "x", "bogus": 1}', ":1: bogus: Extra inputs are not permitted"),
        ("[1, 2]", ":1: line: Input should be a valid dictionary"),
        ("{not json", ":1: invalid JSON"),
        ('{"prompt": "a\\ud800"}', ":1: prompt: Input should be a valid string"),
        ('{"prompt_ids": [1, 999]}', ":1: token id 999 is outside the vocabulary"),
    ],
)
def test_bad_lines_are_named_by_file_line_and_field(tmp_path, capsys, line, needle):
    prompts = write_lines(tmp_path / "bad.jsonl", line)
    assert main(["generate", "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}{needle}" in err, err


@pytest.fixture(scope="module")
def short_model(tmp_path_factory, save_random_llama):
    """A random Llama folder saved by transformers with only 512 positions."""
    folder = tmp_path_factory.mktemp("llama-512")
    save_random_llama(folder, vocab_size=300, max_position_embeddings=512)
    return folder


@pytest.mark.slow
def test_generate_takes_max_model_len_from_the_model(short_model, tmp_path, capsys):
    fits = write_lines(tmp_path / "fits.jsonl", {"prompt_ids": [3] * 500, "max_tokens": 30})
    report = run_json(capsys, "--model", str(short_model), "--prompts", str(fits))
    assert len(report["outputs"][0]["token_ids"]) == 12  # stopped at position 512
    long = write_lines(tmp_path / "long.jsonl", {"prompt_ids": [3] * 512})
    assert main(["generate", "--model", str(short_model), "--prompts", str(long)]) == 2
    assert "max_model_len 512 leaves no room" in capsys.readouterr().err


@pytest.mark.slow
def test_worker_starts_on_a_512_position_model_without_max_model_len(short_model, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "blocktune.tuner.cli", "worker", "--model", str(short_model)]
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        worker = subprocess.Popen(
            [*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=os.environ
        )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            assert worker.poll() is None, log.read_text()
            try:
                models = httpx.get(f"{url}/v1/models", timeout=1).json()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert models["data"][0]["id"] == str(short_model)
        assert models["data"][0]["max_model_len"] == 512
        body = {"prompt_ids": [3] * 500, "max_tokens": 13}
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 400 and "12 tokens left" in refused.json()["error"]["message"]
    finally:
        worker.terminate()
        worker.wait(timeout=30)
