"""Laying training-state leaves out on a named mesh by logical axis rules (`MeshStrategy`).

A leaf's layout comes from its logical axis names, one per dimension
(``("embed", "mlp")``): the model's own annotations (Flax NNX
``out_sharding``, Linen ``LogicallyPartitioned`` boxes), else the first
``param_rules`` entry ``(regex, names)`` whose regex matches the leaf's
``/``-joined path (``re.search``), else those of the parameter it belongs to
(an optimizer-state leaf whose path ends with a parameter's whole path, or in
a `TrainState` with the parameter's path after ``params/``, and has its shape). Each name maps
to mesh axes by the first rule ``(name, axes or None)`` for it; the spec is
those axes, dimension by dimension.

Nothing is replicated silently: a name without a rule, a mesh axis used twice
in one leaf, axes whose size does not divide the dimension, a count of names
that differs from the rank, and a leaf of at least ``min_shard_bytes`` with no
names at all are problems, and every problem of a state is reported in one
``ValueError`` naming the leaf's path, shape, logical names and rule.
Unannotated leaves smaller than ``min_shard_bytes`` (scalars such as
optimizer counts, PRNG keys) are replicated; a ``param_rules`` entry whose
names are ``None`` or ``()`` replicates on purpose.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdist.strategies._state_leaves import StateLeaf, leaf_bytes, replicated_problem
from jaxdist.strategies.checks import check_regex, ordered_pairs

__all__ = ["LogicalLayout", "batch_axes", "check_param_rules", "check_rules"]

Axes = tuple[str, ...] | None  # the mesh axes a logical name maps to (None: replicated)
Names = tuple[str | None, ...]


_RULES_EXAMPLE = '(("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"))'


def check_rules(
    rules: Any, sizes: dict[str, int], where: str
) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """``rules`` checked: ``(logical name, mesh axis | tuple of mesh axes | None)`` pairs
    naming axes of the mesh (``sizes``), a ``"batch"`` rule among them naming at least
    one axis. Raises ``TypeError`` / ``ValueError`` naming the rule and the fix."""
    items = ordered_pairs(rules, "rules", where, _RULES_EXAMPLE)
    out: list[tuple[str, str | tuple[str, ...] | None]] = []
    for i, rule in enumerate(items):
        ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
        axes = rule[1] if ok else None
        if ok and isinstance(axes, list):
            axes = tuple(axes)
        if ok and axes is not None and not isinstance(axes, str):
            ok = isinstance(axes, tuple) and all(isinstance(a, str) for a in axes)
        if not ok:
            raise TypeError(
                f"{where}(rules=...): rules[{i}] must be a (logical name, mesh axis | tuple "
                f"of mesh axes | None) pair, got {rule!r}. Example: ('mlp', 'tensor')."
            )
        named = () if axes is None else (axes,) if isinstance(axes, str) else axes
        missing = [a for a in named if a not in sizes]
        if missing:
            raise ValueError(
                f"{where}(rules=...): rules[{i}] {rule!r} names mesh axis "
                f"{missing[0]!r}, which the mesh {sizes} lacks. Use one of "
                f"{tuple(sizes)}, or None to replicate {rule[0]!r}."
            )
        if len(set(named)) != len(named):
            raise ValueError(f"{where}(rules=...): rules[{i}] {rule!r} names a mesh axis twice.")
        out.append((rule[0], axes))
    batch = [axes for name, axes in out if name == "batch"]
    if not batch or batch[0] is None or batch[0] == ():
        found = "has none" if not batch else f"maps it to {batch[0]!r}"
        raise ValueError(
            f"{where}(rules=...): the rules need a rule for the logical name 'batch' naming "
            f"the mesh axes that split the batch (its replicas); {tuple(out)!r} {found}. "
            f"Example: rules=(('batch', ('data', 'fsdp')), ...) on mesh {sizes}."
        )
    return tuple(out)


def batch_axes(rules: Sequence[tuple[str, Any]]) -> tuple[str, ...]:
    """The mesh axes of the first ``"batch"`` rule (checked by `check_rules`)."""
    axes = next(axes for name, axes in rules if name == "batch")
    return (axes,) if isinstance(axes, str) else tuple(axes)


def check_param_rules(param_rules: Any, where: str) -> tuple[tuple[str, Names | None], ...]:
    """``param_rules`` checked: ``(regex, logical names tuple | None)`` pairs."""
    example = '((r"kernel$", ("embed", "mlp")), (r"bias$", None))'
    items = ordered_pairs(param_rules, "param_rules", where, example)
    out: list[tuple[str, Names | None]] = []
    for i, rule in enumerate(items):
        ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
        names = rule[1] if ok else None
        if ok and names is not None:
            ok = isinstance(names, (tuple, list)) and all(
                n is None or isinstance(n, str) for n in names
            )
        if not ok:
            raise TypeError(
                f"{where}(param_rules=...): param_rules[{i}] must be a (regex, tuple of "
                f"logical names or None) pair, got {rule!r}. Example: "
                "(r'Dense_\\d+/kernel', ('embed', 'mlp'))."
            )
        check_regex(rule[0], f"param_rules[{i}]", where)
        out.append((rule[0], None if names is None else tuple(names)))
    return tuple(out)


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class LogicalLayout:
    """The layout decision of a `MeshStrategy`: its mesh sizes and rules (private)."""

    sizes: tuple[tuple[str, int], ...]
    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...]
    param_rules: tuple[tuple[str, Names | None], ...]
    min_shard_bytes: int
    max_replicated_fraction: float | None

    def _rule(self, name: str) -> tuple[str, str | tuple[str, ...] | None] | None:
        return next((rule for rule in self.rules if rule[0] == name), None)

    def spec_of(
        self,
        path: str,
        shape: tuple[int, ...],
        names: Names,
        source: str,
        problems: list[str],
        drop: frozenset[str] = frozenset(),
    ) -> P:
        """The spec the logical ``names`` of one leaf map to, without the mesh axes in
        ``drop``; problems appended."""
        sizes = dict(self.sizes)
        what = f"{path} of shape {shape} with logical names {names} ({source})"
        if len(names) != len(shape):
            problems.append(
                f"{what}: {len(names)} names for {len(shape)} dimensions; give one name "
                "(or None) per dimension"
            )
            return P()
        entries: list[Any] = []
        used: dict[str, str] = {}
        for d, name in enumerate(names):
            if name is None:
                entries.append(None)
                continue
            rule = self._rule(name)
            if rule is None:
                problems.append(
                    f"{what}: no rule for the logical name {name!r}; add ({name!r}, "
                    f"<mesh axis>) to shard it, or ({name!r}, None) to replicate it on "
                    "purpose"
                )
                entries.append(None)
                continue
            axes = tuple(a for a in _axes(rule[1]) if a not in drop)
            twice = [a for a in axes if a in used]
            if twice:
                problems.append(
                    f"{what}: rule {rule!r} uses mesh axis {twice[0]!r}, which rule "
                    f"for {used[twice[0]]!r} already uses in this leaf; a mesh axis can "
                    "split one dimension only"
                )
                entries.append(None)
                continue
            count = math.prod(sizes[a] for a in axes)
            if shape[d] % count:
                problems.append(
                    f"{what}: rule {rule!r} splits dimension {d} of size {shape[d]} over "
                    f"{count} devices (mesh {sizes}), which does not divide it; change "
                    "the rule, or pad the dimension"
                )
                entries.append(None)
                continue
            used.update((a, name) for a in axes)
            entries.append(_entry(axes) if axes else None)
        return P(*entries)

    def specs(self, leaves: Sequence[StateLeaf], where: str) -> list[P]:
        """The spec of every leaf; one ``ValueError`` lists every problem."""
        problems: list[str] = []
        compiled = [(re.compile(p), p, names) for p, names in self.param_rules]
        out: list[P | None] = []
        decided: dict[str, tuple[P, tuple[int, ...]]] = {}
        for leaf in leaves:
            shape = tuple(np.shape(leaf.value))
            spec: P | None = None
            if leaf.names is not None:
                spec = self.spec_of(leaf.path, shape, leaf.names, "annotated", problems)
            else:
                for i, (regex, pattern, names) in enumerate(compiled):
                    if regex.search(leaf.path):
                        source = f"param_rules[{i}] {pattern!r}"
                        spec = (
                            P()
                            if not names
                            else self.spec_of(leaf.path, shape, names, source, problems)
                        )
                        break
            if spec is not None and any(spec):
                decided.setdefault(leaf.path, (spec, shape))
                head, _, rest = leaf.path.partition("/")
                if head == "params" and rest:  # a TrainState's: its optimizer state lacks it
                    decided.setdefault(rest, (spec, shape))
            out.append(spec)
        result: list[P] = []
        replicated: list[tuple[int, str, tuple[int, ...]]] = []
        total = 0
        sizes = dict(self.sizes)
        for leaf, spec in zip(leaves, out, strict=True):
            shape = tuple(np.shape(leaf.value))
            size = leaf_bytes(leaf.value)
            if spec is None:
                spec = self._unannotated(leaf.path, shape, size, decided, problems)
            result.append(spec)
            if size is not None:
                total += size
                if not any(sizes[a] > 1 for e in spec for a in _axes(e)):
                    replicated.append((size, leaf.path, shape))
        guard = replicated_problem(replicated, total, self.max_replicated_fraction)
        if guard is not None:
            problems.append(guard)
        if problems:
            raise ValueError(
                f"{where}: cannot lay out the training state on mesh {sizes} "
                f"(rules={self.rules!r}, param_rules={self.param_rules!r}, "
                f"min_shard_bytes={self.min_shard_bytes}):\n  - " + "\n  - ".join(problems)
            )
        return result

    def _unannotated(
        self,
        path: str,
        shape: tuple[int, ...],
        size: int | None,
        decided: dict[str, tuple[P, tuple[int, ...]]],
        problems: list[str],
    ) -> P:
        parts = path.split("/")
        for i in range(1, len(parts)):  # the longest parameter path this one ends with
            found = decided.get("/".join(parts[i:]))
            if found is not None and found[1] == shape:
                return found[0]
        if size is None or not shape or size < self.min_shard_bytes:
            return P()
        problems.append(
            f"{path} of shape {shape} ({size:,} bytes): no logical names (annotate it with "
            "nnx.with_partitioning / nn.with_logical_partitioning) and no param_rules entry "
            f"matches it. Add (r{re.escape(path)!r}, (<one logical name per dimension>)) "
            f"to param_rules, or (r{re.escape(path)!r}, None) to replicate it on purpose"
        )
        return P()


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)
