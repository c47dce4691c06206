"""Python state a forward writes: module attributes changed during capture, refused.

A captured graph is a function of the parameters and the batch; every Python value forward
reads becomes a constant of it. So a forward that keeps Python state,

    def forward(self, x, y):
        self.steps += 1                       # a plain int attribute
        if self.steps > 1000: x = x * 2       # a branch on it
        ...

is captured as it ran once, under torch.export: every compiled step sees `steps` as capture
saw it, takes the branch the way capture took it, and never makes the update again. Nothing
fails; training is silently different from the eager model's. (torch.export notices too, and
puts the attributes it finds changed back when it is done, but only warns about tensors.)
`trace.capture` refuses such a model instead, naming the module, the attribute, its value
before and after forward, and the fix, as it refuses a forward that writes a buffer in place
(`fxpar.frontend.state_writes`).

How: `AttributeWatch` hangs a forward pre-hook and a forward hook on the root module while
torch.export runs it, and fingerprints the attributes of every module when forward starts and
again when it returns, before export puts them back. What it compares, in each module's
`__dict__`:

* every entry but `nn.Module`'s own bookkeeping (the parameter, buffer, submodule and hook
  tables); `training` is compared, so a forward that calls `self.eval()` is refused too;
* numbers, strings, None, dtypes, devices and enums by value; lists, tuples, dicts and sets by
  their items; an object with attributes (a Hugging Face config) by its attributes; each to
  depth 3 and its first 64 items (and its length), so a fingerprint stays cheap;
* tensors, modules, symbolic sizes (`self.n = x.shape[0]`) and anything else (functions,
  objects without attributes) by identity: a plain tensor attribute assigned in forward
  (`self.total = self.total + loss`, a cache filled on the first call) is refused too, since
  the graph recomputes it every step from what capture saw and never keeps it (export only
  warns); a buffer written in place is the same object, and `state_writes`'s to find.

Not covered: module-level globals and closures a forward changes.
"""

from __future__ import annotations

import enum
import functools
import itertools
import types
from dataclasses import dataclass

import torch

from fxpar.errors import CaptureError, shown

_DEPTH = 3  # how deep containers and objects are compared
_ITEMS = 64  # the items of one container compared one by one (its length always)
# nn.Module's own tables (and the lazy modules' hooks), all but `training`: export and hooks
# change them while tracing, and they are no state forward computes with. Likewise the flag
# transformers (5.x) sets when its first forward installs the hooks that record outputs such
# as the routers' logits (`maybe_install_capturing_hooks`): the hooks record into each call's
# own context, the same way on every call, so the flag changes no op of the graph.
_BOOKKEEPING = (frozenset(vars(torch.nn.Module())) | {"_initialize_hook", "_load_hook",
                                                      "_output_capturing_hooks_installed"}) - {"training"}
_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)
_BY_IDENTITY = (torch.nn.Module, type, types.ModuleType, types.FunctionType,
                types.BuiltinFunctionType, types.MethodType, functools.partial, torch.SymInt, torch.SymFloat,
                torch.SymBool)
_ABSENT = ("absent",)
_UNSET = "not set"


@dataclass(frozen=True)
class AttributeWrite:
    """One attribute of a module that differs between the start and the end of forward."""

    module_path: str  # "" for the root module
    module_type: str  # "Counter"
    attribute: str  # "steps", "config.counter", "history[3]"
    before: str  # what it held when forward started ("not set" for an attribute forward added)
    after: str  # what it held when forward returned ("not set" for one forward deleted)


