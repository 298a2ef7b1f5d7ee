"""The README's serving quick start, as a newcomer copies it: the worker it starts, the wait
for it, and the first request it sends."""

import json
import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[3] / "README.md"


def quick_start_commands() -> list[list[str]]:
    """The shell commands of the README's "Serving quick start", each split as a shell would."""
    section = README.read_text(encoding="utf-8").split("## Serving quick start", 1)[1]
    section = section.split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL)
    text = "\n".join(blocks).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()]


def first_curl_body() -> dict:
    curl = next(words for words in quick_start_commands() if words[0] == "curl")
    return json.loads(curl[curl.index("-d") + 1])


def test_the_first_request_of_the_quick_start_is_greedy():
    """SmolLM2-135M sampled at OpenAI's default temperature of 1 answers mostly broken text:
    a newcomer's first reply would read as a broken engine."""
    assert first_curl_body()["temperature"] == 0


def test_the_quick_start_waits_for_the_worker_before_its_first_request():
    """The worker loads its model before it listens: a curl sent at once is refused."""
    lines = [" ".join(words) for words in quick_start_commands()]
    worker = next(i for i, line in enumerate(lines) if " worker " in line)
    first_request = next(i for i, line in enumerate(lines) if line.startswith("curl"))
    port = re.search(r"--port (\d+)", lines[worker])[1]
    wait = f"until curl -sf http://127.0.0.1:{port}/health; do sleep 1; done"
    assert wait in lines[worker + 1 : first_request]
