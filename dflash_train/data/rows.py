"""Rows of conversation files: ShareGPT or OpenAI shapes parsed into `Conversation`s, with bad
rows reported by file, 1-based line and field (`DataError`) or counted by reason (`BadRows`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from dflash_train.data.records import Conversation

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "model": "assistant", "system": "system"}


class DataError(ValueError):
    """A malformed row: `file:line: field 'f': problem`. `reason` is a short key for counting."""

    def __init__(self, source: str, line: int, field_name: str | None, problem: str, reason: str):
        where = f"{source}:{line}"
        what = f"field '{field_name}': {problem}" if field_name else problem
        super().__init__(f"{where}: {what}")
        self.reason = reason

    @classmethod
    def hinted(cls, err: "DataError") -> "DataError":
        """`err` as raised to the user: with the setting that would skip such rows."""
        hinted = cls.__new__(cls)
        ValueError.__init__(hinted, f"{err}; to skip bad rows (counted and reported) instead, set "
                                    "data.skip_bad_rows=true")
        hinted.reason = err.reason
        return hinted


@dataclass
class BadRows:
    """Skipped rows counted by reason, with the first few messages as examples."""

    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    max_examples: int = 5

    def add(self, reason: str, message: str) -> None:
        self.counts[reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(message)

    def merge(self, other: "BadRows") -> None:
        for reason, n in other.counts.items():
            self.counts[reason] += n
        self.examples.extend(other.examples[: max(0, self.max_examples - len(self.examples))])

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        if not self.total:
            return "skipped rows: none"
        parts = ", ".join(f"{reason} {n}" for reason, n in sorted(self.counts.items()))
        first = f"; first: {self.examples[0]}" if self.examples else ""
        return f"skipped rows: {self.total} ({parts}){first}"


# ---------------------------------------------------------------------------------------------
# Row parsing and validation


def json_type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _message_list(row: dict, source: str, line: int) -> tuple[str, list, str, str]:
    """Return (list field, raw messages, role key, content key) for a ShareGPT or OpenAI row."""
    if "conversations" in row:
        key, role_key, content_key = "conversations", "from", "value"
    elif "messages" in row:
        key, role_key, content_key = "messages", "role", "content"
    else:
        raise DataError(source, line, "conversations", "missing (expected 'conversations' or 'messages')",
                        "missing_field")
    messages = row[key]
    if not isinstance(messages, list):
        raise DataError(source, line, key, f"expected a list, got {json_type_name(messages)}", "wrong_type")
    if not messages:
        raise DataError(source, line, key, "empty conversation", "empty_conversation")
    return key, messages, role_key, content_key


def _parse_message(msg, where: str, role_key: str, content_key: str, source: str, line: int) -> dict:
    if not isinstance(msg, dict):
        raise DataError(source, line, where, f"expected an object, got {json_type_name(msg)}", "wrong_type")
    for k in (role_key, content_key):
        if k not in msg:
            raise DataError(source, line, f"{where}.{k}", "missing", "missing_field")
    role, content = msg[role_key], msg[content_key]
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise DataError(source, line, f"{where}.{role_key}",
                        f"unknown role {role!r} (expected one of {', '.join(ROLE_ALIASES)})", "unknown_role")
    if not isinstance(content, str):
        raise DataError(source, line, f"{where}.{content_key}",
                        f"expected a string, got {json_type_name(content)}", "non_string_content")
    return {"role": ROLE_ALIASES[role.lower()], "content": content}


def check_role_order(messages: list[dict], source: str, line: int, key: str, role_key: str) -> None:
    """Optional system first, then user/assistant alternating starting with user."""
    start = 1 if messages and messages[0]["role"] == "system" else 0
    if start == len(messages):
        raise DataError(source, line, key, "empty conversation (only a system message)", "empty_conversation")
    for i, msg in enumerate(messages[start:], start):
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if msg["role"] != expected:
            raise DataError(source, line, f"{key}[{i}].{role_key}",
                            f"wrong role order: expected {expected}, got {msg['role']}", "role_order")


def parse_row(row, source: str, line: int, default_id: str | None = None) -> Conversation:
    """One ShareGPT (`conversations` of `from`/`value`) or OpenAI (`messages` of `role`/`content`)
    row; the id is the row's `id` field, else `default_id`, else `source:line`."""
    if not isinstance(row, dict):
        raise DataError(source, line, None, f"expected a JSON object, got {json_type_name(row)}", "wrong_type")
    key, raw, role_key, content_key = _message_list(row, source, line)
    messages = [_parse_message(m, f"{key}[{i}]", role_key, content_key, source, line)
                for i, m in enumerate(raw)]
    check_role_order(messages, source, line, key, role_key)
    row_id = row.get("id")
    if row_id is not None and not isinstance(row_id, (str, int)):
        raise DataError(source, line, "id", f"expected a string or int, got {json_type_name(row_id)}", "wrong_type")
    conv_id = str(row_id) if row_id is not None else (default_id or content_id(line, messages))
    return Conversation(id=conv_id, messages=messages)


def content_id(line: int, messages: list[dict]) -> str:
    """The id of a row without one: its line and a digest of its messages, never the file's name,
    so a renamed or copied file keeps its ids (and its held-out split and resume fingerprint)."""
    digest = hashlib.blake2b(json.dumps(messages, sort_keys=True).encode(), digest_size=5).hexdigest()
    return f"L{line}-{digest}"


def parse_rows(rows: Iterable[tuple[int, object]], source: str, skip_bad_rows: bool,
             bad: BadRows) -> Iterator[Conversation]:
    """Parse (line, row-or-DataError) pairs; raise the first error unless skipping."""
    for line, row in rows:
        try:
            if isinstance(row, DataError):
                raise row
            yield parse_row(row, source, line)
        except DataError as err:
            if not skip_bad_rows:
                raise DataError.hinted(err) from None
            bad.add(err.reason, str(err))
