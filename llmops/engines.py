"""Process-wide engine cache: one engine per (model, engine settings), built on first use.

The factory that builds a real engine is supplied by `llmops.core` (the only module importing `engine`);
tests and tools may install another one with `set_factory` (e.g. a fake engine for CLI tests).
Thread-safe: concurrent callers asking for the same key get the same instance, built once.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

Factory = Callable[..., Any]

_ENGINES: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}
_LOCK = threading.Lock()
_override: Factory | None = None
_USE_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_BY_ID: dict[int, threading.RLock] = {}   # engines that cannot be weakly referenced


def set_factory(factory: Factory | None) -> Factory | None:
    """Make `factory(model, **settings)` build every engine from now on (None restores the default);
    clears the cache; returns the previous override."""
    global _override
    with _LOCK:
        previous, _override = _override, factory
        _ENGINES.clear()
    return previous


def get_engine(model: str, settings: tuple[tuple[str, Any], ...], default_factory: Factory) -> Any:
    """The cached engine for (`model`, `settings`), built with the override factory or `default_factory`."""
    key = (model, tuple(sorted(settings)))
    with _LOCK:
        if key not in _ENGINES:
            factory = _override or default_factory
            _ENGINES[key] = factory(model, **dict(settings))
        return _ENGINES[key]


def clear() -> None:
    """Forget every cached engine (closing those that have `close()`)."""
    with _LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for eng in engines:
        close = getattr(eng, "close", None)
        if callable(close):
            close()


def lock_for(engine: Any) -> threading.RLock:
    """The one lock serializing use of `engine` (the same object for every caller)."""
    with _LOCK:
        try:
            return _USE_LOCKS.setdefault(engine, threading.RLock())
        except TypeError:
            return _BY_ID.setdefault(id(engine), threading.RLock())