class AttributeWatch:
    """While entered, finds the attributes `model`'s forward changes, in `writes`.

        with AttributeWatch(model) as watch:
            exported = torch.export.export(model, args, strict=False)
        refuse_attribute_writes(watch)   # CaptureError naming the first change, if any

    Every run of forward is compared with its own start: export may run it more than once.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.writes: list[AttributeWrite] = []
        self._started: dict[tuple[str, str], tuple] = {}

    def __enter__(self) -> AttributeWatch:
        self._hooks = (self.model.register_forward_pre_hook(self._start),
                       self.model.register_forward_hook(self._finish))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for hook in self._hooks:
            hook.remove()

    def _start(self, module: torch.nn.Module, args: tuple) -> None:
        self._held: list[object] = []  # until `_finish`: an object freed in forward keeps its id
        self._started = fingerprint_attributes(module, self._held)

    def _finish(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if not self.writes:
            self.writes = changed_attributes(module, self._started, fingerprint_attributes(module))
        self._started, self._held = {}, []


def fingerprint_attributes(
    model: torch.nn.Module, held: list[object] | None = None
) -> dict[tuple[str, str], tuple]:
    """(module path, attribute) -> a fingerprint of its value, for every module (module doc).
    Keep `held` (what is compared by identity) alive as long as the fingerprints are compared."""
    memo: dict[int, tuple] = {}  # one fingerprint per object, however many modules hold it
    held = [] if held is None else held
    return {
        (path, name): _fingerprint(value, _DEPTH, memo, held)
        for path, module in model.named_modules()
        for name, value in vars(module).items()
        if name not in _BOOKKEEPING
    }


def changed_attributes(
    model: torch.nn.Module, before: dict[tuple[str, str], tuple], after: dict[tuple[str, str], tuple]
) -> list[AttributeWrite]:
    """The attributes whose fingerprints differ, in module order, each at its first change."""
    writes = []
    for key in dict.fromkeys([*before, *after]):
        old, new = before.get(key, _ABSENT), after.get(key, _ABSENT)
        if old != new:
            path, name = key
            where, old, new = _first_difference(name, old, new)
            old_text, new_text = _described(old), _described(new)
            if old_text == new_text:  # one object replaced by another of its type
                new_text = f"another {new_text[2:]}" if new_text.startswith("a ") else f"{new_text} (another object)"
            writes.append(AttributeWrite(path, type(model.get_submodule(path)).__name__, where, old_text, new_text))
    return writes


def refuse_attribute_writes(watch: AttributeWatch) -> None:
    """Raise CaptureError naming the first attribute forward changed, its module and the fix."""
    if not watch.writes:
        return
    first, others = watch.writes[0], watch.writes[1:]
    owner = f"module {first.module_path!r} ({first.module_type})" if first.module_path else (
        f"the root module ({first.module_type})")
    listed = ", ".join(f"{w.module_path + '.' if w.module_path else ''}{w.attribute}" for w in others[:4])
    also = f" (and {len(others)} more: {listed}{', ...' if len(others) > 4 else ''})" if others else ""
    raise CaptureError(
        f"the model's forward changes attribute {first.attribute!r} of {owner}: it "
        f"{_held(first.before)} when forward started and {_held(first.after)} when it returned{also}. A captured "
        "graph holds the Python values forward reads as constants, so every compiled step would "
        f"see {first.attribute} as capture saw it (a branch on it always taken the same way) and "
        "never make the change again, and each rank would keep its own. Fix: keep Python state "
        "out of forward: compute the value from forward's inputs (a step count can be an input "
        "tensor) or once in __init__ (a table as a buffer), or change the attribute outside "
        "forward, between steps, and compile again when it changes what forward computes"
    )


def _fingerprint(value: object, depth: int, memo: dict[int, tuple], held: list[object]) -> tuple:
    """A value to compare with `==` that changes when `value` does (module doc); never calls
    `==` on the user's objects, nor anything that would guard a symbolic size. What is compared
    by identity is appended to `held`, kept alive so that no new object takes its id."""
    if isinstance(value, torch.Tensor):  # export's FakeTensor or FunctionalTensor is "a Tensor" too
        held.append(value)
        return ("identity", torch.Tensor, id(value))
    if isinstance(value, _VALUES):
        return ("value", type(value), value)
    if isinstance(value, _BY_IDENTITY) or depth == 0:
        held.append(value)
        return ("identity", type(value), id(value))
    if id(value) in memo:
        return memo[id(value)]
    items: object
    if isinstance(value, (list, tuple)):
        items = tuple(_fingerprint(v, depth - 1, memo, held) for v in itertools.islice(value, _ITEMS))
    elif isinstance(value, dict):
        items = tuple((_fingerprint(k, 1, memo, held), _fingerprint(v, depth - 1, memo, held))
                      for k, v in itertools.islice(value.items(), _ITEMS))
    elif isinstance(value, (set, frozenset)):
        items = frozenset(_fingerprint(v, 1, memo, held) for v in itertools.islice(value, _ITEMS))
    elif isinstance(getattr(value, "__dict__", None), dict):
        attributes = vars(value)
        items = tuple((k, _fingerprint(v, depth - 1, memo, held)) for k, v in itertools.islice(attributes.items(), _ITEMS))
        memo[id(value)] = ("object", type(value), len(attributes), items)
        return memo[id(value)]
    else:
        return ("identity", type(value), id(value))
    return ("container", type(value), len(value), items)


def _first_difference(where: str, old: tuple, new: tuple) -> tuple[str, tuple, tuple]:
    """Follow two fingerprints down to the innermost item that differs: `history[3]`."""
    both = {old[0], new[0]} == {"object"} or {old[0], new[0]} == {"container"}
    if not both or old[1] is not new[1] or old[2] != new[2] or isinstance(old[3], frozenset):
        return where, old, new
    for index, (a, b) in enumerate(zip(old[3], new[3])):
        if a == b:
            continue
        if old[0] == "object" or issubclass(old[1], dict):
            if a[0] != b[0]:  # another attribute or key at this place: the whole thing changed
                return where, old, new
        if old[0] == "object":
            return _first_difference(f"{where}.{a[0]}", a[1], b[1])
        if issubclass(old[1], dict):
            key = shown(a[0][2]) if a[0][0] == "value" else str(index)
            return _first_difference(f"{where}[{key}]", a[1], b[1])
        return _first_difference(f"{where}[{index}]", a, b)
    return where, old, new


def _held(described: str) -> str:
    return "was not set" if described == _UNSET else f"held {described}"


def _described(fingerprint: tuple) -> str:
    """What a fingerprint shows of its value: `0`, `'hi'`, `a list of 3 items`, `a Config object`."""
    kind, kind_type = fingerprint[0], (fingerprint[1] if len(fingerprint) > 1 else None)
    if kind == "absent":
        return _UNSET
    if kind == "value":
        return shown(fingerprint[2])
    if kind == "container":
        return f"a {kind_type.__name__} of {fingerprint[2]} item{'' if fingerprint[2] == 1 else 's'}"
    return f"a {kind_type.__name__} object"  # an object, or one compared by identity
