"""A vLLM server started from a command template for one measurement, and stopped after it.

`calibrate --engine vllm` and `validate --engine vllm` start one server per
block size: the template's `{block_size}` and `{port}` are filled in, the
server runs in its own process group with its output appended to a log file,
and `VllmServer` waits for `/health`. The log tells the platform and attention
backend vLLM selected. A server that exits or is not healthy in time raises
`VllmStartError` with the last error line of its log; `stop` sends SIGTERM to
the group and SIGKILL after `STOP_TIMEOUT_S`.

The HTTP client is httpx, as the sidecar's: this is the lowest floor that times
an engine (`tuner.measure`), and the architecture rules keep only HTTP
*frameworks* to the serving layer.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from blocktune.tuner.config.policy import BLOCK_SIZE_PLACEHOLDER
from blocktune.tuner.config.vllm_backends import BACKEND_LINE, PLATFORM_LINE
from blocktune.tuner.operations import NotReady, free_port, wait_until_ready

__all__ = [
    "PORT_PLACEHOLDER",
    "STOP_TIMEOUT_S",
    "VllmServer",
    "VllmStartError",
    "default_vllm_command",
    "interpreter_torch_version",
]

PORT_PLACEHOLDER = "{port}"
STOP_TIMEOUT_S = 30.0
ERROR_LINE = re.compile(r"(\w+(?:Error|Exception): .+)")


class VllmStartError(RuntimeError):
    """A vLLM server that exited or did not answer /health in time (the message says why)."""


def vllm_server_argv(
    venv: Path,
    model: Path,
    *,
    dtype: str = "float32",
    max_model_len: int = 2048,
    port: str = PORT_PLACEHOLDER,
    served_model_name: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The argv of vLLM's OpenAI server from `venv` (its `vllm` command cannot always find
    its own metadata, `python -m` works), on 127.0.0.1, eager, `--block-size` left as the
    template's placeholder; `extra` goes before it."""
    named = [] if served_model_name is None else ["--served-model-name", served_model_name]
    return [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        *named,
        "--dtype",
        dtype,
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--host",
        "127.0.0.1",
        "--port",
        port,
        *extra,
        "--block-size",
        BLOCK_SIZE_PLACEHOLDER,
    ]


def default_vllm_command(venv: Path, model: Path, dtype: str, max_model_len: int) -> str:
    """`vllm_server_argv` as one command template, `{port}` and `{block_size}` in it."""
    return shlex.join(vllm_server_argv(venv, model, dtype=dtype, max_model_len=max_model_len))


class VllmServer:
    """One vLLM server at one block size (a context manager: started, then stopped)."""

    def __init__(
        self,
        template: str,
        block_size: int,
        log_file: Path,
        *,
        start_timeout_s: float,
        env: dict[str, str] | None = None,
    ) -> None:
        if BLOCK_SIZE_PLACEHOLDER not in template or PORT_PLACEHOLDER not in template:
            raise ValueError(
                f"the vLLM command must contain {BLOCK_SIZE_PLACEHOLDER} and "
                f"{PORT_PLACEHOLDER}, got: {template}"
            )
        self.block_size = block_size
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            part.replace(BLOCK_SIZE_PLACEHOLDER, str(block_size)).replace(
                PORT_PLACEHOLDER, str(self.port)
            )
            for part in shlex.split(template)
        ]
        self.log_file = log_file
        self.start_timeout_s = start_timeout_s
        self._env = env
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Run the command and wait for /health; `VllmStartError` when it does not come."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("a", encoding="utf-8") as log:
            log.write(f"$ {shlex.join(self.argv)}\n")
            log.flush()
            try:
                self._process = subprocess.Popen(
                    self.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    env=self._env,
                )
            except OSError as error:
                raise VllmStartError(f"cannot run {self.argv[0]}: {error}") from error
        try:
            wait_until_ready(
                self.url, self._process, timeout_s=self.start_timeout_s, path="/health"
            )
        except NotReady as error:
            self.stop()
            raise VllmStartError(
                f"vLLM at block size {self.block_size}: {error}{self._last_error()} "
                f"(its log: {self.log_file})"
            ) from error

    def engine_info(self) -> tuple[str | None, str | None]:
        """(platform, attention backend) as the server's log names them, None where not."""
        platform = backend = None
        for line in self.log_file.read_text(encoding="utf-8", errors="replace").splitlines():
            if match := PLATFORM_LINE.search(line):
                platform = match.group(1)
            if match := BACKEND_LINE.search(line):
                backend = match.group(1)
        return platform, backend

    def _last_error(self) -> str:
        text = self.log_file.read_text(encoding="utf-8", errors="replace")
        errors = [m.group(1) for line in text.splitlines() if (m := ERROR_LINE.search(line))]
        return f": {errors[-1][:300]}" if errors else ""

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after `STOP_TIMEOUT_S`."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                process.wait()
        self._signal(signal.SIGKILL)  # whatever the group left behind
        self._process = None

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signum)


def interpreter_torch_version(argv: Sequence[str]) -> str | None:
    """The torch version installed for the command's interpreter, when the command is a
    Python (read from the package metadata, without importing torch), else None."""
    if not Path(argv[0]).name.startswith("python"):
        return None
    code = "import importlib.metadata as m; print(m.version('torch'))"
    try:
        done = subprocess.run(
            [argv[0], "-c", code], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None
