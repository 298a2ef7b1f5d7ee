"""What every benchmark shares: its command line and its dated result file.

`bench_parser` builds a benchmark's command line from its docstring, with every default shown by
`--help` and the `--results` folder. `ResultFile` prints what the benchmark reports and keeps
it; `write` puts it in a new file `<results>/<YYYY-MM-DD>-<name>.md` (`-2`, `-3`, ... added
where that name is taken, so no earlier result is overwritten) after a header holding the
command, when it ran, and the machine's load average before and after and its CPU count.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The docstring as written, and each option's default after its help."""


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: `doc` (its module docstring) as the description, and
    `--results`, the folder its result file goes to."""
    made = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)
    made.add_argument(
        "--results", type=Path, default=RESULTS, help="folder of the dated result file"
    )
    return made


def shorten(text: str) -> str:
    """`text` with the repository's folder left out of its paths and the temporary folder
    written as $TMP."""
    return text.replace(f"{REPO}{os.sep}", "").replace(tempfile.gettempdir(), "$TMP")


def load() -> str:
    """The machine's load averages over 1, 5 and 15 minutes."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def new_path(folder: Path, name: str, day: datetime.date) -> Path:
    """`folder/<day>-<name>.md`, or the first of `-2`, `-3`, ... after the name not taken."""
    path, copy = folder / f"{day.isoformat()}-{name}.md", 1
    while path.exists():
        copy += 1
        path = folder / f"{day.isoformat()}-{name}-{copy}.md"
    return path


class ResultFile:
    """A benchmark's printed report, kept for its dated result file.

    `script` is the benchmark's `__file__` (its name names the file), the first line of `doc`
    (its docstring) the file's title, `argv` its arguments (default: the command line's);
    `preformatted` keeps the text in a code block, for reports laid out in fixed-width columns
    rather than Markdown.
    """

    def __init__(
        self,
        script: str,
        doc: str,
        folder: Path = RESULTS,
        argv: list[str] | None = None,
        preformatted: bool = False,
    ) -> None:
        self.name = Path(script).stem.replace("_", "-")
        arguments = sys.argv[1:] if argv is None else argv
        self.command = shlex.join(["python", f"bench/{Path(script).name}", *arguments])
        self.title = doc.strip().splitlines()[0].rstrip(".")
        self.folder, self.preformatted = folder, preformatted
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.load_before = load()
        self.lines: list[str] = []

    def print(self, text: str = "") -> None:
        """Print `text` now and keep it for the file."""
        print(text, flush=True)
        self.lines.append(text)

    def write(self) -> Path:
        """Write the file (the folder made where missing, paths shortened); returns its path."""
        body = ["```", *self.lines, "```"] if self.preformatted else self.lines
        text = "\n".join(
            [
                f"# {self.title} ({self.started:%Y-%m-%d %H:%M} UTC)",
                "",
                f"    {self.command}",
                "",
                f"Load average {self.load_before} before, {load()} after; {os.cpu_count()} CPUs.",
                "",
                *body,
                "",
            ]
        )
        self.folder.mkdir(parents=True, exist_ok=True)
        path = new_path(self.folder, self.name, self.started.date())
        with path.open("x", encoding="utf-8") as out:
            out.write(shorten(text))
        print(f"wrote {shorten(str(path))}")
        return path
