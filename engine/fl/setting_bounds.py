"""Hard sanity bounds of the settings a coordinator signs, declared beside each setting (no torch, no numpy).

A setting that a coordinator signs for a network run (a field of
:class:`engine.fl.method_spec.MethodSpec`, or an option of a dialogue method) is declared with a
:class:`Bound` next to its definition, as dataclass field metadata (:func:`bounded`). The bound is
what *no* site accepts beyond, whatever its ``site.toml`` says: the coordinator refuses to build
such a spec, and a site refuses a signed spec that breaks it before pulling any payload
(:meth:`engine.security.run_spec.SiteBounds.violations`).

Each declaration also names the keys by which a site tightens it in ``site.toml`` ``[bounds]``
(:meth:`Bound.site_keys`): ``max_<setting>`` / ``min_<setting>`` for a number,
``allowed_<setting>s`` (or the declared name) for a choice, and ``limited_by``: keys that bound
several settings at once (``max_epochs`` bounds every per-round epoch count). :class:`Total`
declares a limit on a sum or product of settings (the rounds a run trains in all).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from engine.errors import ConfigError

#: Key of a dataclass field's metadata that holds its :class:`Bound`.
BOUND = "bound"
#: Kinds of setting a :class:`Bound` describes.
KINDS = ("int", "float", "choice", "bool", "names")


@dataclass(frozen=True)
class Bound:
    """What values one setting may take, whatever a site allows.

    Attributes
    ----------
    kind
        ``"int"``, ``"float"``, ``"choice"`` (one of :attr:`choices`), ``"bool"`` or ``"names"``
        (a list of distinct site names, at most :attr:`high` of them).
    low, high
        Inclusive limits of a number (``low_open`` / ``high_open``: the limit itself is excluded).
    multiple_of
        An integer must be a multiple of this (the selector's input side: 32).
    choices
        Allowed values of a choice (or a function that lists them: the methods registered now);
        for a number, extra non-numeric values it may also take (gamma's ``"auto"``).
    nullable
        ``None`` is allowed; ``null_means`` says what it stands for (the default derived from other
        settings, or "off").
    limited_by
        ``site.toml`` ``[bounds]`` keys of *other* settings that bound this one too
        (``selector_epochs`` is bounded by ``max_epochs`` as well as by ``max_selector_epochs``).
    site_key
        The key that tightens a choice or a list (default ``allowed_<setting>s``; ``max_sites``).
    check
        A check of each value a number or choice cannot express (a site name's characters):
        raises :class:`engine.errors.ConfigError`.
    methods
        The methods that read the setting; a site's ``[bounds]`` on it bind only their runs (empty:
        every method). Other runs carry its default, which a site need not allow.
    help
        One line for the documentation's table.
    """

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    multiple_of: int | None = None
    choices: tuple[Any, ...] | Callable[[], Sequence[Any]] = ()
    nullable: bool = False
    null_means: str = "the default"
    limited_by: tuple[str, ...] = ()
    site_key: str | None = None
    check: Callable[[Any], Any] | None = None
    methods: tuple[str, ...] = ()
    help: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown bound kind {self.kind!r}; one of {KINDS}")
        if self.kind in ("int", "float", "names") and (self.low is None or self.high is None):
            raise ValueError(f"a {self.kind} bound needs low and high")

    # --- what is allowed ------------------------------------------------------------------
    def allowed(self) -> tuple[Any, ...]:
        """The choices (for a number: its extra non-numeric values)."""
        if self.kind == "bool":
            return (True, False)
        return tuple(self.choices() if callable(self.choices) else self.choices)

    def numeric(self) -> bool:
        return self.kind in ("int", "float")

    def describe(self) -> str:
        """The hard bound in words: ``integer in [1, 1000]``, ``one of 'gap', 'classic'``."""
        if self.kind in ("choice", "bool"):
            text = "one of " + ", ".join(_show(c) for c in self.allowed())
        elif self.kind == "names":
            text = f"{_show(self.low)} to {_show(self.high)} distinct site names"
        else:
            text = (f"{'integer' if self.kind == 'int' else 'number'} in {'(' if self.low_open else '['}"
                    f"{_show(self.low)}, {_show(self.high)}{')' if self.high_open else ']'}")
            if self.multiple_of:
                text += f", a multiple of {self.multiple_of}"
            extra = self.allowed()
            if extra:
                text += " or " + " or ".join(_show(c) for c in extra)
        if self.nullable:
            text += f" or null ({self.null_means})"
        return text

    def problem(self, name: str, value: Any) -> str | None:
        """Why ``value`` breaks the hard bound of ``name`` (``None``: it does not)."""
        if value is None:
            return None if self.nullable else f"{name} is null; the coordinator must set it ({self.describe()})"
        if self.kind in ("choice", "bool"):
            if self.kind == "bool" and not isinstance(value, bool):
                return f"{name} must be true or false, got {value!r}"
            if not _member(value, self.allowed()):
                return f"{name} must be one of {', '.join(_show(c) for c in self.allowed())}, got {value!r}"
            return self._checked(name, value)
        if self.kind == "names":
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                return f"{name} must be a list of site names, got {value!r}"
            if not self.low <= len(value) <= self.high:  # type: ignore[operator]
                return (f"{name} lists {len(value)} sites; a run has {_show(self.low)} to {_show(self.high)} "
                        "(the coordinator must list fewer)")
            if len(set(value)) != len(value):
                return f"{name} must be unique, got {list(value)}"
            for item in value:
                bad = self._checked(name, item)
                if bad:
                    return bad
            return None
        if _member(value, self.allowed()):
            return None
        if not _is_number(value) or (self.kind == "int" and not isinstance(value, int)):
            kind = "an integer" if self.kind == "int" else "a finite number"
            return f"{name} must be {kind} ({self.describe()}), got {value!r}"
        assert self.low is not None and self.high is not None
        if value < self.low or (self.low_open and value == self.low):
            return (f"{name} = {_show(value)} is below {'or at ' if self.low_open else ''}{_show(self.low)}, the hard "
                    f"minimum of {name} ({self.describe()}); the coordinator must raise it")
        if value > self.high or (self.high_open and value == self.high):
            return (f"{name} = {_show(value)} is above {'or at ' if self.high_open else ''}{_show(self.high)}, the "
                    f"hard maximum of {name} ({self.describe()}): no site accepts more; the coordinator must lower it")
        if self.multiple_of and value % self.multiple_of:
            return f"{name} = {_show(value)} must be a multiple of {self.multiple_of}"
        return None

    def _checked(self, name: str, value: Any) -> str | None:
        if self.check is None:
            return None

        try:
            self.check(value)
        except ConfigError as exc:
            return f"{name}: {exc}"
        return None

    # --- what a site may tighten ----------------------------------------------------------
    def site_keys(self, name: str) -> tuple[str, ...]:
        """``[bounds]`` keys that tighten this setting alone (``max_<name>``, ``min_<name>``, ``allowed_<name>s``)."""
        if self.numeric():
            return (f"max_{name}", f"min_{name}")
        if self.kind == "names":
            return (self.site_key or f"max_{name}",)
        return (self.site_key or f"allowed_{name}s",)


@dataclass(frozen=True)
class Total:
    """A limit on settings taken together (the rounds a run trains, the client passes of a BlackFed turn).

    ``value(settings)`` computes the total from a run's settings (already within their own bounds;
    ``None``: it does not apply to this run); it may not exceed ``high``, nor a site's ``site_key``.
    """

    name: str
    formula: str
    value: Callable[[Mapping[str, Any]], float | None]
    high: float
    site_key: str

    def problems(self, settings: Mapping[str, Any], limit: Callable[[str], Any]) -> list[str]:
        total = self.value(settings)
        if total is None:
            return []
        site = limit(self.site_key)
        if total > self.high:
            return [f"{self.name} ({self.formula}) = {_show(total)} is above {_show(self.high)}, its hard maximum; "
                    "the coordinator must lower them"]
        if site is not None and total > site:
            return [f"{self.name} ({self.formula}) = {_show(total)} is above {self.site_key} = {_show(site)} in "
                    f"this site's [bounds]; the coordinator must lower them, or this site raise {self.site_key} in "
                    "site.toml"]
        return []


def bounded(default: Any = MISSING, bound: Bound | None = None, *,
            default_factory: Callable[[], Any] | Any = MISSING) -> Any:
    """A dataclass field with its :class:`Bound` in the field's metadata."""
    if bound is None:
        raise ValueError("bounded() needs a Bound")
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={BOUND: bound})
    return field(default=default, metadata={BOUND: bound})


