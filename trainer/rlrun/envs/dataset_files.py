"""Reading the ``dataset`` env's files into rows: which files a path names, loading them with the ``datasets``
library's local loaders (never the Hugging Face Hub), and checking and converting each cell.

What :mod:`rlrun.envs.dataset` builds its task stream from; every error is a ``ValueError`` naming the
env's arg (``path``, ``prompt``, ``answer``, ``info_columns``…) and, for a bad cell, its row.
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlrun.envs.base import Messages, check_messages

log = logging.getLogger(__name__)

#: File extensions read without a ``format`` arg, and the ``datasets`` loader each one uses.
EXTENSIONS: dict[str, str] = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
#: Values of the ``format`` arg, and the ``datasets`` loader each one uses.
FORMATS: dict[str, str] = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}

_GLOB_CHARS = frozenset("*?[")
_READ_CHUNK = 1 << 20


class _DefaultColumn(str):
    """A column name the user did not give: used when the files have the column, else ignored."""


#: The ``answer`` arg's default: the column ``answer`` where the files have one (tasks without one have no answer).
DEFAULT_ANSWER = _DefaultColumn("answer")


@dataclass(frozen=True)
class FileSet:
    """The files a ``path`` or ``eval_path`` arg names.

    Attributes:
        arg: which arg named them and how (``"path 'data/*.jsonl'"``), for messages.
        root: the directory their :attr:`names` are relative to (the path's leading part without glob
            characters; a file's own directory).
        files: absolute paths, sorted.
        loader: the ``datasets`` loader that reads them (``json``, ``csv``, ``parquet``).
    """

    arg: str
    root: Path
    files: tuple[Path, ...]
    loader: str

    @property
    def names(self) -> list[str]:
        """The files' paths relative to :attr:`root`, ``/``-separated."""
        return [f.relative_to(self.root).as_posix() for f in self.files]

    def digest_into(self, h: Any) -> None:
        """Feed each file's relative name, size and bytes into the hash object ``h`` (``hashlib``)."""
        for name, file in zip(self.names, self.files, strict=True):
            h.update(f"{name}\0{file.stat().st_size}\0".encode())
            with open(file, "rb") as f:
                while chunk := f.read(_READ_CHUNK):
                    h.update(chunk)

    def row(self, i: int) -> str:
        """Where row ``i`` (0-based, across the files in sorted order) is, for messages."""
        if len(self.files) == 1:
            return f"{self.arg} row {i + 1}"
        return f"{self.arg} row {i + 1} (counting from 1 across its {len(self.files)} files in sorted order)"


def find_files(path: Any, format: str | None, arg: str = "path") -> FileSet:
    """The local files ``path`` names: a file, a glob (``**`` matches subdirectories) or a directory.

    A directory means the files directly in it whose extension is :data:`EXTENSIONS` (``format``'s
    extensions when given), dotfiles excluded. A relative path resolves against the current directory
    and ``~`` expands. The format comes from the extensions unless ``format`` (:data:`FORMATS`) names it.

    Raises:
        ValueError: ``path`` is not a string, is a URL, matches no file, names a file of an unsupported
            extension, or files of several formats (the message names ``arg``).
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"dataset: {arg} must be a file, glob or directory path, got {path!r}")
    text = os.path.expanduser(os.fspath(path))
    label = f"{arg} {os.fspath(path)!r}"
    if "://" in text:
        raise ValueError(f"dataset: {label}: only local files are read (no URLs, no Hub datasets)")
    if format is not None and format not in FORMATS:
        raise ValueError(f"dataset: format must be one of {sorted(FORMATS)} or null, got {format!r}")
    wanted = {ext for ext, loader in EXTENSIONS.items() if format is None or loader == FORMATS[format]}
    given = Path(text).absolute()
    if given.is_file():  # before globbing: a file's name may hold glob characters
        root, files = given.parent, [given]
    elif given.is_dir():
        root = given
        files = sorted(
            p for p in given.iterdir() if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in wanted
        )
        if not files:
            raise ValueError(f"dataset: {label}: a directory without {'/'.join(sorted(wanted))} files")
    else:
        parts = given.parts
        fixed = next((k for k, part in enumerate(parts) if _GLOB_CHARS & set(part)), len(parts) - 1)
        root = Path(*parts[:fixed])
        files = sorted(Path(p) for p in glob.glob(str(given), recursive=True) if os.path.isfile(p))
        if not files:
            raise ValueError(f"dataset: {label} matches no file")
    if format is not None:
        return FileSet(label, root, tuple(files), FORMATS[format])
    unknown = sorted({f.suffix or f.name for f in files if f.suffix.lower() not in EXTENSIONS})
    if unknown:
        raise ValueError(
            f"dataset: {label}: unsupported extension {unknown[0]!r} (supported: {', '.join(sorted(EXTENSIONS))}; "
            "or set format)"
        )
    loaders = sorted({EXTENSIONS[f.suffix.lower()] for f in files})
    if len(loaders) > 1:
        raise ValueError(f"dataset: {label} mixes formats {loaders}: point it at one kind of file, or set format")
    return FileSet(label, root, tuple(files), loaders[0])


def load(files: FileSet, text_columns: tuple[str, ...]) -> Any:
    """The files' rows, in file order, as a ``datasets.Dataset`` held in memory.

    Read by ``datasets``' local loader for :attr:`FileSet.loader`, into a temporary cache directory (nothing
    is written under ``~/.cache``, no stale cache is reused, the Hub is never asked). CSV cells are read by
    pandas with only an empty cell missing (``NA`` stays a string), and the ``text_columns`` (prompt,
    answer) as written: ``007`` stays ``"007"``.

    Raises:
        ValueError: the files do not parse, or hold no rows (the message names the arg).
    """
    import datasets  # seconds to import: only an env that reads files pays it

    datasets.disable_progress_bars()  # a bar per load on stderr says nothing in a role process's log

    if all(f.stat().st_size == 0 for f in files.files):
        raise ValueError(f"dataset: {files.arg} has no rows (its files are empty)")
    kwargs: dict[str, Any] = {}
    if files.loader == "csv":
        kwargs = {"converters": dict.fromkeys(text_columns, str), "keep_default_na": False, "na_values": [""]}
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its loaders log an error they raise: said once, below
    with tempfile.TemporaryDirectory(prefix="rlrun-dataset-") as cache_dir:
        try:
            dataset = datasets.load_dataset(
                files.loader,
                data_files=[str(f) for f in files.files],
                split="train",
                cache_dir=cache_dir,
                keep_in_memory=True,
                **kwargs,
            )
        except Exception as exc:  # datasets' own types, pyarrow's, pandas', a StopIteration for an empty file…
            if isinstance(exc, StopIteration) or "corresponds to no data" in str(exc):
                raise ValueError(f"dataset: {files.arg} has no rows") from None
            for name, file in zip(files.names, files.files, strict=True) if files.loader == "json" else ():
                where = bad_json_line(file)  # pyarrow counts rows from 0, or bytes in large files: say the line
                if where is not None:
                    of = "" if len(files.files) == 1 else f"{name} "
                    raise ValueError(f"dataset: {files.arg}: {of}{where}") from None
            cause = exc
            while cause.__cause__ is not None:
                cause = cause.__cause__
            raise ValueError(
                f"dataset: {files.arg}: cannot read as {files.loader}: {type(cause).__name__}: {cause}"
            ) from exc
        finally:
            datasets.logging.set_verbosity(verbosity)
    if len(dataset) == 0:
        raise ValueError(f"dataset: {files.arg} has no rows")
    return dataset


def bad_json_line(path: Path) -> str | None:
    """``"line N, column C: not valid JSON (reason)"`` for the first line of JSON Lines file ``path`` that does not
    parse (a file holding one document over several lines: where the document breaks); None when it parses."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    first = next((line for line in lines if line.strip()), "")
    try:
        json.loads(first)
        one_document = False
    except ValueError:
        one_document = True  # a document over several lines ("[", "{"): its parser says where it breaks
    if one_document:
        try:
            json.loads(text)
            return None
        except json.JSONDecodeError as exc:
            return f"line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg})"
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except json.JSONDecodeError as exc:
            return f"line {n}, column {exc.colno}: not valid JSON ({exc.msg})"
    return None


