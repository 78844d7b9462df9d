"""The HLO reading helpers of ``tests/_hlo.py``, on literal HLO of both XLA spellings.

The module texts below are the collectives of one program (jaxdist's
hierarchical all-reduce of an 8x6 float32 `PerReplica` on a ``(host=2,
local=4)`` mesh) as jax 0.10.2 prints them (explicit replica groups) and as
jax 0.12.0.1 prints them (mesh axes), trimmed of metadata. Expected groups are
written out by hand.
"""

from __future__ import annotations

import pytest

from _hlo import (
    Collective,
    bytes_across,
    collectives,
    group_sets,
    lowered_count,
    mesh_groups,
    replica_groups,
    shape_bytes,
)

HEADER = "HloModule jit_step, is_scheduled=true, num_partitions=8\n\nENTRY %main (p: f32[1,6]) {\n"
EXPLICIT = HEADER + (
    "  %reduce_scatter.7 = f32[2]{0} reduce-scatter(%bitcast_pad_fusion), channel_id=1, "
    "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, "
    "to_apply=%region_0.1\n"
    "  %psum_invariant.7 = f32[2]{0} all-reduce(%reduce_scatter.7), channel_id=1, "
    "replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, "
    "to_apply=%region_1.2\n"
    "  %all_gather_invariant.7 = f32[4,2]{1,0} all-gather(%bitcast.1), channel_id=1, "
    "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true\n"
    "}\n"
)
MESH_AXES = HEADER + (
    "  %reduce_scatter.7 = f32[2]{0} reduce-scatter(%bitcast_pad_fusion), channel_id=1, "
    "replica_groups=mesh['host'=2,'local'=4] {'local'}, use_global_device_ids=true, "
    "dimensions={0}, to_apply=%region_0.1\n"
    "  %psum_invariant.7 = f32[2]{0} all-reduce(%reduce_scatter.7), channel_id=1, "
    "replica_groups=mesh['host'=2,'local'=4] {'host'}, use_global_device_ids=true, "
    "to_apply=%region_1.2\n"
    "  %all_gather_invariant.7 = f32[4,2]{1,0} all-gather(%bitcast.1), channel_id=1, "
    "replica_groups=mesh['host'=2,'local'=4] {'local'}, dimensions={0}, "
    "use_global_device_ids=true\n"
    "}\n"
)
IOTA = HEADER + (
    "  %rs = f32[2]{0} reduce-scatter(%p), replica_groups=[2,4]<=[8], dimensions={0}\n"
    "  %ar = f32[2]{0} all-reduce(%rs), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add\n"
    "  ROOT %ag = f32[4,2]{1,0} all-gather(%ar), replica_groups=[2,4]<=[8], dimensions={0}\n"
    "}\n"
)
INSIDE = ((0, 1, 2, 3), (4, 5, 6, 7))
ACROSS = ((0, 4), (1, 5), (2, 6), (3, 7))
MESH = {"host": 2, "local": 4}


