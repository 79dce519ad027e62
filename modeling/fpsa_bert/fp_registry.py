# Source of truth: hf_fixedpoint/core/fp_registry.py. Verbatim copies live in modeling/*/ so that checkpoints
# saved with save_pretrained() load with torch + transformers only. Edit here, then run
# `python -m hf_fixedpoint.vendor`. Allowed imports: stdlib, torch, and `from .fp_<x> import ...`.
"""Name -> object registries whose errors list the valid names.

Each vendored copy of a core file owns its registry: a name registered at run time with ``register`` exists in this
process only. A name stored in a saved config must be one that ships in the core files.
"""

import functools
import inspect
from typing import Dict, Iterator, TypeVar

T = TypeVar("T")


class Registry:
    """A small ``name -> object`` mapping for solvers, backward modes and samplers.

    Example:
        >>> SOLVERS = Registry("solver")
        >>> @SOLVERS.register("picard")
        ... def picard(...): ...
        >>> SOLVERS.get("picrad")
        ValueError: Unknown solver 'picrad'. Valid solvers: 'picard'.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: Dict[str, object] = {}

    def register(self, name: str, obj: object = None, *, overwrite: bool = False):
        """Register ``obj`` under ``name``; usable as a decorator when ``obj`` is omitted."""
        if not isinstance(name, str) or not name or name != name.lower():
            raise ValueError(f"{self.kind} names must be non-empty lowercase strings, got {name!r}.")

        def _add(o: T) -> T:
            if name in self._items and not overwrite:
                raise ValueError(f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it.")
            self._items[name] = o
            return o

        return _add if obj is None else _add(obj)

    def get(self, name: str):
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"Unknown {self.kind} {name!r}. Valid {self.kind}s: {', '.join(map(repr, self.names()))}."
            ) from None

    def names(self):
        return sorted(self._items)

    def __contains__(self, name) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)

    def check(self, name: str, argument: str) -> str:
        """Validate ``name`` as the value of ``argument`` (used by configs); returns it unchanged."""
        if name not in self._items:
            raise ValueError(
                f"{argument}={name!r} is not a known {self.kind}. "
                f"Allowed values: {', '.join(map(repr, self.names()))}."
            )
        return name


def check_choice(value, argument: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"{argument}={value!r} is not allowed. Allowed values: {', '.join(map(repr, choices))}.")


def check_number(value, argument: str, *, low=None, high=None, low_open=False, high_open=False, integer=False):
    """Raise a ValueError naming ``argument`` unless ``value`` lies in the interval described."""
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{argument} must be {'an integer' if integer else 'a number'}, got {value!r}.")
    bad = (low is not None and (value <= low if low_open else value < low)) or (
        high is not None and (value >= high if high_open else value > high)
    )
    if bad or value != value:  # NaN compares unequal to itself
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ValueError(f"{argument}={value!r} is out of range; allowed values lie in {interval}.")


@functools.lru_cache(maxsize=None)
def keyword_options(fn, keyword_only: bool = False) -> tuple:
    """Option names of a function (or of a class's ``__init__``): no ``self``, no ``_private`` names, no ``*args``."""
    target = fn.__init__ if isinstance(fn, type) else fn
    kinds = (inspect.Parameter.KEYWORD_ONLY,) if keyword_only else (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in inspect.signature(target).parameters.values()
                 if p.kind in kinds and p.name != "self" and not p.name.startswith("_"))


def check_keywords(kwargs: dict, allowed, argument: str, owner: str) -> None:
    """Raise a ValueError naming ``argument`` if ``kwargs`` has keys outside ``allowed``."""
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(
            f"{argument} has unknown keys {unknown} for {owner}. Allowed keys: {list(allowed) or 'none'}."
        )


def reject_prefixed_keywords(kwargs: dict, prefix: str, allowed, where: str, hint: str,
                             kind: str = "keyword(s)") -> None:
    """A keyword starting with ``prefix`` that a forward does not know (a typo such as ``fp_max_itr``) is a ValueError
    that names it and says what ``where`` takes (``hint``), not a keyword passed on and silently ignored."""
    unknown = sorted(k for k in kwargs if k.startswith(prefix) and k not in allowed)
    if unknown:
        raise ValueError(f"{where} got unknown {kind} {unknown}. {hint}")


class CheckedConfigMixin:
    """Put before ``PretrainedConfig`` in a family's config: a setting assigned after construction is checked as
    ``__init__`` checks it. ``from_pretrained(dir, key=value)`` (``AutoModel*`` and the saved remote code alike) sets
    its leftover keyword arguments with ``setattr`` after ``__init__``, and so does ``config.key = value``; without
    this a bad value loads and fails (or misbehaves) later. A family overrides ``check_setting``."""

    def check_setting(self, key: str, value) -> None:
        """Raise a ValueError naming ``key`` and its allowed values unless ``value`` is allowed."""

    def __setattr__(self, key, value):
        self.check_setting(key, value)
        super().__setattr__(key, value)


def complete_auto_map(auto_map, family_auto_map: dict) -> dict:
    """``auto_map`` (a config's, or None) with the entries of ``family_auto_map`` it lacks added.

    A config passes ``complete_auto_map(kwargs.get("auto_map"), FAMILY_AUTO_MAP)`` on as its ``auto_map``, so
    ``save_pretrained`` writes every Auto class of the family -- not only ``AutoConfig`` and the class that saved
    (transformers' ``register_for_auto_class`` records one class each) -- and an export of any head also loads with
    ``AutoModel`` and the sibling heads, as upstream remote-code repositories do. Entries already there win; added ones
    take the ``repo--`` prefix transformers gave the existing ones when the config came from the Hub.
    """
    auto_map = dict(auto_map or {})
    refs = [r for v in auto_map.values() for r in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(r, str)]
    prefix = next((r.partition("--")[0] + "--" for r in refs if "--" in r), "")
    for auto_class, ref in family_auto_map.items():
        auto_map.setdefault(auto_class, prefix + ref)
    return auto_map


__all__ = [
    "CheckedConfigMixin",
    "Registry",
    "check_choice",
    "check_keywords",
    "check_number",
    "complete_auto_map",
    "keyword_options",
    "reject_prefixed_keywords",
]
