"""``impl="auto"`` beside the dense product: the crossover table and where it flips.

* bench/crossover.py: crossovers from measured points; the package's table is the one
  computed from the committed results (never edited by hand).
* :mod:`jax_blocksparse.crossover`: the table's checks, lookups, ``use_table``.
* The lowering on the CPU kernels, with a table written for the test: "auto" runs the
  kernels up to the crossover and the dense product above it, with the same values and
  gradients on both sides; a layout that changes within its capacity is not recompiled;
  ``impl="kernels"`` and ``impl="dense"`` are not moved by the table.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import assert_close, cpu_devices, kernel_calls, load_script, rand, require_kernels
from jax_blocksparse.crossover import Crossover, CrossoverTable, prefers_dense, use_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGETS = {"fprop": "jbs_bsmm_fprop", "bprop": "jbs_bsmm_bprop", "updat": "jbs_bsmm_updat"}
BS = 16
GRID = (4, 4)
CROSSOVER = 0.5
# The targets _loss calls (its gradient calls all three).
FORWARD = {TARGETS["fprop"], TARGETS["updat"]}


crossover_script = load_script("bench/crossover.py")


# ---------------------------------------------------------------------------------
# bench/crossover.py
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "points, want",
    [
        ([(1.0, 2.0), (0.5, 3.0), (0.1, 9.0)], 1.0),  # wins everywhere
        ([(1.0, 0.2), (0.5, 0.5), (0.1, 0.9)], 0.0),  # loses everywhere
        ([(0.1, 3.0), (0.25, 1.5), (0.5, 0.5), (1.0, 0.2)], 0.375),  # 1.5 -> 0.5 crosses 1 halfway
        ([(0.1, 2.0), (0.25, 0.9), (0.5, 1.1), (1.0, 0.3)], 0.236),  # the first loss counts
        ([(0.5, 1.0), (1.0, 0.5)], 0.5),  # a tie is no loss
    ],
)
def test_crossover_density(points, want):
    assert crossover_script.crossover_density(points) == pytest.approx(want, abs=1e-3)


def test_the_tables_ask_a_kernel_to_win_by_a_margin():
    # 3% faster or it is no win: closer than that, timing noise decides.
    assert jbs.crossover.WIN_MARGIN == 0.03
    assert crossover_script.crossover_density([(0.5, 1.02), (1.0, 0.5)], 0.03) == 0.0
    assert crossover_script.crossover_density([(0.1, 2.03), (0.5, 1.03), (1.0, 1.01)], 0.03) == pytest.approx(0.5)


def _report(kind, stamp, rows):
    return dict(platform="gpu", device_kind=kind, datetime=stamp, results=rows)


def _row(bs, density, sparse, dense, target="jbs_bsmm_fprop_sm90", mode="bfloat16"):
    return dict(
        op="fprop",
        dtype="bfloat16",
        block_size=bs,
        density=density,
        target=target,
        mode=mode,
        sparse_s=sparse,
        dense_s=dense * 0.9,
        dense_path_s=dense,
    )


def test_table_of_reports_takes_the_newest_measurement_per_kernel():
    old = _report(
        "H",
        "2026-01-01T00:00:00",
        [_row(64, 0.1, 1.0, 2.0), _row(64, 1.0, 4.0, 2.0), _row(32, 0.1, 1.0, 2.0), _row(32, 1.0, 1.0, 2.0)],
    )
    new = _report("H", "2026-02-01T00:00:00", [_row(64, 0.1, 1.0, 3.0), _row(64, 1.0, 1.0, 0.5)])
    no_rows = dict(platform="cpu", device_kind="cpu", results=[dict(op="fprop", sparse_s=1.0)])
    table = crossover_script.table_of([("old.json", old), ("new.json", new), ("x.json", no_rows)])
    got = {(e["block_size"], e["source"]): e["crossover"] for e in table["entries"]}
    # bs 64: 3.0 at 0.1 -> 0.5 at 1.0 crosses 1.03 (the margin) at 0.1 + 1.97 / 2.5 * 0.9;
    # bs 32 only in the old file.
    assert got == {(64, "new.json"): pytest.approx(0.1 + 1.97 / 2.5 * 0.9, abs=1e-3), (32, "old.json"): 1.0}
    assert {e["platform"] for e in table["entries"]} == {"cuda"}
    CrossoverTable.from_json(table)  # the library reads what the script writes


def test_a_sweep_that_stops_at_a_win_and_its_other_batch():
    # tune's rule: from the top, each kernel stops at its first win. Its rows at another batch
    # than the run's (density 1 at smaller ones) give the batch model, not crossover points.
    def timed(bs, density, sparse, dense, batch=64):
        return dict(_row(bs, density, sparse, dense), requested_density=density, batch=batch)

    rows = [timed(64, 1.0, 2.0, 1.0), timed(64, 1.0, 0.2, 0.4, batch=16), timed(64, 0.5, 1.0, 1.0)]
    rows += [timed(64, 0.25, 0.5, 1.0)]  # a win at 0.25: complete
    rows += [timed(32, 1.0, 2.0, 1.0), timed(32, 0.5, 1.5, 1.0)]  # cut short before a win: no entry
    config = dict(densities=[1.0, 0.5, 0.25, 0.1], batch=64, stop_at_win=True)
    report = dict(_report("H", "2026-03-01T00:00:00", rows), config=config)
    (entry,) = crossover_script.table_of([("t.json", report)])["entries"]
    assert entry["block_size"] == 64 and entry["crossover"] == pytest.approx(0.25 + 0.97 / 1.0 * 0.25, abs=1e-3)
    assert entry["rows"] == 64 and entry["full_density"] == [[16, 0.2, 0.4], [64, 2.0, 1.0]]
    # Without stop_at_win the same rows are an incomplete sweep (0.1 was asked for).
    report["config"] = dict(config, stop_at_win=False)
    assert crossover_script.table_of([("t.json", report)])["entries"] == []


def test_a_tune_sweep_report_gives_the_entries_tune_computed(tmp_path):
    require_kernels("cpu")
    sweep = load_script("bench/tune_sweep.py")
    out = tmp_path / "sweep.json"
    argv = ["--size", "256", "256", "64", "--block-sizes", "32", "--dtypes", "float32", "--repeats", "1"]
    report = sweep.main([*argv, "--min-time", "0", "--densities", "1", "0.25", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert {r["batch"] for r in report["results"] if r["requested_density"] == 1.0} == {1, 16, 64}

    def plain(entries):
        return sorted((Crossover(**dict(e, source="")) for e in entries), key=lambda e: e.key)

    assert plain(crossover_script.entries_of(report, "s.json")) == plain(report["crossovers"])
    assert all(e.full_density for e in plain(report["crossovers"]))


def test_the_script_keys_variants_apart_and_writes_their_winners():
    # Three variants of one kernel timed in one report: each gets its own entry
    # ("<target>:<variant>"), and the table says which won where (by the margin over the
    # baseline; a run of densities gives one range).
    def timed(density, sparse, path):
        return dict(_row(16, density, sparse, 2.0), path=path)

    rows = []
    for density, base, stacked in ((0.05, 1.0, 0.5), (0.1, 1.0, 0.6), (0.25, 1.0, 0.99), (0.5, 1.0, 0.8)):
        rows += [timed(density, base, "hopper"), timed(density, stacked, "hopper:stacked")]
    rows.append(dict(_row(16, 0.1, 1.0, 2.0, target="jbs_bsmm_fprop"), path="ampere"))
    table = crossover_script.table_of([("v.json", _report("H", "2026-03-01T00:00:00", rows))])
    assert {e["target"] for e in table["entries"]} == {
        "jbs_bsmm_fprop_sm90",
        "jbs_bsmm_fprop_sm90:stacked",
        "jbs_bsmm_fprop",
    }
    # 0.99 at 0.25 is within the margin: the baseline there, so two ranges.
    assert [(v["variant"], v["low"], v["high"]) for v in table["variants"]] == [
        ("stacked", 0.05, 0.1),
        ("stacked", 0.5, 0.5),
    ]
    loaded = CrossoverTable.from_json(table)
    pick = jbs.crossover.variant_for
    assert pick("cuda", "H", "jbs_bsmm_fprop_sm90", "bfloat16", 16, 0.07, table=loaded) == "stacked"
    assert pick("cuda", "H", "jbs_bsmm_fprop_sm90", "bfloat16", 16, 0.25, table=loaded) is None
    # No variant timed: no "variants" key, the table as before.
    plain = crossover_script.table_of([("p.json", _report("H", "2026-03-01T00:00:00", rows[:1] + rows[2:3]))])
    assert "variants" not in plain


def test_package_table_is_the_one_computed_from_committed_results():
    shipped = json.loads((ROOT / "jax_blocksparse" / "crossovers.json").read_text())
    assert shipped == crossover_script.package_table(), "run: python bench/crossover.py --package"
    assert crossover_script.main(["--package", "--check"]) == 0
    table = CrossoverTable.from_json(shipped)
    assert table == jbs.crossover.default_table()
    for e in table.entries:
        assert (ROOT / e.source).exists(), e.source


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_every_cpu_kernel_has_a_measured_crossover_per_instruction_set(isa):
    """The committed CPU measurements (one machine per instruction set) cover every
    supported block size, float32 and bfloat16, all three ops, keyed by the machine's signature."""
    shipped = crossover_script.package_table()["entries"]
    cpu = [e for e in shipped if e["platform"] == "cpu" and e["family"] == isa]
    assert all(e["device_kind"].startswith(f"cpu:{isa}") for e in cpu)
    got = {(e["target"], e["mode"], e["block_size"]) for e in cpu}
    want = {(t, m, bs) for t in TARGETS.values() for m in ("float32", "bfloat16") for bs in jbs.SUPPORTED_BLOCK_SIZES}
    assert want <= got