# --- constructors -------------------------------------------------------------------------
def integer(low: int, high: int, **kw: Any) -> Bound:
    """An integer in ``[low, high]``."""
    return Bound("int", low, high, **kw)


def number(low: float, high: float, **kw: Any) -> Bound:
    """A finite number in ``[low, high]`` (``low_open=True``: above ``low``)."""
    return Bound("float", low, high, **kw)


def one_of(choices: Iterable[Any] | Callable[[], Sequence[Any]], **kw: Any) -> Bound:
    """One of ``choices``."""
    return Bound("choice", choices=choices if callable(choices) else tuple(choices), **kw)


def flag(**kw: Any) -> Bound:
    """``true`` or ``false``."""
    return Bound("bool", **kw)


def names(low: int, high: int, **kw: Any) -> Bound:
    """A list of ``low`` to ``high`` distinct names."""
    return Bound("names", low, high, **kw)


def bounds_of(cls: type) -> dict[str, Bound]:
    """The declared :class:`Bound` of every field of the dataclass ``cls`` that has one."""
    return {f.name: f.metadata[BOUND] for f in fields(cls) if BOUND in f.metadata}


def unbounded_fields(cls: type, exempt: Iterable[str] = ()) -> list[str]:
    """Fields of ``cls`` without a declared bound (a test keeps this empty for every signed class)."""
    skip = set(exempt)
    return [f.name for f in fields(cls) if BOUND not in f.metadata and f.name not in skip]


