"""Key patterns with captured parts: ``"model/layers.{i}.attn.q_proj.weight"``.

A key (a tuple of str/int components) is rendered as its components joined by
``/``. In a pattern ``{name}`` captures one or more characters inside one
component, ``{name*}`` captures one or more characters that may span components;
a name used twice must capture the same text. Formatting a pattern with captures
gives a key: the text is split at ``/`` and a component made only of digits
becomes an ``int`` (a list or tuple index). A tuple given instead of a string
is an exact key (no captures, no conversion).
"""

from __future__ import annotations

import re
from typing import Union

from xckpt.format.tree import Key
from xckpt.mapping.errors import MappingError

_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(\*?)\}")

PatternLike = Union[str, tuple, "Pattern"]


def parse_path(text: str | tuple | list) -> Key:
    """A key from ``"a/0/b"`` (digit-only components become ints) or from a tuple as is."""
    if isinstance(text, (tuple, list)):
        return tuple(text)
    if text == "":
        return ()
    return tuple(int(c) if c.isdigit() else c for c in text.split("/"))


def render(key: Key) -> str:
    """The text a pattern is matched against: components joined by ``/``."""
    return "/".join(str(c) for c in key)


class Pattern:
    """A key pattern (see the module docstring)."""

    def __init__(self, spec: PatternLike) -> None:
        if isinstance(spec, Pattern):
            self.__dict__.update(spec.__dict__)
            return
        self.key: Key | None = None  # set for an exact tuple pattern
        self._regex: re.Pattern[str] | None = None
        if isinstance(spec, (tuple, list)):
            self.key = tuple(spec)
            self.text = render(self.key)
            self.fields: tuple[str, ...] = ()
            return
        if not isinstance(spec, str):
            raise MappingError(f"a key pattern must be a str or a tuple, not {type(spec).__name__}",
                            code="mapping.pattern")
        if "{" in _FIELD.sub("", spec) or "}" in _FIELD.sub("", spec):
            raise MappingError(f"pattern {spec!r} has a malformed '{{...}}' field", code="mapping.pattern")
        self.text = spec
        parts, fields, pos = [], [], 0
        for m in _FIELD.finditer(spec):
            parts.append(re.escape(spec[pos:m.start()]))
            name, spans = m.group(1), m.group(2) == "*"
            if name in fields:
                parts.append(f"(?P={name})")
            else:
                fields.append(name)
                parts.append(f"(?P<{name}>.+)" if spans else f"(?P<{name}>[^/]+)")
            pos = m.end()
        parts.append(re.escape(spec[pos:]))
        self.fields = tuple(fields)
        if fields:
            self._regex = re.compile("".join(parts))

    @property
    def is_literal(self) -> bool:
        """Whether the pattern names one key (no captures): it is then looked up, not scanned for."""
        return self._regex is None

    def match(self, key: Key) -> dict[str, str] | None:
        """The captures when ``key`` matches, else None."""
        if self.key is not None:
            return {} if key == self.key else None
        if self._regex is None:
            return {} if render(key) == self.text else None
        m = self._regex.fullmatch(render(key))
        return None if m is None else m.groupdict()

    def format(self, captures: dict[str, str]) -> Key:
        """The key this pattern names with ``captures`` filled in."""
        if self.key is not None:
            return self.key
        missing = [f for f in self.fields if f not in captures]
        if missing:
            raise MappingError(f"pattern {self.text!r} uses {missing}, which the source pattern does not capture",
                            code="mapping.pattern")
        return parse_path(_FIELD.sub(lambda m: captures[m.group(1)], self.text))

    def with_affixes(self, old_prefix: Key, new_prefix: Key, suffix: Key) -> "Pattern | None":
        """This pattern re-rooted: ``old_prefix`` replaced by ``new_prefix``, ``suffix`` appended.

        None when the pattern does not start with ``old_prefix``.
        """
        if self.key is not None:
            if self.key[:len(old_prefix)] != tuple(old_prefix):
                return None
            return Pattern(tuple(new_prefix) + self.key[len(old_prefix):] + tuple(suffix))
        old, body = render(old_prefix), self.text
        if old:
            if not body.startswith(old + "/"):
                return None
            body = body[len(old) + 1:]
        return Pattern("/".join(p for p in (render(new_prefix), body, render(suffix)) if p))

    def __repr__(self) -> str:
        return f"Pattern({self.key if self.key is not None else self.text!r})"