@pytest.mark.parametrize(
    ("spelling", "groups"),
    [
        ("{{0,1,2,3},{4,5,6,7}}", INSIDE),
        ("{{0,4},{1,5},{2,6},{3,7}}", ACROSS),
        ("{{0,4,1,5,2,6,3,7}}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
        ("[2,4]<=[8]", INSIDE),
        ("[4,2]<=[2,4]T(1,0)", ACROSS),
        ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("mesh['host'=2,'local'=4] {'local'}", INSIDE),
        ("mesh['host'=2,'local'=4] {'host'}", ACROSS),
        ("mesh['host'=2,'local'=4] {'host','local'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        # the axes' order is the order inside each group (jax 0.10 printed the same
        # psum over ("local", "host") as {{0,4,1,5,2,6,3,7}})
        ("mesh['host'=2,'local'=4] {'local','host'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
        ("mesh[host=2,local=4] {local}", INSIDE),  # XLA's own printer, without quotes
        # a psum over ("x", "z") of a 2x2x2 mesh: jax 0.10 printed {{0,1,4,5},{2,3,6,7}}
        ("mesh['x'=2,'y'=2,'z'=2] {'x','z'}", ((0, 1, 4, 5), (2, 3, 6, 7))),
        ("mesh['x'=2,'y'=4] {}", tuple((d,) for d in range(8))),
        # one process of a (host, local) mesh: jax 0.10 printed {{0},{1},...,{7}}
        ("mesh['host'=1,'local'=8] {'host'}", tuple((d,) for d in range(8))),
        ("mesh['host'=1,'local'=8] {'local'}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
        ("mesh['x'=8] {'x':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
        ("mesh['x'=8] {'x':(1)2,'x':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
        ("mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'b'}", ((3, 2), (1, 0))),
        ("mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ],
)
def test_replica_groups_reads_every_spelling(spelling: str, groups: tuple[tuple[int, ...]]) -> None:
    assert replica_groups(spelling) == groups


def test_empty_replica_groups_mean_every_device() -> None:
    assert replica_groups("{}", num_devices=4) == ((0, 1, 2, 3),)
    with pytest.raises(ValueError, match=r"replica_groups=\{\} means every device"):
        replica_groups("{}")


@pytest.mark.parametrize(
    ("spelling", "message"),
    [
        ("groups<0,1>", r"unknown replica_groups spelling 'groups<0,1>'"),
        ("{{0,1},2}", r"unknown replica_groups spelling '\{\{0,1\},2\}'"),
        ("mesh['a'=2] {'b'}", r"unknown axis 'b' in mesh\['a'=2\] \{'b'\} \(mesh axes \['a'\]"),
        ("mesh['a'=2,'b'=2], device_ids=(0,1,2) {'a'}", r"3 device ids for mesh sizes \[2, 2\]"),
        ("mesh['x'=8] {'x':(1)4,'x':(2)2}", r"sub-axes of 'x'"),
    ],
)
def test_unknown_spellings_fail_loudly(spelling: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replica_groups(spelling)


@pytest.mark.parametrize("hlo", [EXPLICIT, MESH_AXES, IOTA], ids=["explicit", "mesh", "iota"])
def test_collectives_read_the_same_program_in_every_spelling(hlo: str) -> None:
    found = collectives(hlo)
    assert [c.opcode for c in found] == ["reduce-scatter", "all-reduce", "all-gather"]
    assert [c.groups for c in found] == [INSIDE, ACROSS, INSIDE]
    assert [c.shape for c in found] == ["f32[2]{0}", "f32[2]{0}", "f32[4,2]{1,0}"]
    # reduce-scatter of 8 floats, all-reduce of the 2-float shard, all-gather of it
    assert [c.payload_bytes for c in found] == [32, 8, 8]
    assert [c.spans(MESH, "host") for c in found] == [False, True, False]
    assert [c.spans(MESH, "local") for c in found] == [True, False, True]
    assert bytes_across(hlo, MESH, "host") == 8
    assert bytes_across(hlo, MESH, "local") == 40
    assert group_sets(hlo, "all-reduce") == [mesh_groups(MESH, over=("host",))]
    assert group_sets(hlo, "reduce-scatter") == [mesh_groups(MESH, over=("local",))]
    assert [c.name for c in collectives(hlo, "all-gather")] == [found[2].name]
    assert collectives(hlo, "all-to-all") == []


def test_combined_async_and_empty_group_collectives() -> None:
    hlo = HEADER + (
        "  %all-reduce = (f32[1]{0}, f32[2]{0}, f32[3]{0}, f32[1]{0}, f32[2]{0}, "
        "/*index=5*/f32[3]{0}) all-reduce(%b0, %b1, %b2, %b3, %b4, /*index=5*/%b5), "
        "channel_id=1, replica_groups={}, use_global_device_ids=true, to_apply=%add\n"
        "  %ars = f32[4]{0} all-reduce-start(%p), replica_groups=[1,8]<=[8], to_apply=%add\n"
        "  %ard = f32[4]{0} all-reduce-done(%ars)\n"
        "  %ags = (f32[1,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%ard), "
        "replica_groups=mesh['host'=2,'local'=4] {'host','local'}, dimensions={0}\n"
        "  %agd = f32[8,4]{1,0} all-gather-done(%ags)\n"
        "  %gte = f32[1]{0} get-tuple-element(%all-reduce), index=0\n"
        "}\n"
    )
    found = collectives(hlo)
    assert [(c.opcode, c.asynchronous) for c in found] == [
        ("all-reduce", False),
        ("all-reduce", True),
        ("all-gather", True),
    ]
    combined, started, gathered = found
    assert combined.groups == ((0, 1, 2, 3, 4, 5, 6, 7),)  # {}: every device of the module
    assert combined.payload_bytes == 4 * (1 + 2 + 3 + 1 + 2 + 3)
    assert (started.payload_bytes, gathered.payload_bytes) == (16, 16)
    assert bytes_across(hlo, MESH, "host") == 48 + 16 + 16


def test_a_collective_line_it_cannot_read_fails() -> None:
    with pytest.raises(ValueError, match=r"unknown replica_groups spelling at 'groups<0,1>"):
        collectives(HEADER + "  %x = f32[2]{0} all-reduce(%p), replica_groups=groups<0,1>\n")
    with pytest.raises(ValueError, match=r"cannot read the collective instruction"):
        collectives("  all-reduce(%p) with no result\n")
    with pytest.raises(ValueError, match=r"opcode must be one of"):
        collectives(EXPLICIT, "allreduce")


@pytest.mark.parametrize(
    ("shape", "size"),
    [
        ("f32[4,2]{1,0}", 32),
        ("bf16[3]{0}", 6),
        ("pred[]", 1),
        ("s4[3]{0}", 2),
        ("f8e4m3fn[5]{0}", 5),
        ("(f32[2]{0}, (s32[1]{0}, c64[1]{0}))", 20),
        ("f32[<=4,2]{1,0}", 32),
    ],
)
def test_shape_bytes(shape: str, size: int) -> None:
    assert shape_bytes(shape) == size


def test_shape_bytes_and_mesh_groups_refuse_what_they_do_not_know() -> None:
    with pytest.raises(ValueError, match=r"unknown element type 'q7' in shape 'q7\[2\]'"):
        shape_bytes("q7[2]")
    with pytest.raises(ValueError, match=r"mesh_groups: \['hosts'\] are not axes of the mesh"):
        mesh_groups(MESH, over=("hosts",))
    c = Collective("x", "all-reduce", "f32[2]{0}", ACROSS)
    with pytest.raises(ValueError, match=r"axis 'rack' is not an axis of the mesh"):
        c.spans(MESH, "rack")


def test_mesh_groups_number_devices_row_major() -> None:
    assert mesh_groups(MESH, over=("local",)) == frozenset(map(frozenset, INSIDE))
    assert mesh_groups(MESH, over=("host",)) == frozenset(map(frozenset, ACROSS))
    assert mesh_groups(MESH, over=("host", "local")) == {frozenset(range(8))}
    assert mesh_groups({"replica": 8}, over=()) == {frozenset({d}) for d in range(8)}


def test_lowered_count_reads_both_stablehlo_forms() -> None:
    text = (
        '%2 = "stablehlo.all_reduce"(%1) <{replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}>\n'
        "%3 = stablehlo.all_gather %2, dim = 0\n"
        '%4 = "stablehlo.all_reduce"(%3) <{replica_groups = #stablehlo.replica_group_mesh_axes<'
        'mesh = @mesh_0, axes = [#stablehlo.axis_ref<name = "local">]>}>\n'
    )
    assert lowered_count(text, "all_reduce") == 2
    assert lowered_count(text, "all_gather") == 1
    assert lowered_count(text, "reduce_scatter") == 0