# ---------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------


def _entry(**kw):
    base = dict(
        platform="cpu",
        device_kind=jbs.crossover.cpu_device_kind(),
        target="jbs_bsmm_fprop",
        mode="float32",
        block_size=BS,
        crossover=CROSSOVER,
    )
    return {**base, **kw}


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(crossover=1.5), "crossover must be a density"),
        (dict(crossover=float("nan")), "crossover must be a density"),
        (dict(mode="int8"), "mode must be one of"),
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(block_size=True), "block_size must be a positive int"),
        (dict(rows=-1), "rows must be an int >= 0"),
        (dict(rows=64, full_density=((64, 1.0, 1.0),)), "two or more distinct batches"),
        (dict(rows=64, full_density=((16, 1.0, 1.0), (32, 1.0, 1.0))), "rows=64 among them"),
        (dict(rows=64, full_density=((64, 1.0, 1.0), (16, 0.0, 1.0))), r"kernel seconds > 0"),
        (dict(rows=64, full_density=((64, 1.0), (16, 1.0, 1.0))), r"\(rows > 0"),
    ],
)
def test_bad_entries_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        Crossover(**_entry(**bad))


def test_table_checks_and_lookups():
    with pytest.raises(TypeError, match="device_kind must be a str"):
        Crossover(**_entry(device_kind=None))
    with pytest.raises(ValueError, match="more than one entry"):
        CrossoverTable.from_entries([_entry(), _entry(crossover=0.2)])
    with pytest.raises(TypeError, match="Crossover instances"):
        CrossoverTable((_entry(),))
    with pytest.raises(ValueError, match="format 1"):
        CrossoverTable.from_json({"entries": []})
    with pytest.raises(TypeError, match="must be a CrossoverTable"):
        with use_table({"entries": []}):
            pass
    table = CrossoverTable.from_entries([_entry(), _entry(block_size=32, crossover=1.0)])
    assert hash(table) == hash(CrossoverTable.from_json(table.to_json()))
    here = jbs.crossover.cpu_device_kind()
    assert table.lookup("cpu", here, "jbs_bsmm_fprop", "float32", BS) == CROSSOVER
    assert table.lookup("cpu", here, "jbs_bsmm_fprop", "bfloat16", BS) is None
    assert table.lookup("cuda", None, "jbs_bsmm_fprop", "float32", BS) is None
    assert not prefers_dense("cpu", here, "jbs_bsmm_fprop", "float32", BS, CROSSOVER, table)
    assert prefers_dense("cpu", here, "jbs_bsmm_fprop", "float32", BS, CROSSOVER + 0.01, table)
    assert not prefers_dense("cpu", here, "jbs_bsmm_fprop", "float32", 32, 1.0, table)  # wins everywhere
    # Unmeasured: the CPU's rule (the kernels up to density 0.5).
    assert not prefers_dense("cpu", here, "jbs_bsmm_bprop", "float32", BS, 0.5, table)
    assert prefers_dense("cpu", here, "jbs_bsmm_bprop", "float32", BS, 0.51, table)
    assert len(table.for_device("cpu", here)) == 2 and table.for_device("cuda", "x") == ()