def json_value(value: Any, where: str) -> Any:
    """``value`` as a JSON-compatible object: ``datetime``/``date``/``time`` become ISO 8601 strings, a NaN
    (a missing CSV or Parquet number) becomes None, tuples become lists.

    Raises:
        ValueError: a value JSON cannot hold (bytes, Decimal, an image, infinity…), naming ``where`` (the
            column, and the path inside the value).
    """
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            raise ValueError(f"{where}: {value} is not JSON-compatible")
        return value
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{where}: a mapping with non-string keys is not JSON-compatible")
        return {k: json_value(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v, f"{where}[{k}]") for k, v in enumerate(value)]
    raise ValueError(
        f"{where}: a {type(value).__name__} value is not JSON-compatible (leave the column out of info_columns)"
    )


def prompt_key(prompt: Any) -> str:
    """The canonical JSON text of a prompt cell: equal prompts, equal keys (the split partition's unit)."""
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def held_out(key: str, fraction: float) -> bool:
    """Whether the row whose prompt has ``key`` (:func:`prompt_key`) is in the eval split: the first 16 hex
    digits of its SHA-256, read as a fraction of ``16**16``, fall below ``fraction``."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) < fraction * 16**16


@dataclass(frozen=True)
class Rows:
    """A file set's rows, made into tasks' parts.

    Attributes:
        keys: ``keys[i]``, the :func:`prompt_key` of row ``i``'s prompt cell (before ``system_prompt``).
        rows: ``rows[i]``, row ``i``'s ``[prompt, answer, info]`` as JSON text (decoded afresh per task, so
            a caller may mutate its task).
        columns: the files' columns, in their order.
        answer: the answer column used (None: none).
        info_columns: the columns that go into ``info``.
    """

    keys: list[str]
    rows: list[str]
    columns: list[str] = field(default_factory=list)
    answer: str | None = None
    info_columns: list[str] = field(default_factory=list)

    def where(self, keep: list[bool]) -> Rows:
        """The rows ``i`` with ``keep[i]``, in order."""
        return Rows(
            [k for k, w in zip(self.keys, keep, strict=True) if w],
            [r for r, w in zip(self.rows, keep, strict=True) if w],
            self.columns,
            self.answer,
            self.info_columns,
        )


@dataclass(frozen=True)
class RowFormat:
    """How a row becomes a task: which columns hold the prompt, answer and info (the env's args)."""

    prompt: str
    answer: str | None
    system_prompt: str | None
    info_columns: list[str] | None

    def read(self, files: FileSet, max_rows: int | None) -> Rows:
        """The first ``max_rows`` (None: all) rows of ``files``.

        Raises:
            ValueError: see :func:`load`; a missing column (listing those present); a prompt or answer
                cell of the wrong shape, an info value JSON cannot hold (naming the row).
        """
        dataset = load(files, tuple(c for c in (self.prompt, self.answer) if c))
        answer, info_columns = self.columns(files, list(dataset.column_names))
        if max_rows is not None and len(dataset) > max_rows:
            dataset = dataset.select(range(max_rows))
        columns = dataset.select_columns([self.prompt, *([answer] if answer else []), *info_columns]).to_dict()
        prompts = columns[self.prompt]
        answers = columns[answer] if answer else [None] * len(prompts)
        keys, rows = [], []
        for i, (cell, answer_cell) in enumerate(zip(prompts, answers, strict=True)):
            try:
                prompt = self.check_prompt(cell)
                info = {c: json_value(columns[c][i], c) for c in info_columns}
                task = [self.with_system(prompt), task_answer(answer_cell), info]
            except ValueError as exc:
                raise ValueError(f"dataset: {files.row(i)}: {exc}") from None
            keys.append(prompt_key(prompt))
            rows.append(json.dumps(task, ensure_ascii=False))
        return Rows(keys, rows, list(dataset.column_names), answer, info_columns)

    def columns(self, files: FileSet, present: list[str]) -> tuple[str | None, list[str]]:
        """The answer column used (None: none) and the info columns, given the files' columns ``present``.

        Raises:
            ValueError: the prompt column, an explicitly named answer column or an info column is not
                ``present`` (the message lists the columns).
        """
        if self.prompt not in present:
            raise ValueError(f"dataset: prompt column {self.prompt!r} is not in {files.arg}; its columns: {present}")
        answer = self.answer
        if answer is not None and answer not in present:
            if not isinstance(answer, _DefaultColumn):
                raise ValueError(f"dataset: answer column {answer!r} is not in {files.arg}; its columns: {present}")
            answer = None
        if self.info_columns is None:
            return answer, [c for c in present if c not in (self.prompt, answer)]
        for c in self.info_columns:
            if c not in present or c in (self.prompt, answer):
                raise ValueError(
                    f"dataset: info_columns: {c!r} is not a column of {files.arg} besides prompt and answer; "
                    f"its columns: {present}"
                )
        return answer, list(self.info_columns)

    def check_prompt(self, cell: Any) -> str | Messages:
        """A prompt cell as text, or as chat messages (checked; keys Parquet filled with None dropped).

        Raises:
            ValueError: an empty or missing prompt, a cell neither text nor messages, a malformed message.
        """
        if isinstance(cell, str):
            if not cell:
                raise ValueError("prompt: empty")
            return cell
        if cell is None:
            raise ValueError("prompt: missing")
        if not isinstance(cell, list):
            raise ValueError(f"prompt: must be a string or a list of chat messages, got {type(cell).__name__}")
        # Parquet gives every message of a column the union of the keys: drop the ones a message lacked.
        messages = [
            {k: v for k, v in m.items() if v is not None or k in ("role", "content")} if isinstance(m, dict) else m
            for m in json_value(cell, "prompt")
        ]
        return check_messages(messages, "prompt")

    def with_system(self, prompt: str | Messages) -> str | Messages:
        """``prompt`` with ``system_prompt`` applied: text becomes ``[system, user]``; messages get the system
        message first unless they start with one."""
        if self.system_prompt is None:
            return prompt
        system = {"role": "system", "content": self.system_prompt}
        if isinstance(prompt, str):
            return [system, {"role": "user", "content": prompt}]
        return prompt if prompt[0]["role"] == "system" else [system, *prompt]


def task_answer(cell: Any) -> str | None:
    """An answer cell as text: a string as is, an integer in decimal, a missing cell None.

    Raises:
        ValueError: any other value (a float, a date…).
    """
    if cell is None or isinstance(cell, str):
        return cell
    if isinstance(cell, int) and not isinstance(cell, bool):
        return str(cell)
    raise ValueError(
        f"answer: must be a string, got {type(cell).__name__} {cell!r:.40} (write answers "
        "as JSON strings; the JSON reader takes strings that look like ISO 8601 dates for dates: use CSV or Parquet)"
    )
