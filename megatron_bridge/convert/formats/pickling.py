"""Pickles that name torch objects without importing torch.

A checkpoint's pickles (a rank file's `data.pkl`, a DCP `.metadata`) refer to torch by
name: `torch._utils._rebuild_tensor_v2`, `torch.BFloat16Storage`, `torch.bfloat16`,
`torch.Size`, dataclasses of `torch.distributed.checkpoint`. A pickle stores only those
names (the GLOBAL opcode) and how to call them, so writing one needs no torch at all, and
`import torch` would otherwise sit on the converter's critical path (it costs about as
much as copying a mid-sized model; docs/benchmarks.md).

The stand-ins below say what to write; `TorchPickler` (the pure-Python pickler with entries
for them in its dispatch table) writes the same opcodes pickle writes for the real objects,
so `pickle.loads` of the result gives the real objects, and for the shapes used here the
bytes are those `torch.save` writes (tests/unit/convert/test_torch_zip.py compares them).

Loading is the same in reverse: an `Unpickler` whose `find_class` returns stand-ins for the
names (`Record`s for the classes) reads such a pickle without the modules that define them.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from megatron_bridge.convert.formats.dtypes import DType


@dataclass(frozen=True)
class Global:
    """A module attribute by name (a class, a function, a `torch.dtype`): what pickle
    writes for any of them, and what `find_class(module, name)` gets back on loading."""

    module: str
    name: str


@dataclass(frozen=True, eq=False)
class Reduce:
    """`func(*args)`, pickled as REDUCE: what an object whose `__reduce__` returns
    `(func, args)` becomes (`torch.Size([1, 4])` is `Reduce(Global("torch", "Size"), ((1, 4),))`)."""

    func: Global
    args: tuple[Any, ...]


@dataclass(frozen=True, eq=False)
class Instance:
    """An instance of `module.name` made by `cls.__new__(cls, *args)` and then given `state`
    (NEWOBJ + BUILD): what protocol 2 writes for an ordinary class or dataclass, whose
    `__reduce_ex__` is `copyreg.__newobj__` with `__dict__` as the state."""

    module: str
    name: str
    state: Any
    args: tuple[Any, ...] = ()


class TorchPickler(pickle._Pickler):
    """The pure-Python pickler (whose dispatch table can be extended per type, unlike the C
    one's) with the stand-ins above and `DType`s (pickled as the `torch.dtype` of that name).

    A real `torch.dtype` in the object needs nothing special: its `__reduce__` returns its
    name and `pickle` writes GLOBAL torch.<name> for it already (torch is imported then)."""

    dispatch = pickle._Pickler.dispatch.copy()

    if TYPE_CHECKING:  # the pure-Python pickler's internals used here, which typeshed's stub leaves out
        memo: dict[int, tuple[int, Any]]

        def write(self, data: bytes) -> Any: ...
        def get(self, i: int) -> bytes: ...
        def memoize(self, obj: Any) -> None: ...
        def save(self, obj: Any, save_persistent_id: bool = True) -> None: ...

    def __init__(self, file: BinaryIO):
        super().__init__(file, protocol=2)  # torch.save's protocol
        self._globals: dict[tuple[str, str], int] = {}  # memo index of each name written

    def save_global_ref(self, g: Global) -> None:
        # pickle memoizes a global by the object's id; stand-ins of one name are distinct
        # objects, so their memo is by name: a name is written once, later uses refer back
        at = self._globals.get((g.module, g.name))
        if at is not None:
            self.write(self.get(at))
            return
        self.write(pickle.GLOBAL + f"{g.module}\n{g.name}\n".encode("ascii"))
        self.memoize(g)
        self._globals[(g.module, g.name)] = self.memo[id(g)][0]

    def save_call(self, func: Global, args: tuple[Any, ...], obj: Any) -> None:
        """Write `func(*args)` standing for `obj` (memoized as `obj`, so a second reference to
        it refers back, as pickle does for any reduced object)."""
        self.save(func)
        self.save(args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    def save_reduce_ref(self, r: Reduce) -> None:
        self.save_call(r.func, tuple(r.args), r)

    def save_instance(self, i: Instance) -> None:
        self.save(Global(i.module, i.name))
        self.save(tuple(i.args))
        self.write(pickle.NEWOBJ)
        self.memoize(i)
        self.save(i.state)
        self.write(pickle.BUILD)

    def save_dtype(self, d: DType) -> None:
        self.save(Global("torch", d.name))

    # typeshed types `dispatch`'s functions as taking an Unpickler (they take the pickler)
    dispatch[Global] = save_global_ref  # type: ignore[assignment]
    dispatch[Reduce] = save_reduce_ref  # type: ignore[assignment]
    dispatch[Instance] = save_instance  # type: ignore[assignment]
    dispatch[DType] = save_dtype  # type: ignore[assignment]


class Record:
    """What a loading `find_class` returns in place of a class that pickle rebuilds with
    NEWOBJ + BUILD (the `Instance` case: a dataclass, whose state is its `__dict__`): a bag of
    the pickled attributes. Loading DCP's `.metadata` this way needs neither torch nor
    `torch.distributed.checkpoint` (the converter's two most expensive imports). Class
    attributes are the defaults of fields a pickled state may leave out."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def torch_size(dims: tuple[int, ...]) -> Reduce:
    """`torch.Size(dims)` as pickle writes it."""
    return Reduce(Global("torch", "Size"), (tuple(dims),))


__all__ = ["Global", "Reduce", "Instance", "TorchPickler", "Record", "torch_size"]
