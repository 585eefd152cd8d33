"""Comma-separated command-line lists, checked with messages that name the option and the bad item."""

from __future__ import annotations


def split_list(text: str, option: str) -> list[str]:
    items = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not items:
        raise ValueError(f"{option} is empty: give a comma-separated list")
    return items


def parse_numbers(text: str, option: str, kind: type) -> list:
    values = []
    for item in split_list(text, option):
        try:
            values.append(kind(item))
        except ValueError:
            raise ValueError(f"{option}: {item!r} is not {'an integer' if kind is int else 'a number'}") from None
    return values