# Measured at 1024 rows, density 1: the kernel 10.0 ms, the dense product 9.5 (the dot 9.0 and
# a conversion of 0.5 whatever the batch); at 256 rows 2.5 against 2.75.
BATCHED = dict(rows=1024, full_density=((1024, 0.0100, 0.0095), (256, 0.0025, 0.00275)))


def test_a_crossover_moves_with_the_batch():
    entry = Crossover(**_entry(crossover=0.8, **BATCHED))

    # The dense product's cost per call weighs more at a small batch, less at a large one:
    # ratio(n) = (9 n / 1024 + 0.5) / (10 n / 1024), so the crossover scales by ratio(n) / 0.95.
    def want(n):
        return min(1.0, 0.8 * ((9 * n / 1024 + 0.5) / (10 * n / 1024)) / 0.95)

    for n in (64, 256, 512, 4096, 1 << 20):
        assert entry.at_rows(n) == pytest.approx(want(n), abs=1e-3)
    assert entry.at_rows(64) == 1.0 and entry.at_rows(4096) < 0.8
    assert entry.at_rows(1024) == entry.at_rows(None) == entry.at_rows(0) == 0.8
    # A kernel that won everywhere measured: its ratio at density 1 (1.2) is where it would
    # lose, so a batch that lowers the ratio by less than that keeps the kernel.
    won = Crossover(**_entry(crossover=1.0, rows=1024, full_density=((1024, 0.010, 0.012), (256, 0.0025, 0.0035))))
    assert won.at_rows(1 << 20) == pytest.approx(min(1.0, 1.2 * (12 / 10) / 1.2), abs=1e-3)
    # Without the batch fields, or with a fit that has no cost per row (noise): as measured.
    assert Crossover(**_entry(crossover=0.8)).at_rows(64) == 0.8
    flat = Crossover(**_entry(crossover=0.8, rows=1024, full_density=((1024, 0.001, 0.01), (256, 0.002, 0.01))))
    assert flat.at_rows(64) == 0.8
    # The JSON keeps the batch fields, and only where measured.
    table = CrossoverTable.from_entries([entry, _entry(block_size=32)])
    assert CrossoverTable.from_json(json.loads(json.dumps(table.to_json()))) == table
    plain = [e for e in table.to_json()["entries"] if e["block_size"] == 32][0]
    assert "rows" not in plain and "full_density" not in plain


