"""Named multi-dimensional shapes, points in them, slicing, and meshes of values."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
Index = int | slice


class Shape:
    """Ordered dimension names and sizes, e.g. ``{"hosts": 2, "gpus": 4}`` (row-major)."""

    __slots__ = ("names", "sizes")

    def __init__(self, dims: Mapping[str, int]) -> None:
        for name, size in dims.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"dimension names must be identifiers, not {name!r}")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"dimension {name!r} must have a positive int size, not {size!r}")
        self.names: tuple[str, ...] = tuple(dims)
        self.sizes: tuple[int, ...] = tuple(dims.values())

    @property
    def extent(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes))

    def __len__(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shape) and self.extent == other.extent

    def __repr__(self) -> str:
        return f"Shape({self.extent})"

    def points(self) -> Iterator[Point]:
        for rank, coords in enumerate(itertools.product(*(range(s) for s in self.sizes))):
            yield Point(dict(zip(self.names, coords)), rank, self.extent)

    def rank_of(self, coords: Mapping[str, int]) -> int:
        if set(coords) != set(self.names):
            raise KeyError(f"a point needs exactly the dimensions {list(self.names)}, got {list(coords)}")
        rank = 0
        for name, size in zip(self.names, self.sizes):
            c = coords[name]
            if not 0 <= c < size:
                raise IndexError(f"{name}={c} is outside 0..{size - 1}")
            rank = rank * size + c
        return rank

    def select(self, **dims: Index) -> tuple[Shape, list[int]]:
        """The sub-shape picked by ``dims`` and the flat ranks (into this shape) it keeps.

        An int drops its dimension; a slice keeps it with the selected extent.
        """
        unknown = set(dims) - set(self.names)
        if unknown:
            raise KeyError(f"no dimension(s) {sorted(unknown)} in shape {self.extent}")
        per_dim: list[list[int]] = []
        new_dims: dict[str, int] = {}
        for name, size in zip(self.names, self.sizes):
            sel = dims.get(name, slice(None))
            if isinstance(sel, slice):
                idx = list(range(size))[sel]
                if not idx:
                    raise IndexError(f"slice {sel} of {name} (size {size}) is empty")
                new_dims[name] = len(idx)
            elif isinstance(sel, int) and not isinstance(sel, bool):
                i = sel + size if sel < 0 else sel
                if not 0 <= i < size:
                    raise IndexError(f"{name}={sel} is outside 0..{size - 1}")
                idx = [i]
            else:
                raise TypeError(f"{name} must be an int or a slice, not {type(sel).__name__}")
            per_dim.append(idx)
        strides = []
        acc = 1
        for size in reversed(self.sizes):
            strides.append(acc)
            acc *= size
        strides.reverse()
        ranks = [sum(c * s for c, s in zip(combo, strides)) for combo in itertools.product(*per_dim)]
        return Shape(new_dims), ranks


class Point(Mapping[str, int]):
    """A position in a shape: coordinates by name, plus ``rank`` (row-major) and ``extent``."""

    __slots__ = ("coords", "rank", "extent")

    def __init__(self, coords: dict[str, int], rank: int, extent: dict[str, int]) -> None:
        self.coords = coords
        self.rank = rank
        self.extent = extent

    def __getitem__(self, key: str) -> int:
        return self.coords[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.coords)

    def __len__(self) -> int:
        return len(self.coords)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.coords.items())
        return f"Point({inner}; rank={self.rank})"

    def __reduce__(self) -> Any:
        return Point, (self.coords, self.rank, self.extent)


class ValueMesh(Generic[T]):
    """The results of a ``call()``: one value per point of the mesh that was called."""

    def __init__(self, shape: Shape, values: Sequence[T]) -> None:
        self.shape = shape
        self._values = list(values)

    def items(self) -> Iterator[tuple[Point, T]]:
        return zip(self.shape.points(), self._values)

    def values(self) -> list[T]:
        return list(self._values)

    def item(self, **point: int) -> T:
        if not self.shape.names and not point:
            return self._values[0]
        return self._values[self.shape.rank_of(point)]

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[tuple[Point, T]]:
        return self.items()

    def __repr__(self) -> str:
        return f"ValueMesh({self.shape.extent}, {self._values!r})"
