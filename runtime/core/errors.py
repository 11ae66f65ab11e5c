"""The error of a request that cannot run as given, raised wherever it is found (intake, sampling parameters).

It names the offending field in the runtime's own spelling (``max_new_tokens``, ``input_ids``); each API maps
those names to its own (``max_tokens`` on /v1/completions, ``prompt`` for ``Engine.generate``...) with a
declared table and ``named`` (``fields_named`` around a call), so the detail text never has to be edited.
``str()`` is ``"<field>: <detail>"``, the form every 400 of this server takes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping

_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*): (.*)$", re.DOTALL)


class IntakeError(ValueError):
    def __init__(self, field: str | None, detail: str):
        super().__init__(f"{field}: {detail}" if field else detail)
        self.field = field
        self.detail = detail

    @classmethod
    def of(cls, exc: ValueError) -> IntakeError:
        """The typed form of a ValueError raised by a lower layer in the ``"<field>: <detail>"`` convention
        (sampling parameters, stop patterns, grammars): read once here, so no API has to parse messages."""
        if isinstance(exc, IntakeError):
            return exc
        m = _FIELD.match(str(exc))
        return cls(m.group(1), m.group(2)) if m else cls(None, str(exc))

    def named(self, names: Mapping[str, str]) -> IntakeError:
        """This refusal with its field named as the calling API names it (``names``: the runtime's name -> the
        API's; a field not in it keeps the runtime's name)."""
        name = names.get(self.field or "", self.field)
        return self if name == self.field else IntakeError(name, self.detail)


@contextlib.contextmanager
def fields_named(names: Mapping[str, str]) -> Iterator[None]:
    """Inside: a refusal of the intake names its field as the calling API does (``names``)."""
    try:
        yield
    except IntakeError as exc:
        raise exc.named(names) from None
