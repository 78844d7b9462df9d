"""Reading collectives out of compiled HLO text, whatever spelling XLA prints (test helper).

Tests assert what jaxdist promises about communication: which devices reduce
together, how many bytes cross the slow axis of a two-level mesh, how many
collectives a step launches. Those facts are read from ``.compile().as_text()``,
whose spelling changes between XLA releases. The replica groups of one
collective are printed in one of three forms:

- explicit lists: ``replica_groups={{0,1,2,3},{4,5,6,7}}`` (jax 0.10);
- iota: ``replica_groups=[2,4]<=[8]`` or ``[4,2]<=[2,4]T(1,0)``: ``iota(8)``
  reshaped to the dims after ``<=``, transposed by ``T(...)``, read as rows of
  the dims before ``<=`` (one row per group);
- mesh axes: ``replica_groups=mesh['host'=2,'local'=4] {'local'}`` (jax 0.12):
  the devices of the mesh (row-major; a ``device_ids=(...)`` suffix gives
  another order) that differ only along the named axes form one group; an axis
  written ``'x':(p)s`` is the sub-axis of size ``s`` after the ``p`` most major
  indices of ``x``.

All three become the same `Groups`: a tuple of groups, each a tuple of device
ids in XLA's order. Device ids are the logical ids of the mesh (row-major
position), which is how the SPMD partitioner numbers them. Any spelling this
module cannot read raises ``ValueError`` quoting it, so a new XLA spelling fails
a test loudly instead of making a collective invisible.

Example:
    >>> replica_groups("[4,2]<=[2,4]T(1,0)")
    ((0, 4), (1, 5), (2, 6), (3, 7))
    >>> replica_groups("mesh['host'=2,'local'=4] {'host'}")
    ((0, 4), (1, 5), (2, 6), (3, 7))
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "COLLECTIVES",
    "Collective",
    "Groups",
    "bytes_across",
    "collectives",
    "group_sets",
    "lowered_count",
    "mesh_groups",
    "replica_groups",
    "shape_bytes",
]

Groups = tuple[tuple[int, ...], ...]
"""Replica groups: one tuple of device ids per group, in XLA's order."""

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
"""The HLO opcodes that carry ``replica_groups`` (each may also appear as ``<op>-start``)."""

