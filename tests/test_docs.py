"""Every path and module the documentation and the docstrings name exists.

Read from README.md, docs/*.md and the docstrings (module, class and function) of every
.py file under tuner/, runtime/, kernels/ and traces/. What counts as a reference:

- **A repository path**: a run of path characters (letters, digits, ``_ . / -``) that
  starts with one of the repository's top-level folders and a slash (``TOP_FOLDERS``:
  ``tuner/sim/simulator.py``, ``bench/results/``), where no path character or slash
  comes right before it (a URL's path, ``replay-out/...`` or ``../shared/...`` is none).
  Trailing sentence punctuation is not part of it. It must exist, relative to the
  repository root. A path cut off by a placeholder (``tuner/cli/<command>.py``,
  ``policies/*.yaml``, ``{id}``) must have its folder exist. ``path.py::name`` must
  also define ``name`` (a function or class) at the top of that file.
- **A section of a Markdown file**: a repository path ending in ``.md`` followed by a
  comma and a quoted title (``docs/architecture.md, "Invariants"``) must be one of that
  file's section titles.
- **A relative Markdown link** ``[text](target)`` (a Markdown file only): a target
  without a URL scheme must exist relative to the file holding it, and its anchor
  (``#the-decision``, or the whole target within the same file) must be the anchor of
  one of the linked file's section titles.
- **A module path**: a dotted name that starts with ``blocktune.`` anywhere, or an
  inline code span holding only a dotted name (perhaps followed by a call's
  arguments) whose first part is one of blocktune's packages (``SHORT_ROOTS``:
  ``runtime.block_manager.blocks_for``, ``replay.report``, ``sim.workload``). Its
  longest prefix that names a module file must be followed only by attributes that
  exist: each part by ``getattr`` on the one before, or as a dataclass field or an
  annotated class attribute. A dotted name ending in a file suffix
  (``calibration.yaml``) is a file name, not a module. In a docstring the first part
  may also be a module beside the file (``measure.measure_host`` in tuner/measure/).

Fenced code blocks are read like prose: a command or an output they show names real
paths under the top-level folders too, or none.
"""

import ast
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_FOLDERS = (
    "tuner",
    "runtime",
    "kernels",
    "traces",
    "tests",
    "bench",
    "docs",
    "policies",
    "notebooks",
)
SOURCE_FOLDERS = ("tuner", "runtime", "kernels", "traces")
README_MAX_LINES = 200
FILE_SUFFIXES = frozenset(
    ("py", "md", "yaml", "yml", "json", "jsonl", "csv", "parquet", "c", "h", "txt", "toml")
    + ("ipynb", "sh", "png", "svg", "html")
)

PATH_CHARS = r"[\w./-]"
REPO_PATH = re.compile(
    rf"(?<!{PATH_CHARS})((?:{'|'.join(TOP_FOLDERS)})/{PATH_CHARS}*)(::\w+)?([<*{{])?"
)
MARKDOWN_LINK = re.compile(r"\]\(([^()\s]+)\)")
SECTION_REFERENCE = re.compile(
    rf'(?<!{PATH_CHARS})((?:{"|".join(TOP_FOLDERS)})/{PATH_CHARS}*\.md),\s+"([^"]+)"'
)
URL_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
BLOCKTUNE_NAME = re.compile(r"(?<![\w.])blocktune(?:\.[A-Za-z_]\w*)+")
CALL = re.compile(r"\(.*\)$")


def source_files() -> list[Path]:
    return [path for folder in SOURCE_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]


def short_roots() -> dict[str, str]:
    """The first part of a module name written without `blocktune.` -> its package."""
    roots = {name: f"blocktune.{name}" for name in SOURCE_FOLDERS}
    for path in ROOT.glob("tuner/*/__init__.py"):
        roots[path.parent.name] = f"blocktune.tuner.{path.parent.name}"
    return roots


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("blocktune", *(part for part in parts if part != "__init__")))


SHORT_ROOTS = short_roots()


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def docstrings(path: Path) -> list[str]:
    """The module's, its classes' and its functions' docstrings."""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = ast.walk(ast.parse(path.read_text(encoding="utf-8")))
    return [ast.get_docstring(node) or "" for node in nodes if isinstance(node, kinds)]


def repo_path_problem(path: str, test_name: str | None, placeholder: str | None) -> str | None:
    """Why a repository path named in the text does not hold, or None."""
    path = path.rstrip(".,;:")
    if placeholder:
        folder = path[: path.rfind("/")]
        return None if (ROOT / folder).is_dir() else f"no folder {folder}/"
    if not (ROOT / path).exists():
        return "no such file or folder"
    if test_name and test_name[2:] not in top_level_names(ROOT / path):
        return f"{path} defines no {test_name[2:]}"
    return None