def _choice(**kw):
    base = dict(
        platform="cuda",
        device_kind="NVIDIA H100 80GB HBM3",
        target="jbs_bsmm_fprop_sm90",
        mode="bfloat16",
        block_size=16,
        variant="stacked",
        low=0.0,
        high=0.25,
        family="9.0",
    )
    return {**base, **kw}


def test_variant_choices_pick_by_density_device_and_family():
    table = CrossoverTable.from_entries([_entry()], [_choice(), _choice(variant="other", low=0.5, high=1.0)])
    assert CrossoverTable.from_json(table.to_json()) == table
    assert "variants" not in CrossoverTable.from_entries([_entry()]).to_json()  # the old format, unchanged
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    args = ("cuda", h100, "jbs_bsmm_fprop_sm90", "bfloat16", 16)
    pick = jbs.crossover.variant_for
    assert pick(*args, 0.1, table=table) == "stacked" and pick(*args, 0.25, table=table) == "stacked"
    assert pick(*args, 0.4, table=table) is None  # no winner there: the baseline
    assert pick(*args, 0.9, table=table) == "other"
    assert pick("cuda", h200, *args[2:], 0.1, table=table) is None  # another device, no family given
    assert pick("cuda", h200, *args[2:], 0.1, family="9.0", table=table) == "stacked"  # same chip family
    assert pick("cuda", h100, "jbs_bsmm_bprop_sm90", "bfloat16", 16, 0.1, table=table) is None
    # A newer table's choices for a kernel replace the older ones whole.
    newer = CrossoverTable.from_entries([], [_choice(variant="third", low=0.0, high=1.0)])
    both = jbs.crossover.merged(newer, table)
    assert pick(*args, 0.9, table=both) == "third" and len(both.variants) == 1


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(low=0.5, high=0.2), "low <= high"),
        (dict(high=1.5), "low <= high"),
        (dict(variant=""), "plain names"),
        (dict(target="jbs_bsmm_fprop_sm90:stacked"), "plain names"),
        (dict(mode="int8"), "mode must be one of"),
        (dict(low="0"), "densities"),
    ],
)
def test_bad_variant_choices_raise(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jbs.crossover.VariantChoice(**_choice(**bad))


def test_overlapping_variant_ranges_raise():
    with pytest.raises(ValueError, match="overlap"):
        CrossoverTable.from_entries([], [_choice(), _choice(variant="other", low=0.2, high=0.6)])


def test_use_table_nests_and_restores():
    a, b = CrossoverTable.from_entries([_entry()]), CrossoverTable()
    default = jbs.crossover.table_in_force()
    with use_table(a):
        assert jbs.crossover.table_in_force() is a
        with use_table(b):
            assert jbs.crossover.table_in_force() is b
        assert jbs.crossover.table_in_force() is a
    assert jbs.crossover.table_in_force() is default


# ---------------------------------------------------------------------------------
# The lowering on the CPU kernels with a test table
# ---------------------------------------------------------------------------------

# Every product of float32 at block 16 flips at density 0.5 on this machine's CPU.
TEST_TABLE = CrossoverTable.from_entries(
    [_entry(target=t) for t in TARGETS.values()] + [_entry(target=t, mode="bfloat16") for t in TARGETS.values()]
)


@pytest.fixture(autouse=True)
def _on_the_cpu_kernels():
    require_kernels("cpu")
    with jax.default_device(cpu_devices(1)[0]):
        yield


def _layout(n_blocks: int, capacity: int, seed: int = 0) -> jbs.Layout:
    """A layout of ``n_blocks`` random blocks of the 4 x 4 grid, stored with ``capacity`` slots."""
    cells = np.random.default_rng(seed).permutation(GRID[0] * GRID[1])[:n_blocks]
    mask = np.zeros(GRID, bool)
    mask.flat[cells] = True
    return jbs.Layout.from_mask(mask, BS, capacity=capacity)


def _loss(impl):
    def loss(x, w, dy, layout):
        y = jbs.bsmm(x, w, layout, impl=impl)
        return jnp.sum(y * dy) + jnp.sum(jbs.bsmm_updat(x, dy, layout, impl=impl) ** 2)

    return loss


def _calls(fun, *args) -> set:
    text = jax.jit(fun).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    return kernel_calls(text) & set(TARGETS.values())


def _args(layout, dtype=jnp.float32):
    c, k = layout.shape
    return rand((6, c), dtype, 1), rand(layout.w_shape, dtype, 2), rand((6, k), dtype, 3), layout


# capacity of 16 blocks -> fraction; at or below 0.5 the kernels, above it the dense product.
@pytest.mark.parametrize("capacity, kernels", [(4, True), (8, True), (9, False), (16, False)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_auto_flips_at_the_crossover_with_equal_values_and_gradients(capacity, kernels, dtype):
    layout = _layout(min(capacity, 6), capacity)
    args = _args(layout, dtype)
    grad = jax.value_and_grad(_loss("auto"), argnums=(0, 1, 2))
    with use_table(TEST_TABLE):
        got_calls = _calls(grad, *args)
        got = jax.jit(grad)(*args)
    assert got_calls == (set(TARGETS.values()) if kernels else set())
    want = jax.jit(jax.value_and_grad(_loss("reference"), argnums=(0, 1, 2)))(*args)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, r, dtype, length=layout.shape[0])


def test_kernels_and_dense_are_not_moved_by_the_table():
    layout = _layout(16, 16)
    args = _args(layout)
    with use_table(TEST_TABLE):
        assert _calls(_loss("kernels"), *args) == FORWARD
        assert _calls(_loss("dense"), *args) == set()
    with use_table(CrossoverTable()):  # an empty table: the kernels below density 0.5, dense above
        assert _calls(_loss("auto"), *args) == set()
        assert _calls(_loss("auto"), *_args(_layout(4, 4))) == FORWARD
        assert _calls(_loss("dense"), *args) == set()
    got = jax.jit(_loss("dense"))(*args)
    assert_close(got, jax.jit(_loss("reference"))(*args), jnp.float32, length=layout.shape[0])


def test_the_table_decides_per_mode_and_block_size():
    """An entry for bfloat16 does not move float32, nor one for block 16 block 32 (those
    keep the rule for unmeasured kernels: the kernels at a quarter density)."""
    always_dense = [_entry(target=t, crossover=0.0) for t in TARGETS.values()]
    only_bf16 = CrossoverTable.from_entries([dict(e, mode="bfloat16") for e in always_dense])
    layout = _layout(4, 4)  # a quarter of the grid
    with use_table(only_bf16):
        assert _calls(_loss("auto"), *_args(layout, jnp.float32)) == FORWARD
        assert _calls(_loss("auto"), *_args(layout, jnp.bfloat16)) == set()
    big = jbs.Layout.from_mask(np.eye(4, dtype=bool), 32)  # block 32, a quarter of the grid
    with use_table(CrossoverTable.from_entries(always_dense)):
        assert _calls(_loss("auto"), *_args(layout)) == set()
        assert _calls(_loss("auto"), *_args(big)) == FORWARD


def test_auto_decides_per_batch():
    """The same layout at density 1 runs the kernel for a small batch and the dense product
    for a large one, where the entry's density-1 times say so."""
    here = jbs.crossover.cpu_device_kind()
    table = CrossoverTable.from_entries([_entry(crossover=0.8, **BATCHED)])
    layout = _layout(16, 16)
    x, w = rand((64, layout.shape[0]), jnp.float32, 1), rand(layout.w_shape, jnp.float32, 2)
    with use_table(table):
        assert prefers_dense("cpu", here, "jbs_bsmm_fprop", "float32", BS, 1.0, rows=4096)
        assert not prefers_dense("cpu", here, "jbs_bsmm_fprop", "float32", BS, 1.0, rows=64)
        small = jax.jit(lambda x, w: jbs.bsmm(x, w, layout)).trace(x, w).lower(lowering_platforms=("cpu",))
        big = jax.jit(lambda x, w: jbs.bsmm(x, w, layout)).trace(jnp.tile(x, (64, 1)), w)
        big = big.lower(lowering_platforms=("cpu",))
        assert kernel_calls(small.as_text()) & {TARGETS["fprop"]}
        assert not kernel_calls(big.as_text()) & {TARGETS["fprop"]}
        # A batch in leading dims counts as its product.
        lead = jax.jit(lambda x, w: jbs.bsmm(x, w, layout)).trace(jnp.tile(x, (64, 1)).reshape(64, 64, -1), w)
        assert not kernel_calls(lead.lower(lowering_platforms=("cpu",)).as_text()) & {TARGETS["fprop"]}


@pytest.mark.parametrize("capacity", [6, 12])  # one below the crossover, one above
def test_a_layout_changing_within_its_capacity_is_not_recompiled(capacity):
    traces = []

    def loss(x, w, dy, layout):
        traces.append(1)
        return _loss("auto")(x, w, dy, layout)

    step = jax.jit(jax.grad(loss, argnums=1))
    first, second = _layout(3, capacity, seed=0), _layout(5, capacity, seed=1)
    assert not np.array_equal(np.asarray(first.mask), np.asarray(second.mask))
    with use_table(TEST_TABLE):
        g1 = step(*_args(first))
        g2 = step(*_args(second))
    assert len(traces) == 1 and step._cache_size() == 1
    for layout, g in ((first, g1), (second, g2)):
        want = jax.grad(_loss("reference"), argnums=1)(*_args(layout))
        assert_close(g, want, jnp.float32, length=layout.shape[0])


def test_the_table_in_force_is_part_of_the_jit_key():
    layout = _layout(16, 16)
    f = jax.jit(_loss("auto"))
    args = _args(layout)
    with use_table(TEST_TABLE):
        a = f(*args)
    with use_table(CrossoverTable()):
        b = f(*args)
    assert f._cache_size() == 2
    assert_close(a, b, jnp.float32, length=layout.shape[0])


def test_cuda_cross_lowering_without_a_gpu_has_no_device_to_look_up():
    from jax_blocksparse.ops import _lowering

    assert _lowering.device_kind("cpu") == jbs.crossover.cpu_device_kind()
    if not jax.devices()[0].platform == "gpu":
        assert _lowering.device_kind("cuda") is None


def test_the_report_prints_the_crossovers_in_force():
    from jax_blocksparse.__main__ import crossover_lines

    lines = crossover_lines(TEST_TABLE)
    assert any("jbs_bsmm_updat" in line and "bs16 0.50" in line for line in lines), lines
    assert any("none measured" in line for line in crossover_lines(CrossoverTable())), lines
