"""The persistent kernels' work plan (cuda/bsmm_work_plan.h), checked on a CPU.

The Hopper kernels take their tiles and reduction splits from the functions of
bsmm_work_plan.h; the extension binds the same functions for the host
(``_jbs_kernels.work_plan_dsd`` / ``work_plan_sdd``). Here every item list is checked
for the adversarial layouts of tests/gpu: every output tile is written exactly once,
every member of a tile reads exactly its segment's entries in order, every reduction
split covers its range and the splits of a slot partition [0, n). A GPU run then only
has to check the arithmetic.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from helpers import make_mask, require_kernels
from jax_blocksparse import SUPPORTED_BLOCK_SIZES, Layout

BLOCK_SIZES = SUPPORTED_BLOCK_SIZES
KINDS = ("random", "empty", "single", "full", "empty_rows_cols", "long_column", "padded")
ROWS = (0, 1, 7, 129, 1000)


@pytest.fixture(scope="module")
def native():
    require_kernels("cpu")
    from jax_blocksparse import _jbs_kernels

    return _jbs_kernels


def _tables(kind: str, grid=(9, 7), seed: int = 0):
    """Host tables of an adversarial layout ("padded": capacity nnz + 5)."""
    if kind == "long_column":
        grid = (4 * grid[0], grid[1])
    mask = make_mask("random" if kind == "padded" else kind, grid, seed)
    capacity = int(mask.sum()) + 5 if kind == "padded" else None
    layout = Layout.from_mask(mask, 16, capacity=capacity)
    return layout, {name: np.asarray(t).tolist() for name, t in layout.tables._asdict().items()}


def _check_dsd(items, rows, tile_m, seg_ptr, order, pack):
    num_outputs = len(order)
    m_tiles = max(1, -(-rows // tile_m))
    written = collections.Counter()
    first_lengths = []
    for m_tile, _group, row_begin, row_end, members in items:
        assert row_begin == m_tile * tile_m and row_end == min(rows, row_begin + tile_m)
        assert 1 <= len(members) <= pack
        lengths = [seg_ptr[out + 1] - seg_ptr[out] for out, _ in members]
        first_lengths.append(lengths[0])
        for out, entries in members:
            written[(m_tile, out)] += 1
            # The tile runs as many steps as its longest member; a member reads exactly
            # its own entries, in order, then skips (-1).
            assert len(entries) == max(lengths)
            present = [e for e in entries if e >= 0]
            assert present == list(range(seg_ptr[out], seg_ptr[out + 1]))
            assert entries[: len(present)] == present
    assert set(written.values()) <= {1}
    assert set(written) == {(m, o) for m in range(m_tiles) for o in range(num_outputs)}
    # Rows: the tiles of one output partition [0, rows).
    if rows:
        spans = sorted((it[2], it[3]) for it in items if any(o == 0 for o, _ in it[4]))
        assert spans[0][0] == 0 and spans[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # Longest first: items are group-major in `order`, so lengths never grow.
    assert first_lengths == sorted(first_lengths, reverse=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_dsd_plan_covers_every_output_tile_once(native, kind, bs):
    layout, t = _tables(kind)
    pack = native.dsd_pack_for(bs)
    assert pack == max(1, 64 // bs)
    for rows in ROWS:
        for tile_m in (64, 128):
            # fprop: output block columns; bprop: output block rows (transposed tables).
            for seg_ptr, order in ((t["col_ptr"], t["col_order"]), (t["row_ptr"], t["row_order"])):
                items = native.work_plan_dsd(rows, tile_m, seg_ptr, order, pack)
                _check_dsd(items, rows, tile_m, seg_ptr, order, pack)


def test_dsd_entries_never_reach_padding(native):
    layout, t = _tables("padded")
    nnz = t["col_ptr"][-1]
    assert layout.capacity > nnz
    for seg_ptr, order in ((t["col_ptr"], t["col_order"]), (t["row_ptr"], t["row_order"])):
        items = native.work_plan_dsd(300, 128, seg_ptr, order, 4)
        entries = [e for it in items for _, es in it[4] for e in es if e >= 0]
        assert max(entries) < nnz
        assert sorted(set(entries)) == list(range(nnz))


def _stacked_products(items, work, rows):
    """(m_tile, output) -> the sorted (input block, slot) pairs its steps read, from the
    stacked plan's entries and the layout's flat work list."""
    read = {}
    for m_tile, out, row_begin, row_end, steps in items:
        assert (m_tile, out) not in read  # every output tile once
        assert row_begin == m_tile * 128 and row_end == min(rows, row_begin + 128)
        entries = [e for step in steps for e in step]
        present = [e for e in entries if e >= 0]
        # Members read consecutive entries; only the last step has members past the end.
        assert entries[: len(present)] == present
        assert present == (list(range(present[0], present[-1] + 1)) if present else [])
        depth = len(steps[0]) if steps else 1
        assert all(e < 0 for e in entries[len(present) :]) and len(entries) - len(present) < depth
        read[m_tile, out] = sorted((work[2 * e], work[2 * e + 1]) for e in present)
    return read


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bs", (8, 16, 32, 64))
def test_stacked_dsd_plan_reads_each_outputs_blocks_once(native, kind, bs):
    # The stacked variant (cuda/sm90/bsmm_sm90_dsd_stacked.cuh): one output per tile, its
    # work-list entries stacked 64 / bs per step (one at block 64). Each (row tile, output) must read exactly
    # the (input block, slot) pairs of that output's blocks in the layout, each once.
    layout, t = _tables(kind)
    nnz = t["col_ptr"][-1]
    depth = 64 // bs
    rows_of, cols_of = t["block_rows"], t["block_cols"]
    for rows in ROWS:
        for work, ptr, order, num_outputs, out_of, in_of in (
            (t["col_work"], t["col_work_ptr"], t["col_order"], layout.grid[1], cols_of, rows_of),
            (t["row_work"], t["row_work_ptr"], t["row_order"], layout.grid[0], rows_of, cols_of),
        ):
            items = native.work_plan_dsd_stacked(rows, 128, ptr, order, layout.capacity, depth)
            read = _stacked_products(items, work, rows)
            m_tiles = max(1, -(-rows // 128))
            assert set(read) == {(m, o) for m in range(m_tiles) for o in range(num_outputs)}
            for (_, out), pairs in read.items():
                want = sorted((in_of[s], s) for s in range(nnz) if out_of[s] == out)
                assert pairs == want
            # Row-tile-major (a wave shares its rows of the dense operand in L2), and within a
            # row tile longest first: the step counts never grow along the launch order.
            assert [it[0] for it in items] == sorted(it[0] for it in items)
            steps = [len(it[4]) for it in items if it[0] == 0]
            assert steps == sorted(steps, reverse=True)


def test_stacked_dsd_plan_clamps_corrupt_pointers(native):
    # The tables are data: pointers past the capacity, or running backwards, read nothing
    # outside [0, capacity) (the kernel clamps them the same way).
    items = native.work_plan_dsd_stacked(10, 128, [0, 50, 3, -7], [0, 1, 2], 6, 4)
    entries = [e for it in items for step in it[4] for e in step if e >= 0]
    assert entries and max(entries) < 6 and min(entries) >= 0
    with pytest.raises(ValueError, match="order must have"):
        native.work_plan_dsd_stacked(10, 128, [0, 1], [0, 1], 6, 4)


def _check_sdd(plan, capacity, group, n, tile_n, num_sms, bs):
    splits, split_len, items = plan["splits"], plan["split_len"], plan["items"]
    k_tiles = max(1, -(-n // tile_n))
    slot_groups = -(-capacity // group)
    assert split_len % tile_n == 0
    assert 1 <= splits <= k_tiles
    if slot_groups >= 2 * num_sms:
        assert splits == 1
    elif slot_groups:
        # Split until the SMs have two items each, or there are no more k-steps to split.
        assert slot_groups * splits >= 2 * num_sms or splits == k_tiles
    assert plan["workspace_elems"] == (splits * capacity * bs * bs if splits > 1 else 0)
    ranges = collections.defaultdict(list)
    for slot_begin, slot_end, n_begin, n_end, split in items:
        assert 0 <= slot_begin < slot_end <= capacity and slot_end - slot_begin <= group
        assert n_begin % tile_n == 0 and 0 <= n_begin <= n_end <= n
        assert n_begin == min(n, split * split_len)
        for slot in range(slot_begin, slot_end):
            ranges[slot].append((split, n_begin, n_end))
    assert sorted(ranges) == list(range(capacity))
    for rs in ranges.values():
        rs.sort()
        assert [r[0] for r in rs] == list(range(splits))  # every split once
        assert rs[0][1] == 0 and rs[-1][2] == n  # the splits partition [0, n)
        assert all(a[2] == b[1] for a, b in zip(rs, rs[1:]))
        if n:
            assert all(r[2] > r[1] for r in rs)  # no empty split


@pytest.mark.parametrize("kind", KINDS)
def test_sdd_plan_splits_sum_the_full_range(native, kind):
    layout, _ = _tables(kind)
    capacity = layout.capacity
    for bs in BLOCK_SIZES:
        for group in (1, 4, max(1, 64 // bs)):
            for n in (0, 1, 7, 129, 1000, 4096):
                for tile_n in (32, 64):
                    for num_sms in (1, 8, 132):
                        plan = native.work_plan_sdd(capacity, group, n, tile_n, num_sms, bs)
                        _check_sdd(plan, capacity, group, n, tile_n, num_sms, bs)


def test_sdd_splits_only_when_the_slots_leave_sms_idle(native):
    few = native.work_plan_sdd(10, 1, 4096, 64, 132, 128)
    assert few["splits"] > 1 and len(few["items"]) >= 2 * 132
    many = native.work_plan_sdd(400, 1, 4096, 64, 132, 128)
    assert many["splits"] == 1 and many["workspace_elems"] == 0


def test_persistent_grid(native):
    assert native.persistent_grid(0, 132, 1) == 1  # an empty problem still launches to write zeros
    assert native.persistent_grid(50, 132, 1) == 50
    assert native.persistent_grid(10_000, 132, 2) == 264
    # The loop `t = cta; t < items; t += grid` visits every item once.
    items, grid = 1000, native.persistent_grid(1000, 132, 1)
    visited = sorted(t for cta in range(grid) for t in range(cta, items, grid))
    assert visited == list(range(items))


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.work_plan_dsd(-1, 128, [0, 1], [0], 1),
        lambda m: m.work_plan_dsd(10, 0, [0, 1], [0], 1),
        lambda m: m.work_plan_dsd(10, 128, [0, 1], [0, 1], 1),
        lambda m: m.work_plan_dsd(10, 128, [0, 1], [3], 1),
        lambda m: m.work_plan_sdd(4, 0, 10, 64, 132, 64),
        lambda m: m.work_plan_sdd(4, 1, 10, 64, 0, 64),
    ],
)
def test_bad_arguments_raise_value_error(native, call):
    with pytest.raises(ValueError, match="work_plan"):
        call(native)