@cache
def top_level_names(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return frozenset(node.name for node in tree.body if isinstance(node, kinds))


def module_file(name: str) -> Path | None:
    """The file of a blocktune module name, or None when it names no module."""
    parts = name.split(".")[1:]
    base = ROOT.joinpath(*parts)
    candidates = [base / "__init__.py", *([base.with_suffix(".py")] if parts else [])]
    return next((candidate for candidate in candidates if candidate.exists()), None)


def has_attribute(owner: object, name: str) -> bool:
    """An attribute, or a field a dataclass or an annotated class declares."""
    declared = {
        **getattr(owner, "__dataclass_fields__", {}),
        **getattr(owner, "__annotations__", {}),
    }
    return hasattr(owner, name) or name in declared


def module_problem(name: str) -> str | None:
    """Why a dotted blocktune name does not resolve, or None."""
    parts = name.split(".")
    split = max(
        (i for i in range(1, len(parts) + 1) if module_file(".".join(parts[:i]))), default=0
    )
    try:
        owner = importlib.import_module(".".join(parts[:split]))
    except ImportError as error:
        return f"does not import: {error}"
    for attribute in parts[split:]:
        if not has_attribute(owner, attribute):
            return f"{'.'.join(parts[:split])} has no {'.'.join(parts[split:])}"
        owner = getattr(owner, attribute, None)
    return None


def module_names(text: str, roots: dict[str, str]) -> set[str]:
    """Every blocktune module name the text holds, in full or from a first part of `roots`."""
    names = set(BLOCKTUNE_NAME.findall(text))
    for span in CODE_SPAN.findall(text):
        span = CALL.sub("", span.strip())
        first, _, rest = span.partition(".")
        if DOTTED.fullmatch(span) and first in roots:
            names.add(f"{roots[first]}.{rest}")
    return {name for name in names if name.split(".")[-1] not in FILE_SUFFIXES}


def reference_problems(text: str, roots: dict[str, str] = SHORT_ROOTS) -> list[str]:
    """What the text names that does not exist: repository paths and module names."""
    problems = []
    for path, test_name, placeholder in REPO_PATH.findall(text):
        if why := repo_path_problem(path, test_name, placeholder):
            problems.append(f"{path}{test_name}: {why}")
    for doc, title in SECTION_REFERENCE.findall(text):
        title = " ".join(title.split())
        if (ROOT / doc).exists() and title not in headings(ROOT / doc):
            problems.append(f'{doc}, "{title}": no such section')
    for name in sorted(module_names(text, roots)):
        if why := module_problem(name):
            problems.append(f"{name}: {why}")
    return problems


def docstring_problems(path: Path) -> list[str]:
    """What a source file's docstrings name that does not exist; a module beside it by its name."""
    package = module_name(path.parent / "__init__.py")
    siblings = {p.stem: f"{package}.{p.stem}" for p in path.parent.glob("*.py")}
    roots = SHORT_ROOTS | siblings
    return [problem for text in docstrings(path) for problem in reference_problems(text, roots)]


@cache
def headings(path: Path) -> frozenset[str]:
    """The titles of a Markdown file's sections (outside fenced code blocks)."""
    titles, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            titles.add(line.lstrip("#").strip())
    return frozenset(titles)


def anchor(title: str) -> str:
    """The anchor a Markdown renderer (GitHub's) gives a section title."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def link_problems(path: Path) -> list[str]:
    problems = []
    for target in MARKDOWN_LINK.findall(path.read_text(encoding="utf-8")):
        if URL_SCHEME.match(target):
            continue
        file, _, section = target.partition("#")
        linked = path.parent / file if file else path
        if not linked.exists():
            problems.append(f"link {target}: no such file or folder")
        elif section and linked.suffix == ".md" and section not in map(anchor, headings(linked)):
            problems.append(f"link {target}: no such section")
    return problems


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_module_a_document_names_exists(doc):
    assert reference_problems(doc.read_text(encoding="utf-8")) + link_problems(doc) == []


def test_every_path_and_module_a_docstring_names_exists():
    found = {}
    for path in source_files():
        if problems := docstring_problems(path):
            found[str(path.relative_to(ROOT))] = problems
    assert found == {}


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES


def test_the_reader_finds_each_kind_of_reference(tmp_path):
    text = (
        "`tuner/sim/simulator.py` and tuner/sim/gone.py, `tests/test_docs.py::test_readme_is_short`"
        " and `tests/test_docs.py::test_gone`, `tuner/cli/<command>.py`, `tuner/gone/<name>.yaml`,"
        " https://example.com/tuner/gone.py, replay-out/tests/x.py,"
        " `blocktune.tuner.sim.simulator`, `blocktune.tuner.sim.gone`,"
        " `sim.simulator.simulate(..., seed=0)`, `sim.simulator.gone`,"
        " `runtime.block_manager.blocks_for`, `calibration.yaml`, `replay.gone`."
    )
    assert reference_problems(text) == [
        "tuner/sim/gone.py: no such file or folder",
        "tests/test_docs.py::test_gone: tests/test_docs.py defines no test_gone",
        "tuner/gone/: no folder tuner/gone/",
        "blocktune.tuner.replay.gone: blocktune.tuner.replay has no gone",
        "blocktune.tuner.sim.gone: blocktune.tuner.sim has no gone",
        "blocktune.tuner.sim.simulator.gone: blocktune.tuner.sim.simulator has no gone",
    ]
    sections = 'docs/architecture.md, "Invariants" and docs/architecture.md,\n"Gone"'
    assert reference_problems(sections) == ['docs/architecture.md, "Gone": no such section']
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Top\n```\n# Fenced\n```\n[a](doc.md#top) [b](gone.md) [c](https://example.com/x)"
        " [d](#fenced) [e](#top)"
    )
    assert link_problems(doc) == [
        "link gone.md: no such file or folder",
        "link #fenced: no such section",
    ]
