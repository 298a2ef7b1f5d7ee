"""What the sidecar reads in the output of the vLLM server it runs: vLLM's own log lines.

vLLM logs `LEVEL MM-DD HH:MM:SS [file.py:line] message` (its engine and worker
processes put `(EngineCore_DP0 pid=123) ` before that, and before the raw lines of
a traceback they print). With request logging on, a request's prompt is part of a
message (`Received request ...: prompt: '...'`, the prompt quoted with its
newlines escaped), so a prompt can never begin a line or a message; it can say
anything inside one. So only where a line or a message begins counts:

- the platform and the attention backend come from messages that begin as vLLM's
  do ("Automatically detected platform cpu.", the engine's configuration line
  "Initializing a V1 LLM engine ... device_config=cpu", "Using FLASH_ATTN
  attention backend ...");
- an exception (a failed start's reason) is `SomeError: message` at the start of
  a line that is not a log line (a traceback's last line) or at the start of an
  ERROR or CRITICAL message (a traceback vLLM logs).

Colour codes (vLLM colours its lines on a terminal) are dropped first.
`OutputReader` reads a server's output in a thread, keeps its tail for a failed
start's reason, copies it to the log file and tells what it names.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

from blocktune.tuner.config.vllm_backends import BACKEND_LINE, PLATFORM_LINE
from blocktune.tuner.operations import log_event

__all__ = ["EngineInfoSink", "OutputReader", "engine_info", "exception_message"]

log = logging.getLogger("blocktune.sidecar")

LOG_TAIL_LINES = 1000
"""Lines of a server's output kept for the reason of a failed start (vLLM's root cause comes
a few hundred lines of tracebacks before it exits)."""
COLOUR = re.compile(r"\x1b\[[0-9;]*m")
PROCESS_PREFIX = re.compile(r"\(\w+ pid=\d+\) ")
LOG_PREFIX = re.compile(
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"(?:\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? )?\[[\w./-]+:\d+\] "
)
"""vLLM's log format, `%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s`."""
PLATFORM_MESSAGES = ("Automatically detected platform ", "Initializing a V1 LLM engine")
EXCEPTION = re.compile(r"\w+(?:Error|Exception): .+")
ERROR_LEVELS = ("ERROR", "CRITICAL")

EngineInfoSink = Callable[[str | None, str | None], None]
"""Told (platform, attention backend) as the server's log reveals them."""


def _parts(line: str) -> tuple[str | None, str]:
    """(the log level, the message) of a vLLM log line; (None, the text) of another line."""
    text = PROCESS_PREFIX.sub("", COLOUR.sub("", line.rstrip("\r\n")), count=1)
    logged = LOG_PREFIX.match(text)
    return (None, text) if logged is None else (logged.group("level"), text[logged.end() :])


def engine_info(line: str) -> tuple[str | None, str | None]:
    """(platform, attention backend) that one line of vLLM's names, each None if not."""
    level, message = _parts(line)
    if level is None:
        return None, None
    platform = PLATFORM_LINE.search(message) if message.startswith(PLATFORM_MESSAGES) else None
    backend = BACKEND_LINE.match(message)
    return (
        None if platform is None else platform.group(1),
        None if backend is None else backend.group(1),
    )


def exception_message(line: str) -> str | None:
    """`SomeError: message` where a line shows one as a traceback's end (module docstring)."""
    level, message = _parts(line)
    if level is not None and level not in ERROR_LEVELS:
        return None
    match = EXCEPTION.match(message)
    return None if match is None else match.group(0).strip()


class OutputReader:
    """Reads a child's output in a thread: keeps the tail, copies it to a file, and tells
    the platform and attention backend vLLM's log lines name."""

    def __init__(self, stream: IO[str], log_file: Path | None, on_info: EngineInfoSink) -> None:
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self._stream = stream
        self._log_file = log_file
        self._on_info = on_info
        self._thread = threading.Thread(target=self._run, name="vllm-output", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sink = None
        if self._log_file is not None:
            try:
                sink = self._log_file.open("a", encoding="utf-8")
            except OSError as error:
                log_event(
                    log, "vllm_log_file_unwritable", file=str(self._log_file), error=str(error)
                )
        try:
            for line in self._stream:
                self.tail.append(line.rstrip("\n"))
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                platform, backend = engine_info(line)
                if platform is not None or backend is not None:
                    self._on_info(platform, backend)
        except (OSError, ValueError):  # the pipe closed under us at shutdown
            pass
        finally:
            if sink is not None:
                sink.close()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def close(self) -> None:
        """Close the stream read (once the server is gone)."""
        self._stream.close()
