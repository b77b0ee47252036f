"""`dataset`: tasks read from local JSONL, JSON, CSV or Parquet files (issue 23, "bring your own task").

Each row is one task: its ``prompt`` column is the prompt (a plain text, TRL's "standard" format, or a
list of chat messages, TRL's "conversational" format), its ``answer`` column (optional) the reference
the reward compares against, and its other columns the task's ``info``. The files are read once, by
the constructor, with the ``datasets`` library's local loaders (never the Hugging Face Hub).

Invariants the orchestrator relies on:

* **Pure stream.** Task ``index`` of seed ``s`` is row ``perm[s, e][i]`` of the split, where
  ``e, i = divmod(index, rows)`` and ``perm[s, e]`` is the permutation drawn by
  ``random.Random(f"dataset:{s}:{e}")`` (``dataset-eval:`` for the eval split): every epoch visits each
  row exactly once, a cursor crosses epochs freely, and seeds ``s`` and ``s + 1`` draw unrelated orders.
* **Disjoint splits.** No eval row's prompt is a train row's prompt: ``eval_fraction`` holds rows out by
  a hash of their prompt (not their position, so reordering or resharding the files moves no row
  across), and with ``eval_path`` the train rows whose prompt is in the eval files are dropped.
* **Fingerprint.** :meth:`DatasetEnv.fingerprint` digests the files' bytes (under their names relative
  to the path given, so the same data mounted elsewhere matches) and every arg that changes the task
  stream; a resume whose data changed is refused.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
from typing import Any

from rlrun.envs.base import SPLITS, Split, Task
from rlrun.envs.dataset_files import DEFAULT_ANSWER, RowFormat, find_files, held_out

log = logging.getLogger(__name__)


class DatasetEnv:
    """Tasks from the rows of local data files; module docstring for the stream's guarantees.

    Args:
        path: a file, a glob (``data/*.jsonl``; ``**`` matches subdirectories) or a directory (its files of a
            supported extension, sorted by name; not its subdirectories); relative to the current directory.
        prompt: the prompt column: each cell a string (shown as is, no chat template) or a list of chat
            messages ``{"role", "content"}`` (rendered by the tokenizer's chat template).
        answer: the answer column (string or integer cells; an empty cell: a task without answer). By
            default the column ``answer`` where the files have one, else none; a column named explicitly
            must exist. None: no answer column (a column ``answer`` then goes into info).
        system_prompt: a system message for every task: a string prompt becomes ``[system, user]``; a
            message list gets it first unless it starts with a system message of its own.
        eval_fraction: the fraction of rows held out as the eval split, in ``[0, 1)``, chosen by a hash of
            their prompt: rows with equal prompts fall on the same side.
        eval_path: the eval split's own files (as ``path``; same columns); train rows whose prompt is in them
            are dropped. At most one of ``eval_path`` and ``eval_fraction``; with neither, there is no eval split.
        shuffle: each epoch in its own seeded order (False: file order every epoch).
        format: ``jsonl``, ``json``, ``csv`` or ``parquet``: every file is read so (None: from the extensions
            ``.jsonl``, ``.json``, ``.csv``, ``.parquet``; one kind per path).
        max_rows: use only the first ``max_rows`` rows of ``path`` (and of ``eval_path``), before holding out.
        info_columns: the columns that go into ``Task.info`` (None: every column but prompt and answer).
            Values must be JSON-compatible: timestamps and dates become ISO 8601 strings, a NaN (a missing
            number) None, and what JSON cannot hold (bytes, decimals, images) is refused.
        demonstration: the column holding the completion that solves a row — what the builtin ``tiny`` model's
            warm start teaches (:meth:`demonstration`) — when it is not the answer column: e.g. TRL's ``solution``,
            which the rewards must keep receiving by its name (a column of ``info``). None: the answer.

    Raises:
        ValueError: an arg the files cannot satisfy, the message naming it: no file matches, an unsupported
            extension, no rows, a missing column (listing those present), a prompt or answer cell of the
            wrong shape (naming its row, counting from 1), an empty train or eval split.
    """

    name = "dataset"
    #: its files are the run's data, mounted where the orchestrator runs: the operator checks only its args
    reads_run_data = True

    def __init__(
        self,
        path: str,
        prompt: str = "prompt",
        answer: str | None = DEFAULT_ANSWER,
        system_prompt: str | None = None,
        eval_fraction: float = 0.0,
        eval_path: str | None = None,
        shuffle: bool = True,
        format: str | None = None,
        max_rows: int | None = None,
        info_columns: list[str] | None = None,
        demonstration: str | None = None,
    ) -> None:
        _check_args(prompt, answer, system_prompt, eval_fraction, eval_path, shuffle, max_rows, info_columns)
        if demonstration is not None and (not isinstance(demonstration, str) or not demonstration):
            raise ValueError(f"dataset: demonstration must be a column name or null, got {demonstration!r}")
        self.files = find_files(path, format, "path")
        self.eval_files = find_files(eval_path, format, "eval_path") if eval_path is not None else None
        self.shuffle = shuffle
        self.row_format = RowFormat(prompt, answer, system_prompt, info_columns)
        self._fingerprint = self._digest(
            {
                "row_format": [prompt, answer, system_prompt, info_columns],
                "eval_fraction": float(eval_fraction),
                "shuffle": shuffle,
                "format": format,
                "max_rows": max_rows,
            }
        )

        rows = self.row_format.read(self.files, max_rows)
        self.columns, self.answer_column = rows.columns, rows.answer
        self.demonstration_column = demonstration
        if demonstration is not None and demonstration != rows.answer and demonstration not in rows.info_columns:
            if demonstration in rows.columns:
                raise ValueError(
                    f"dataset: demonstration column {demonstration!r} is left out of info_columns: add it (the warm "
                    "start reads it from the task's info)"
                )
            raise ValueError(
                f"dataset: demonstration column {demonstration!r} is not in {self.files.arg}; "
                f"its columns: {rows.columns}"
            )
        eval_rows = None
        if self.eval_files is not None:
            eval_rows = self.row_format.read(self.eval_files, max_rows)
            in_eval = set(eval_rows.keys)
            keep = [k not in in_eval for k in rows.keys]
            if not all(keep):
                log.warning(
                    "dataset: %d rows of %s are in eval_path: not trained on", keep.count(False), self.files.arg
                )
            rows = rows.where(keep)
        elif eval_fraction > 0:
            out = [held_out(k, eval_fraction) for k in rows.keys]
            rows, eval_rows = rows.where([not o for o in out]), rows.where(out)
            if not eval_rows.rows:
                raise ValueError(
                    f"dataset: eval_fraction {eval_fraction} holds out none of the {len(out)} rows: raise it"
                )
        if not rows.rows:
            raise ValueError(f"dataset: {self.files.arg}: no train row is left once the eval split is held out")
        self._rows: dict[Split, list[str]] = {"train": rows.rows}
        if eval_rows is not None:
            self._rows["eval"] = eval_rows.rows
        self._order = functools.lru_cache(maxsize=8)(self._permutation)
        log.info(
            "dataset: %d train rows, %s eval rows (%s)",
            len(rows.rows),
            len(eval_rows.rows) if eval_rows is not None else "no",
            self.files.arg,
        )

    def _digest(self, args: dict[str, Any]) -> str:
        h = hashlib.sha256(json.dumps(args, sort_keys=True).encode())
        for label, files in (("path", self.files), ("eval_path", self.eval_files)):
            h.update(f"\0{label}\0".encode())
            if files is not None:
                files.digest_into(h)
        return h.hexdigest()

    def _split(self, split: Split) -> list[str]:
        if split not in SPLITS:
            raise ValueError(f"dataset: split must be one of {list(SPLITS)}, got {split!r}")
        rows = self._rows.get(split)
        if rows is None:
            raise ValueError("dataset: no eval split: set eval_path or eval_fraction")
        return rows

    def _permutation(self, split: Split, seed: int, epoch: int) -> list[int]:
        order = list(range(len(self._rows[split])))
        namespace = "dataset" if split == "train" else "dataset-eval"
        random.Random(f"{namespace}:{seed}:{epoch}").shuffle(order)
        return order

    def num_rows(self, split: Split = "train") -> int:
        """How many rows (distinct tasks) ``split`` has: the length of one epoch.

        Raises:
            ValueError: an unknown split, or ``eval`` without an eval split.
        """
        return len(self._split(split))

    def epoch(self, index: int, split: Split = "train") -> int:
        """The epoch (0-based pass over the split's rows) task ``index`` belongs to.

        Raises:
            ValueError: a negative index; as :meth:`num_rows`.
        """
        if index < 0:
            raise ValueError(f"dataset: task index must be ≥ 0, got {index}")
        return index // self.num_rows(split)

    def task(self, seed: int, index: int, split: Split = "train") -> Task:
        """Task ``index`` (≥ 0) of ``split``'s stream for ``seed``: a pure function of the three (module docstring).

        Raises:
            ValueError: a negative index, an unknown split, or ``eval`` without an eval split.
        """
        rows = self._split(split)
        prompt, answer, info = json.loads(rows[self._row(rows, split, seed, index)])
        return Task(env=self.name, index=index, prompt=prompt, answer=answer, info=info)

    def _row(self, rows: list[str], split: Split, seed: int, index: int) -> int:
        if index < 0:
            raise ValueError(f"dataset: task index must be ≥ 0, got {index}")
        epoch, i = divmod(index, len(rows))
        return self._order(split, seed, epoch)[i] if self.shuffle else i

    def num_task_keys(self) -> int:
        """How many distinct training tasks there are: the train split's rows (what a curriculum keeps state of,
        :mod:`rlrun.orchestrator.difficulty`)."""
        return self.num_rows("train")

    def task_key(self, seed: int, index: int) -> int:
        """The train row (``0 … num_task_keys() − 1``) that task ``index`` of ``seed``'s stream asks: the same row in
        every epoch, and in every attempt while the files are the same (:meth:`fingerprint`).

        Raises:
            ValueError: a negative index.
        """
        return self._row(self._split("train"), "train", seed, index)

    def reward(self, task: Task, completion: str) -> float:
        """1.0 when ``completion`` and ``task.answer``, stripped of surrounding whitespace, are equal, else 0.0.

        Raises:
            ValueError: the task has no answer (then the manifest must name ``rewards``).
        """
        if task.answer is None:
            raise ValueError(
                f"dataset: task {task.index} has no answer (no answer column, or an empty cell): "
                "name rewards in the manifest to score it"
            )
        return float(completion.strip() == task.answer.strip())

    def fingerprint(self) -> str:
        """SHA-256 (hex) of the files' relative names and bytes, and of the args that shape the task stream."""
        return self._fingerprint

    def demonstration(self, task: Task) -> str | None:
        """The completion that solves ``task`` (the builtin ``tiny`` model's warm start teaches it): its
        ``demonstration`` column's cell as text, else its answer; None for an empty or missing cell."""
        if self.demonstration_column is None or self.demonstration_column == self.answer_column:
            return task.answer
        cell = task.info.get(self.demonstration_column)
        if cell is None or isinstance(cell, (dict, list, bool)) or cell == "":
            return None
        return str(cell)

    def field_hint(self, name: str) -> str:
        """Why no reward gets the task field ``name``, and what to set (a message's end)."""
        columns = f"{self.files.arg} has the columns {self.columns}"
        if name == self.answer_column:
            return (
                f"column {name!r} is the answer column: rewards get it as answer. To pass it by its name, leave it "
                f"out of args.answer (and set args.demonstration: {name} for the builtin tiny model's warm start)"
            )
        if name == self.row_format.prompt:
            return f"column {name!r} is the prompt column: rewards get it as prompts"
        if name in self.columns:
            return f"column {name!r} is left out of args.info_columns; {columns}"
        return (
            f"{columns}: rewards get the answer column as answer and every other column (args.info_columns) by its name"
        )

    def demonstration_hint(self) -> str:
        """What to set when no row gives the warm start a completion (a message's end)."""
        if self.demonstration_column is not None:
            return f"its demonstration column {self.demonstration_column!r} has no usable cell"
        others = [c for c in self.columns if c != self.row_format.prompt]
        return (
            f"{self.files.arg} has no answer column (args.answer: {self.row_format.answer!r}); set args.demonstration "
            f"to the column holding the completion to teach — its columns: {self.columns}"
            + (f" (e.g. demonstration: {others[0]})" if others else "")
        )


def _check_args(
    prompt: Any,
    answer: Any,
    system_prompt: Any,
    eval_fraction: Any,
    eval_path: Any,
    shuffle: Any,
    max_rows: Any,
    info_columns: Any,
) -> None:
    """Refuse arg values of the wrong type or range (they come from a YAML manifest), naming the arg."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"dataset: prompt must be a column name, got {prompt!r}")
    if answer is not None and (not isinstance(answer, str) or not answer):
        raise ValueError(f"dataset: answer must be a column name or null, got {answer!r}")
    if answer == prompt:
        raise ValueError(f"dataset: answer and prompt name the same column {prompt!r}")
    if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt):
        raise ValueError(f"dataset: system_prompt must be a non-empty string or null, got {system_prompt!r}")
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or not 0 <= eval_fraction < 1:
        raise ValueError(f"dataset: eval_fraction must be a number in [0, 1), got {eval_fraction!r}")
    if eval_path is not None and eval_fraction:
        raise ValueError("dataset: set eval_path or eval_fraction, not both")
    if not isinstance(shuffle, bool):
        raise ValueError(f"dataset: shuffle must be true or false, got {shuffle!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise ValueError(f"dataset: max_rows must be an integer ≥ 1 or null, got {max_rows!r}")
    if info_columns is not None and (
        not isinstance(info_columns, list) or not all(isinstance(c, str) for c in info_columns)
    ):
        raise ValueError(f"dataset: info_columns must be a list of column names or null, got {info_columns!r}")
