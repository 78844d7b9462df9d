"""Partitioners give TensorFlow's shard counts.

The reference numbers are TF's own tests, case by case: ``PartitionerTest`` in
``tensorflow/python/distribute/sharded_variable_test.py`` (the three
``tf.distribute`` partitioners), and ``PartitionerCreatorsTest`` in
``tensorflow/python/kernel_tests/variables/partitioned_variables_test.py``
(``variable_axis_size_partitioner`` and ``min_max_variable_partitioner``, the
functions `MaxSizePartitioner` and `MinSizePartitioner` call in TF, including
the string case with ``bytes_per_string_element=8``), plus the examples of
TF's API documentation (``axis=1``, ``min_shard_bytes=24``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist as jd
from jaxdist.experimental.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)

# --- TF's sharded_variable_test.py: PartitionerTest --------------------------------------


def test_fixed_shards_partitioner_tf() -> None:
    assert FixedShardsPartitioner(num_shards=2)((10, 3), np.float32) == [2, 1]


def test_min_size_partitioner_tf() -> None:
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [2, 1]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32) == [6, 1]


def test_max_size_partitioner_tf() -> None:
    assert MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32) == [6, 1]
    assert MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [2, 1]
    assert MaxSizePartitioner(max_shard_bytes=1024)((6, 1), np.float32) == [1, 1]


# --- TF's API documentation examples ------------------------------------------------------


def test_documented_examples_tf() -> None:
    fixed = FixedShardsPartitioner(num_shards=2)
    assert fixed((10, 3), np.float32, axis=0) == [2, 1]
    assert fixed((10, 3), np.float32, axis=1) == [1, 2]
    # 10 * 3 * 4 = 120 bytes: 5 shards of 24 bytes, unless max_shards is smaller.
    assert MinSizePartitioner(min_shard_bytes=24, max_shards=4)((10, 3), np.float32) == [4, 1]
    assert MinSizePartitioner(min_shard_bytes=24, max_shards=8)((10, 3), np.float32) == [5, 1]


# --- TF's partitioned_variables_test.py: testFixedSizePartitioner* -----------------------


def test_fixed_shards_like_fixed_size_partitioner_tf() -> None:
    assert FixedShardsPartitioner(5)((10, 10), np.float32) == [5, 1]
    assert FixedShardsPartitioner(4)((20,), np.int64) == [4]


# --- TF's partitioned_variables_test.py: testVariableAxisSizePartitioner -----------------
# Shape (4, 8, 16, 32) float32: a slice is 16384 bytes on axis 0, 8192 on axis 1, 4096 on
# axis 2 and 2048 on axis 3.
_AXIS_SIZE_CASES = [
    # (name, axis, max_shard_bytes, max_shards, expected partitions)
    ("v0", 0, 131072, None, [1, 1, 1, 1]),  # 65536 bytes in all: no need to slice
    ("v1", 1, 65536, None, [1, 1, 1, 1]),  # exactly one shard's worth
    ("v2", 2, 32768, None, [1, 1, 2, 1]),  # 8 slices per shard, 16 slices
    ("v3a", 3, 2048, None, [1, 1, 1, 32]),  # one slice per shard
    ("v3b", 3, 1024, None, [1, 1, 1, 32]),  # a slice is larger than a shard: one each
    ("v3c", 3, 1024, 33, [1, 1, 1, 32]),  # max_shards does not bind
    ("v3d", 3, 1024, 2, [1, 1, 1, 2]),  # max_shards binds
]


@pytest.mark.parametrize(
    ("axis", "max_shard_bytes", "max_shards", "expected"),
    [case[1:] for case in _AXIS_SIZE_CASES],
    ids=[case[0] for case in _AXIS_SIZE_CASES],
)
def test_max_size_partitioner_axis_cases_tf(
    axis: int, max_shard_bytes: int, max_shards: int | None, expected: list[int]
) -> None:
    partitioner = MaxSizePartitioner(max_shard_bytes, max_shards=max_shards)
    assert partitioner((4, 8, 16, 32), np.float32, axis=axis) == expected


@pytest.mark.parametrize("string_dtype", ["string", str, np.str_, np.bytes_, object, "U8"])
def test_max_size_partitioner_strings_tf(string_dtype: Any) -> None:
    # TF: bytes_per_string_element=8, so a slice on axis 3 is 4*8*16*8 = 4096 bytes; 8
    # slices per 32768-byte shard, 32 / 8 = 4 shards.
    partitioner = MaxSizePartitioner(max_shard_bytes=32768, bytes_per_string=8)
    assert partitioner((4, 8, 16, 32), string_dtype, axis=3) == [1, 1, 1, 4]
    # The default estimate of 16 bytes per string doubles the slice: 4 slices per shard.
    assert MaxSizePartitioner(32768)((4, 8, 16, 32), string_dtype, axis=3) == [1, 1, 1, 8]


# --- TF's partitioned_variables_test.py: testMinMaxVariablePartitioner -------------------
_MIN_MAX_CASES = [
    # (name, max_shards, axis, min_shard_bytes, shape, expected partitions)
    ("v0_0", 100, 0, 2 << 10, [2048], [4]),
    ("v0", 100, 0, 256 << 10, [2048, 1024], [32, 1]),
    ("v1_max", 16, 0, 256 << 10, [2048, 1024], [16, 1]),
    ("v2_max", 1, 0, 256 << 10, [2048, 1024], [1, 1]),
    ("v3_slice", 100, 0, 128 << 10, [2048, 1024], [64, 1]),
    ("v4_slice", 100, 0, 512 << 10, [2048, 1024], [16, 1]),
    ("v5_axis", 100, 1, 256 << 10, [64, 1024, 1, 3], [1, 3, 1, 1]),
    ("v6_axis", 100, 3, 256 << 10, [64, 1024, 1, 3], [1, 1, 1, 3]),
    ("v7_shape", 100, 0, 256 << 10, [16, 128, 1024], [16, 1, 1]),
    ("v8_shape", 100, 0, 256 << 10, [4, 512, 1024], [4, 1, 1]),
]


@pytest.mark.parametrize(
    ("max_shards", "axis", "min_shard_bytes", "shape", "expected"),
    [case[1:] for case in _MIN_MAX_CASES],
    ids=[case[0] for case in _MIN_MAX_CASES],
)
def test_min_size_partitioner_min_max_cases_tf(
    max_shards: int, axis: int, min_shard_bytes: int, shape: list[int], expected: list[int]
) -> None:
    partitioner = MinSizePartitioner(min_shard_bytes=min_shard_bytes, max_shards=max_shards)
    assert partitioner(shape, np.float32, axis=axis) == expected


def test_min_size_partitioner_strings() -> None:
    # TF's formula: ceil(elements * bytes_per_string / min_shard_bytes), capped.
    # (6, 2) strings at 8 bytes = 96 bytes: 2 shards of at least 64; as float32 (48 bytes) 1.
    partitioner = MinSizePartitioner(min_shard_bytes=64, max_shards=10, bytes_per_string=8)
    assert partitioner((6, 2), "string") == [2, 1]
    assert partitioner((6, 2), np.float32) == [1, 1]
    # The default 16 bytes per string: 192 bytes, 3 shards.
    assert MinSizePartitioner(min_shard_bytes=64, max_shards=10)((6, 2), object) == [3, 1]


# --- jaxdist: the shapes and dtypes users have in JAX -------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        (6, 1),
        [6, 1],
        np.zeros((6, 1)).shape,
        jnp.zeros((6, 1)).shape,
        jax.ShapeDtypeStruct((6, 1), jnp.float32).shape,
        np.array([6, 1]),
        (np.int64(6), np.int32(1)),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, jnp.float32, np.dtype("float32"), "float32"])
def test_accepts_numpy_and_jax_shapes_and_dtypes(shape: Any, dtype: Any) -> None:
    assert MaxSizePartitioner(max_shard_bytes=8)(shape, dtype) == [3, 1]
    assert MinSizePartitioner(min_shard_bytes=8, max_shards=10)(shape, dtype) == [3, 1]
    assert FixedShardsPartitioner(4)(shape, dtype) == [4, 1]


def test_element_size_follows_the_dtype() -> None:
    partitioner = MinSizePartitioner(min_shard_bytes=16, max_shards=100)
    assert partitioner((64,), jnp.bfloat16) == [8]  # 128 bytes
    assert partitioner((64,), np.float32) == [16]  # 256 bytes
    assert partitioner((64,), np.float64) == [32]  # 512 bytes
    assert partitioner((64,), np.int8) == [4]  # 64 bytes
    assert partitioner((64,), jnp.bool_) == [4]


def test_negative_axis_counts_from_the_end() -> None:
    assert FixedShardsPartitioner(2)((10, 3), np.float32, axis=-1) == [1, 2]
    assert MaxSizePartitioner(2048)((4, 8, 16, 32), np.float32, axis=-1) == [1, 1, 1, 32]


def test_never_more_shards_than_the_dimension() -> None:
    assert FixedShardsPartitioner(8)((3, 5), np.float32) == [3, 1]
    assert MinSizePartitioner(min_shard_bytes=1, max_shards=100)((3, 5), np.float32) == [3, 1]
    assert MaxSizePartitioner(max_shard_bytes=1)((3, 5), np.float32) == [3, 1]


def test_empty_dimensions_get_one_shard() -> None:
    # TF returns 0 shards (fixed) or divides by zero (max size); one empty shard is valid.
    assert FixedShardsPartitioner(2)((0, 3), np.float32) == [1, 1]
    assert MinSizePartitioner(min_shard_bytes=4, max_shards=4)((0, 3), np.float32) == [1, 1]
    assert MaxSizePartitioner(max_shard_bytes=4)((0, 3), np.float32) == [1, 1]
    assert MaxSizePartitioner(max_shard_bytes=4)((5, 0), np.float32) == [1, 1]


def test_float_byte_counts() -> None:
    assert MinSizePartitioner(min_shard_bytes=2.5e1, max_shards=8)((10, 3), np.float32) == [5, 1]
    assert MaxSizePartitioner(max_shard_bytes=12.5)((10, 3), np.float32) == [10, 1]


def test_partitioners_are_immutable_hashable_values() -> None:
    p = MinSizePartitioner(min_shard_bytes=4, max_shards=2)
    assert p == MinSizePartitioner(4, 2) and hash(p) == hash(MinSizePartitioner(4, 2))
    assert p != MinSizePartitioner(4, 3)
    assert repr(p) == "MinSizePartitioner(min_shard_bytes=4, max_shards=2, bytes_per_string=16)"
    with pytest.raises(AttributeError):
        p.max_shards = 3  # type: ignore[misc]
    assert all(
        isinstance(q, Partitioner) for q in (p, FixedShardsPartitioner(1), MaxSizePartitioner(1))
    )
    with pytest.raises(TypeError, match="abstract"):
        Partitioner()  # type: ignore[abstract]


def test_defaults_are_tfs() -> None:
    assert MinSizePartitioner() == MinSizePartitioner(256 << 10, 1, 16)
    assert MaxSizePartitioner(10) == MaxSizePartitioner(10, None, 16)
    # 1 MiB of float32 with the default 256 KiB minimum but max_shards=1: one shard.
    assert MinSizePartitioner()((512, 512), np.float32) == [1, 1]
    assert MinSizePartitioner(max_shards=8)((512, 512), np.float32) == [4, 1]


def test_public_path() -> None:
    assert jd.experimental.partitioners.MinSizePartitioner is MinSizePartitioner
    assert set(jd.experimental.partitioners.__all__) == {
        "FixedShardsPartitioner",
        "MaxSizePartitioner",
        "MinSizePartitioner",
        "Partitioner",
    }


# --- errors: TF's ValueErrors for bad arguments, and jaxdist's for bad calls -------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: MinSizePartitioner(min_shard_bytes=0),
            r"MinSizePartitioner: Argument `min_shard_bytes` must be positive. Received: 0",
        ),
        (
            lambda: MinSizePartitioner(max_shards=0),
            r"MinSizePartitioner: Argument `max_shards` must be positive. Received: 0",
        ),
        (
            lambda: MinSizePartitioner(bytes_per_string=0),
            r"MinSizePartitioner: Argument `bytes_per_string` must be positive. Received: 0",
        ),
        (
            lambda: MaxSizePartitioner(max_shard_bytes=0),
            r"MaxSizePartitioner: Argument `max_shard_bytes` must be positive. Received: 0",
        ),
        (
            lambda: MaxSizePartitioner(max_shard_bytes=0.5),
            r"Argument `max_shard_bytes` must be positive. Received: 0.5",
        ),
        (
            lambda: MaxSizePartitioner(4, max_shards=-1),
            r"MaxSizePartitioner: Argument `max_shards` must be positive. Received: -1",
        ),
        (
            lambda: MaxSizePartitioner(4, max_shards=0),
            r"Argument `max_shards` must be positive. Received: 0",
        ),
        (
            lambda: MaxSizePartitioner(4, bytes_per_string=-2),
            r"MaxSizePartitioner: Argument `bytes_per_string` must be positive. Received: -2",
        ),
        (
            lambda: FixedShardsPartitioner(num_shards=0),
            r"FixedShardsPartitioner: Argument `num_shards` must be positive. Received: 0",
        ),
    ],
)
def test_bad_arguments_raise_value_error(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FixedShardsPartitioner(2.5), r"`num_shards` must be a positive int"),
        (lambda: FixedShardsPartitioner(True), r"`num_shards` must be a positive int"),
        (lambda: MinSizePartitioner(max_shards=None), r"`max_shards` must be a positive int"),
        (lambda: MaxSizePartitioner("1k"), r"`max_shard_bytes` must be a number of bytes"),
    ],
)
def test_bad_argument_types_raise_type_error(make: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        make()


def test_axis_out_of_range() -> None:
    for partitioner in (
        FixedShardsPartitioner(2),
        MinSizePartitioner(4, 2),
        MaxSizePartitioner(4),
    ):
        name = type(partitioner).__name__
        with pytest.raises(
            ValueError,
            match=rf"{name}.__call__: Can not partition variable along axis 2 when shape is "
            r"only \(10, 3\)",
        ):
            partitioner((10, 3), np.float32, axis=2)
        with pytest.raises(ValueError, match=r"along axis 0 when shape is only \(\)"):
            partitioner((), np.float32)


def test_bad_shapes() -> None:
    partitioner = MaxSizePartitioner(4)
    with pytest.raises(ValueError, match=r"shape is not fully defined: \(None, 3\)"):
        partitioner((None, 3), np.float32)
    with pytest.raises(ValueError, match=r"negative dimension: \(-1, 3\)"):
        partitioner((-1, 3), np.float32)
    with pytest.raises(TypeError, match=r"every entry of `shape` must be an int"):
        partitioner((2.5, 3), np.float32)
    with pytest.raises(TypeError, match=r"`shape` must be a tuple or list of ints"):
        partitioner(6, np.float32)
    with pytest.raises(TypeError, match=r"`axis` must be an int"):
        partitioner((6, 1), np.float32, axis=0.0)


def test_bad_dtypes() -> None:
    partitioner = MinSizePartitioner(4, 2)
    with pytest.raises(TypeError, match=r"MinSizePartitioner.__call__: `dtype` must be a NumPy"):
        partitioner((6, 1), "not-a-dtype")
    with pytest.raises(TypeError, match=r"`dtype` is required"):
        partitioner((6, 1), None)
    # FixedShardsPartitioner ignores the dtype, as TF's does.
    assert FixedShardsPartitioner(2)((6, 1), None) == [2, 1]


def test_called_with_keywords_as_tf_strategies_call_them() -> None:
    # TF's ParameterServerStrategy calls `partitioner(shape=shape, dtype=dtype)`.
    for partitioner in (
        FixedShardsPartitioner(2),
        MinSizePartitioner(4, 2),
        MaxSizePartitioner(12),
    ):
        assert partitioner(shape=(6, 1), dtype=np.float32) == [2, 1]