def limit_problem(name: str, value: Any, key: str, limit: Any) -> str | None:
    """Why ``value`` of setting ``name`` breaks the site's ``[bounds]`` key ``key = limit`` (``None``: it does not)."""
    if limit is None or value is None:
        return None
    if key.startswith("allowed_"):
        if not _member(value, tuple(limit)):
            return (f"{name} {value!r} is not in {key} {list(limit)} of this site's [bounds]; the coordinator must "
                    f"choose one of them, or this site add it to {key} in site.toml")
        return None
    if not _is_number(value):
        return None  # a non-numeric value a number may also take (gamma "auto"): nothing to compare
    if key.startswith("max_") and value > limit:
        return (f"{name} = {_show(value)} is above {key} = {_show(limit)} in this site's [bounds]; the coordinator "
                f"must lower {name}, or this site raise {key} in site.toml")
    if key.startswith("min_") and value < limit:
        return (f"{name} = {_show(value)} is below {key} = {_show(limit)} in this site's [bounds]; the coordinator "
                f"must raise {name}, or this site lower {key} in site.toml")
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _member(value: Any, choices: Sequence[Any]) -> bool:
    # True == 1 in Python: a bool is a member only of bools, a number only of numbers
    return any((type(value) is type(c) and value == c) or (_is_number(value) and _is_number(c) and value == c
                                                          and not isinstance(c, bool))
               for c in choices)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return repr(value)
    return str(value)


__all__ = ["BOUND", "Bound", "Total", "bounded", "bounds_of", "flag", "integer", "limit_problem", "names",
           "number", "one_of", "unbounded_fields"]
