"""One registry mechanism for every plug-in kind (aggregators, policies, solvers).

A `Registry` maps names to classes (or factories). Names come from three places, in this order of
precedence: explicit `register(...)` calls (built-ins and user decorators), `importlib.metadata` entry
points in the registry's group (third-party packages), and `"module:attr"` strings naming an object
directly (quick user plugins, no packaging needed).
"""
from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import threading
from typing import Any, Callable, Dict, Generic, Iterable, List, Optional, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown name or a broken plug-in. The message names the kind, the name and the known names."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """A ' (did you mean 'x'?)' suffix when a close candidate exists, else ''."""
    close = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def load_object(spec: str) -> Any:
    """Import `"package.module:attr.sub"` and return the object."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RegistryError(f"'{spec}' is not of the form 'module:attribute'")
    try:
        obj: Any = _import_from_cwd_too(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever a user's module raises while it is imported is the error
        raise RegistryError(_import_failed(module_name, f"for '{spec}'", exc)) from exc
    module = obj
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise RegistryError(f"module '{module_name}' ({_where(module)}) has no attribute '{attr}' (from "
                                f"'{spec}'){_shadowed(module_name, module)}") from exc
    return obj


def _import_failed(module_name: str, what: str, exc: BaseException) -> str:
    """Why `module_name` could not be imported: not found (where it was looked for), or found and failing
    (its file, and the error its code raised)."""
    what = f" {what}" if what else ""
    if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
        return (f"cannot import module '{module_name}'{what}: {exc} (looked on sys.path, then in the working "
                f"directory {os.getcwd()})")
    try:
        found = importlib.util.find_spec(module_name)
    except Exception:  # noqa: BLE001 - a parent package that fails to import: no file to name
        found = None
    origin = getattr(found, "origin", None)
    where = f" ({os.path.relpath(origin) if not os.path.relpath(origin).startswith('..') else origin})" if origin else ""
    return f"importing module '{module_name}'{where}{what} failed: {type(exc).__name__}: {exc}"


def _where(module: Any) -> str:
    """The file a module was imported from, relative to the working directory when inside it."""
    path = getattr(module, "__file__", None)
    if not path:
        return "no file: a namespace package or a built-in module"
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _shadowed(module_name: str, module: Any) -> str:
    """A hint when a file of the same name in the working directory lost to the one imported (the
    script's own folder comes first on sys.path: a `my_policy.py` beside the script hides `./my_policy.py`)."""
    mine = os.path.join(os.getcwd(), *module_name.split(".")) + ".py"
    loaded = getattr(module, "__file__", None)
    if os.path.isfile(mine) and (not loaded or os.path.abspath(loaded) != mine):
        return (f"; {os.path.relpath(mine)} in the working directory has the same module name and was not imported: "
                "rename it")
    return ""


def import_user_modules(specs: Iterable[str]) -> List[Any]:
    """Import each of `specs` (a module name, or a path to a .py file) so that the names its decorators
    register (`register_policy`, `register_aggregator`, `register_solver`) are known: what `--import` does
    in the shipped train scripts (`pdv_ext/examples/train_gpt.py`) and `pdv check-config`. A file is imported under its file name (without .py),
    so that `"name:Class"` also finds it afterwards."""
    out = []
    for spec in specs:
        if spec.endswith(".py") or os.sep in spec:
            if not os.path.isfile(spec):
                raise RegistryError(f"cannot import '{spec}': no such file")
            name = os.path.splitext(os.path.basename(spec))[0]
            loaded = sys.modules.get(name)
            if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == os.path.abspath(spec):
                out.append(loaded)
                continue
            if loaded is not None:
                raise RegistryError(f"cannot import '{spec}' as module '{name}': a module of that name is already "
                                    f"imported ({_where(loaded)}); rename the file")
            unit = importlib.util.spec_from_file_location(name, spec)
            if unit is None or unit.loader is None:
                raise RegistryError(f"cannot import '{spec}': not a Python file")
            module = importlib.util.module_from_spec(unit)
            sys.modules[name] = module
            try:
                unit.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001
                del sys.modules[name]
                raise RegistryError(f"importing '{spec}' failed: {type(exc).__name__}: {exc}") from exc
            out.append(module)
            continue
        try:
            out.append(_import_from_cwd_too(spec))
        except Exception as exc:  # noqa: BLE001 - as in load_object: the user's module's own error, named
            raise RegistryError(_import_failed(spec, "", exc)) from exc
    return out


def call_factory(factory: Any, options: Dict[str, Any], base: type, label: str) -> Any:
    """`factory(**options)`, checked to be a `base`: a plug-in that is not a `base` subclass must be a factory
    (a function, or a class whose __new__ builds one). It is user code, so what it is and what it returns
    are checked here, with a RegistryError naming `label`; whatever it raises itself propagates."""
    article = "an" if base.__name__[:1] in "AEIOU" else "a"
    if not callable(factory):
        raise RegistryError(f"'{label}' names a {type(factory).__name__}, not {article} {base.__name__} subclass "
                            "or a factory returning one")
    built = factory(**options)
    if not isinstance(built, base):
        raise RegistryError(f"the factory '{label}' returned a {type(built).__name__}, not {article} {base.__name__}")
    return built


def factory_errors(factory: Any, options: Dict[str, Any], base: type, label: str, key: str) -> List[str]:
    """Config-check form of `call_factory`: its error, or what the factory raised, as one line naming `key`
    (plug-ins are cheap to build: configuration and a little state; their work starts later)."""
    try:
        call_factory(factory, options, base, label)
    except RegistryError as exc:
        return [f"{key}: {exc}"]
    except Exception as exc:  # noqa: BLE001 - whatever a user's factory raises is the error
        return [f"{key}: calling the factory '{label}' failed: {type(exc).__name__}: {exc}"]
    return []


def _import_from_cwd_too(module_name: str) -> Any:
    """Import a module; when its top-level package is not found, look in the working directory too (last,
    so it shadows nothing), as `uvicorn module:app` does: `"my_policy:PlateauLR"` then works from the
    folder holding my_policy.py whether the entry point is `pdv`, `deepspeed` or `python -m ...`."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        cwd = os.getcwd()
        if exc.name != module_name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        importlib.invalidate_caches()
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as again:
            if again.name == exc.name:  # not there either: leave sys.path as it was
                sys.path.remove(cwd)
            raise


class Registry(Generic[T]):
    """Name -> class registry with entry-point discovery.

    >>> AGGREGATORS = Registry("aggregator", "pdv_ext.aggregators")
    >>> @AGGREGATORS.register("mine")
    ... class Mine: ...
    """

    def __init__(self, kind: str, group: Optional[str] = None):
        self.kind = kind
        self.group = group
        self._items: Dict[str, T] = {}
        self._entry_points: Optional[Dict[str, importlib.metadata.EntryPoint]] = None
        self._lock = threading.Lock()

    # -- registration -------------------------------------------------------------------------------
    def register(self, name: Optional[str] = None, obj: Optional[T] = None, *, override: bool = False):
        """Register `obj` under `name`; without `obj`, return a decorator. Re-registering a different
        object under a taken name is an error unless `override=True`."""

        def _add(o: T) -> T:
            key = name or getattr(o, "name", None) or getattr(o, "__name__")
            with self._lock:
                old = self._items.get(key)
                if old is not None and old is not o and not override:
                    # the same class re-imported (e.g. module reloaded) replaces itself silently
                    same = (getattr(old, "__module__", None), getattr(old, "__qualname__", None)) == (
                        getattr(o, "__module__", None), getattr(o, "__qualname__", None))
                    if not same:
                        raise RegistryError(f"{self.kind} '{key}' is already registered ({old!r})")
                self._items[key] = o
            return o

        if obj is not None:
            return _add(obj)
        return _add

    def register_class(self, name: Optional[str] = None):
        """Class decorator for plug-in classes with a `name` attribute: registers the class under `name`
        (or its own `name`) and sets `cls.name` to the key, so instances know what they are called."""

        def deco(cls):
            key = name or cls.name
            cls.name = key
            self.register(key, cls)
            return cls

        return deco

    def unregister(self, name: str) -> None:
        with self._lock:
            self._items.pop(name, None)

    # -- discovery ----------------------------------------------------------------------------------
    def _eps(self) -> Dict[str, importlib.metadata.EntryPoint]:
        if self._entry_points is None:
            found: Dict[str, importlib.metadata.EntryPoint] = {}
            if self.group:
                for ep in importlib.metadata.entry_points(group=self.group):
                    found.setdefault(ep.name, ep)
            self._entry_points = found
        return self._entry_points

    def refresh(self) -> None:
        """Forget cached entry points (after installing a plug-in package at run time)."""
        self._entry_points = None

    def names(self) -> List[str]:
        """All names a lookup would accept (registered and entry points), sorted."""
        return sorted(set(self._items) | set(self._eps()))

    def __contains__(self, name: str) -> bool:
        return name in self._items or name in self._eps() or (isinstance(name, str) and ":" in name)

    # -- lookup -------------------------------------------------------------------------------------
    def get(self, name: str) -> T:
        """The object for `name`: registered, entry point, or a 'module:attr' spec."""
        if name in self._items:
            return self._items[name]
        ep = self._eps().get(name)
        if ep is not None:
            try:
                obj = ep.load()
            except Exception as exc:  # a broken plug-in must say which one
                raise RegistryError(
                    f"{self.kind} '{name}' (entry point {ep.value} in group {self.group}) failed to load: {exc}"
                ) from exc
            self.register(name, obj)
            return obj
        if isinstance(name, str) and ":" in name:
            return load_object(name)
        known = ", ".join(self.names()) or "none"
        attr = "function" if self.kind == "solver" else "Class"
        raise RegistryError(f"unknown {self.kind} '{name}'{did_you_mean(name, self.names())}; known: {known}; for your "
                            f"own, write 'module:{attr}' (the module is imported from sys.path or the working "
                            f"directory), or import the module that registers '{name}' first (`--import MODULE` in pdv check-config and "
                            "the shipped train scripts, e.g. python -m pdv_ext.examples.train_gpt)")

    def build(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Look up `name` and call it (a class: construct it)."""
        factory: Callable[..., Any] = self.get(name)  # type: ignore[assignment]
        return factory(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, group={self.group!r}, names={self.names()})"