# Bits per element of each HLO element type.
_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}
_F8 = re.compile(r"f8e\w+|f4e\w+|f6e\w+")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_IOTA = re.compile(r"\[(\d+(?:,\d+)*)\]<=\[(\d+(?:,\d+)*)\](?:T\((\d+(?:,\d+)*)\))?")
_MESH = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]"
    r"(?:, device_ids=\((?P<ids>(?:[^()]|\([^()]*\))*)\))?"
    r" \{(?P<over>[^{}]*)\}"
)
_MESH_AXIS = re.compile(r"'?([^'=,]+)'?=(\d+)")
_AXIS_REF = re.compile(r"'?([^':,]+)'?(?::\((\d+)\)(\d+))?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*(?P<op>[a-z][a-z0-9-]*)\(")


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _iota(dims: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm is not None else ids


def _balanced(text: str, start: int, open_: str, close: str) -> int:
    """The index just past the ``close`` that matches the ``open_`` at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_}{close} in {text[start : start + 80]!r}")


def _mesh_groups_from(match: re.Match[str]) -> Groups:
    """The groups of a mesh-axes spelling (XLA's MeshAxesReplicaGroupList), re-derived."""
    axes = [(name, int(size)) for name, size in _MESH_AXIS.findall(match["axes"])]
    names = [name for name, _ in axes]
    sizes = [size for _, size in axes]
    ids_text = match["ids"]
    if ids_text is None:
        devices = np.arange(math.prod(sizes))
    elif ids_text.startswith("["):  # an iota device order, "[4,2]T(1,0)"
        iota = re.fullmatch(r"\[(\d+(?:,\d+)*)\](?:T\((\d+(?:,\d+)*)\))?", ids_text)
        if iota is None:
            raise ValueError(f"unknown device_ids spelling {ids_text!r} in {match[0]!r}")
        perm = _ints(iota[2]) if iota[2] else None
        devices = _iota(_ints(iota[1]), perm).reshape(-1)
    else:
        devices = np.asarray(_ints(ids_text))
    if devices.size != math.prod(sizes):
        raise ValueError(f"{match[0]!r}: {devices.size} device ids for mesh sizes {sizes}")
    refs: list[tuple[int, int, int]] = []  # (mesh axis, pre-size, size)
    for item in filter(None, (t.strip() for t in match["over"].split(","))):
        ref = _AXIS_REF.fullmatch(item)
        if ref is None or ref[1] not in names:
            raise ValueError(f"unknown axis {item} in {match[0]} (mesh axes {names})")
        axis = names.index(ref[1])
        pre, size = (int(ref[2]), int(ref[3])) if ref[2] else (1, sizes[axis])
        refs.append((axis, pre, size))
    # Split every mesh axis at the sub-axis boundaries its references name (major first:
    # a sub-axis "x":(p)s is the factor of x between cumulative sizes p and p * s).
    factor_dims: list[int] = []
    factor_of: dict[tuple[int, int], int] = {}  # (mesh axis, pre-size) -> factor index
    for axis, size in enumerate(sizes):
        cuts = sorted({1, size} | {c for a, p, s in refs if a == axis for c in (p, p * s)})
        if size == 1:  # an axis of one device is one factor of size 1
            cuts = [1, 1]
        for lo, hi in itertools.pairwise(cuts):
            if hi % lo:
                raise ValueError(f"{match[0]!r}: sub-axes of {names[axis]!r} do not nest")
            factor_of[(axis, lo)] = len(factor_dims)
            factor_dims.append(hi // lo)
    grouped = []
    for axis, pre, size in refs:
        factor = factor_of[(axis, pre)]
        if factor_dims[factor] != size:
            raise ValueError(f"{match[0]!r}: overlapping sub-axes of {names[axis]!r}")
        grouped.append(factor)
    rest = [i for i in range(len(factor_dims)) if i not in grouped]
    per_group = math.prod(factor_dims[i] for i in grouped)
    table = devices.reshape(factor_dims).transpose(rest + grouped).reshape(-1, per_group)
    return tuple(tuple(int(d) for d in row) for row in table)


def replica_groups(spelling: str, *, num_devices: int | None = None) -> Groups:
    """The groups written by one ``replica_groups=`` value, in any of XLA's spellings.

    Args:
        spelling: the text after ``replica_groups=`` (explicit, iota or mesh-axes form).
        num_devices: how many devices the program has; needed only for ``{}``
            (every device in one group).

    Returns:
        The groups, each a tuple of device ids in XLA's order.

    Raises:
        ValueError: a spelling this helper does not know, quoted.

    Example:
        >>> replica_groups("{{0,1},{2,3}}")
        ((0, 1), (2, 3))
        >>> replica_groups("mesh[x=8] {x:(2)2}")
        ((0, 2), (1, 3), (4, 6), (5, 7))
    """
    text = spelling.strip()
    if text.startswith("{"):
        inner = text[1:-1].strip()
        if not inner:
            if num_devices is None:
                raise ValueError("replica_groups={} means every device: pass num_devices")
            return (tuple(range(num_devices)),)
        rows = re.findall(r"\{([^{}]*)\}", inner)
        if re.sub(r"\{[^{}]*\}|,|\s", "", inner):
            raise ValueError(f"unknown replica_groups spelling {spelling!r}")
        return tuple(tuple(_ints(row)) for row in rows)
    if (iota := _IOTA.fullmatch(text)) is not None:
        shape = _ints(iota[1])
        perm = _ints(iota[3]) if iota[3] else None
        table = _iota(_ints(iota[2]), perm).reshape(shape)
        return tuple(tuple(int(d) for d in row) for row in table)
    if (mesh := _MESH.fullmatch(text)) is not None:
        return _mesh_groups_from(mesh)
    raise ValueError(
        f"unknown replica_groups spelling {spelling!r}: expected {{{{0,1}},{{2,3}}}}, "
        "[2,2]<=[4] or mesh['x'=2,'y'=2] {'y'}; teach tests/_hlo.py this one."
    )


def _take_groups(line: str, start: int) -> str:
    """The ``replica_groups=`` value that begins at ``line[start]``."""
    if line.startswith("{", start):
        return line[start : _balanced(line, start, "{", "}")]
    for pattern in (_IOTA, _MESH):
        found = pattern.match(line, start)
        if found is not None:
            return found[0]
    raise ValueError(f"unknown replica_groups spelling at {line[start : start + 80]!r}")


def _split_tuple(shape: str) -> list[str]:
    """The top-level elements of a tuple shape ``(a, (b, c), d)``."""
    inner, parts, depth, begin = shape[1:-1], [], 0, 0
    for i, ch in enumerate(inner):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(inner[begin:i])
            begin = i + 1
    parts.append(inner[begin:])
    return [re.sub(r"/\*[^*]*\*/", "", p).strip() for p in parts if p.strip()]


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape as printed: ``f32[4,2]{1,0}``, a tuple of them, ``token[]``.

    Example:
        >>> shape_bytes("(f32[2]{0}, /*index=1*/s8[3]{0})")
        11
    """
    total = 0
    arrays = _ARRAY.findall(shape)
    if not arrays:
        raise ValueError(f"no array shape in {shape!r}")
    for dtype, dims in arrays:
        if dtype in _BITS:
            bits = _BITS[dtype]
        elif _F8.fullmatch(dtype):
            bits = int(dtype[1])  # f8e4m3fn: 8 bits, f4e2m1fn: 4 bits
        else:
            raise ValueError(f"unknown element type {dtype!r} in shape {shape!r}")
        count = math.prod(int(d.replace("<=", "")) for d in dims.split(",") if d.strip())
        total += math.ceil(count * bits / 8)
    return total


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled HLO module.

    Attributes:
        name: the instruction's name (``reduce_scatter.7``).
        opcode: ``all-reduce``, ``reduce-scatter``, ``all-gather`` or ``all-to-all``
            (an asynchronous ``<op>-start`` is reported under ``<op>``).
        shape: its result shape as printed (a tuple when XLA combined several buffers).
        groups: its replica groups.
        asynchronous: it was printed as ``<op>-start``.
    """

    name: str
    opcode: str
    shape: str
    groups: Groups
    asynchronous: bool = False

    @property
    def group_size(self) -> int:
        """Devices per group (the same for every group of one collective)."""
        return len(self.groups[0]) if self.groups else 0

    @property
    def payload_bytes(self) -> int:
        """Bytes each participant puts in (the operand): the result of an all-reduce or
        all-to-all, the result times the group size for a reduce-scatter, the result
        over the group size for an all-gather (for ``all-gather-start``, whose result is
        the pair ``(operand, result)``, the operand)."""
        if self.asynchronous and self.opcode == "all-gather":
            return shape_bytes(_split_tuple(self.shape)[0])
        out = shape_bytes(self.shape)
        if self.opcode == "reduce-scatter":
            return out * self.group_size
        if self.opcode == "all-gather":
            return out // self.group_size
        return out

    def spans(self, mesh: Mapping[str, int], axis: str) -> bool:
        """Whether a group holds devices at different positions along mesh ``axis``.

        Args:
            mesh: the mesh's axis sizes, outermost first (``{"host": 2, "local": 4}``).
            axis: one of its names.
        """
        coord = _coordinates(mesh, axis)
        return any(len({coord[d] for d in group}) > 1 for group in self.groups)


def _coordinates(mesh: Mapping[str, int], axis: str) -> list[int]:
    """Each device id's index along ``axis`` of a row-major mesh."""
    if axis not in mesh:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh {dict(mesh)}")
    sizes = list(mesh.values())
    index = list(mesh).index(axis)
    return [int(c) for c in np.indices(sizes)[index].reshape(-1)]


def _header_devices(hlo: str) -> int | None:
    header = re.search(r"^HloModule [^\n]*", hlo, re.MULTILINE)
    if header is None:
        return None
    replicas = re.search(r"replica_count=(\d+)", header[0])
    partitions = re.search(r"num_partitions=(\d+)", header[0])
    return (int(replicas[1]) if replicas else 1) * (int(partitions[1]) if partitions else 1)


def collectives(hlo: str, opcode: str | None = None) -> list[Collective]:
    """Every collective of a compiled HLO module (all computations), in text order.

    Args:
        hlo: ``jitted.lower(...).compile().as_text()``.
        opcode: keep only this one (e.g. ``"all-reduce"``); ``None`` keeps all of
            `COLLECTIVES`.

    Returns:
        One `Collective` per instruction (a combined all-reduce of several buffers
        is one).

    Raises:
        ValueError: an unknown ``opcode``, or a collective whose line or replica
            groups this helper cannot read (it never skips one silently).
    """
    if opcode is not None and opcode not in COLLECTIVES:
        raise ValueError(f"opcode must be one of {COLLECTIVES}, got {opcode!r}")
    wanted = {opcode} if opcode else set(COLLECTIVES)
    num_devices = _header_devices(hlo)
    found: list[Collective] = []
    for line in hlo.splitlines():
        mentions = re.search(rf"\s(?:{'|'.join(COLLECTIVES)})(?:-start)?\(", line)
        if mentions is None:
            continue
        head = _INSTRUCTION.match(line)
        if head is None:
            raise ValueError(f"cannot read the collective instruction {line.strip()[:120]!r}")
        pos = head.end()
        end = _balanced(line, pos, "(", ")") if line.startswith("(", pos) else line.index(" ", pos)
        op = _OPCODE.match(line, end)
        if op is None:
            raise ValueError(f"cannot find the opcode of {line.strip()[:120]!r}")
        base = op["op"].removesuffix("-start")
        if base not in COLLECTIVES:  # e.g. an async-start wrapping a collective computation
            continue
        at = line.find("replica_groups=", op.end())
        groups = (
            replica_groups(_take_groups(line, at + len("replica_groups=")), num_devices=num_devices)
            if at >= 0
            else replica_groups("{}", num_devices=num_devices)
        )
        if base in wanted:
            found.append(
                Collective(
                    name=head["name"],
                    opcode=base,
                    shape=line[pos:end],
                    groups=groups,
                    asynchronous=op["op"].endswith("-start"),
                )
            )
    return found


def group_sets(hlo: str, opcode: str) -> list[frozenset[frozenset[int]]]:
    """The replica groups of each ``opcode`` in ``hlo``, order-free (for comparisons).

    Example:
        >>> hlo = "  %x = f32[2]{0} all-reduce(%y), replica_groups=[2,2]<=[4], to_apply=%add"
        >>> group_sets(hlo, "all-reduce") == [mesh_groups({"a": 2, "b": 2}, over=("b",))]
        True
    """
    return [frozenset(map(frozenset, c.groups)) for c in collectives(hlo, opcode)]


def mesh_groups(mesh: Mapping[str, int], over: Iterable[str]) -> frozenset[frozenset[int]]:
    """The groups a collective over mesh axes ``over`` must have (devices numbered row-major).

    Args:
        mesh: axis sizes, outermost first, e.g. ``{"host": 2, "local": 4}``.
        over: the axes the collective runs over, e.g. ``("local",)`` (inside each host).

    Returns:
        The set of groups: devices that differ only along ``over`` are together.

    Example:
        >>> sorted(map(sorted, mesh_groups({"host": 2, "local": 4}, over=("host",))))
        [[0, 4], [1, 5], [2, 6], [3, 7]]
    """
    names, sizes = list(mesh), list(mesh.values())
    over = list(over)
    if unknown := [a for a in over if a not in names]:
        raise ValueError(f"mesh_groups: {unknown} are not axes of the mesh {dict(mesh)}")
    axes = [names.index(a) for a in over]
    rest = [i for i in range(len(names)) if i not in axes]
    per_group = math.prod(sizes[i] for i in axes)
    table = np.arange(math.prod(sizes)).reshape(sizes).transpose(rest + axes)
    return frozenset(frozenset(int(d) for d in row) for row in table.reshape(-1, per_group))


def bytes_across(hlo: str, mesh: Mapping[str, int], axis: str) -> int:
    """Bytes each device puts into collectives whose groups span mesh ``axis``.

    For the ``host`` axis of a ``(host, local)`` mesh this is the traffic that
    leaves a host: a flat all-reduce counts its whole buffer, a hierarchical one
    only the shard it all-reduces across hosts.

    Example:
        >>> hlo = (
        ...     "  %a = f32[2]{0} all-reduce(%p), replica_groups=[4,2]<=[2,4]T(1,0)\\n"
        ...     "  %b = f32[8]{0} all-gather(%a), replica_groups=[2,4]<=[8]\\n"
        ... )
        >>> bytes_across(hlo, {"host": 2, "local": 4}, "host")
        8
    """
    return sum(c.payload_bytes for c in collectives(hlo) if c.spans(mesh, axis))


def lowered_count(text: str, name: str) -> int:
    """How many StableHLO ``name`` ops (``all_reduce``, ``reduce_scatter``, ``all_gather``)
    ``jitted.lower(...).as_text()`` has: the collectives jaxdist emitted, before XLA's
    combiner merges any.

    Example:
        >>> lowered_count('%1 = "stablehlo.all_reduce"(%0) <{...}>', "all_reduce")
        1
    """
    return len(re.findall(rf"\b(?:stablehlo|mhlo)\.{re.escape(name)}\b", text))
