"""``python -m jax_blocksparse tune`` and the tables "auto" reads on a CPU.

* tune measures this machine's crossovers (a small problem here), keyed by the machine's
  signature (``cpu:<isa>:<cores>``, family the instruction set), and writes the user cache
  (``JAX_BLOCKSPARSE_CACHE_DIR``), which the table in force prefers to the shipped one;
  its progress bar; its argument checks.
* The lookup: this machine's own entry, else the nearest of its family, else the rule
  for unmeasured kernels (on CPU: the kernels below density 0.5, dense above).
* The environment report says which table is in force and where it came from.
"""

from __future__ import annotations

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import kernel_calls, require_kernels
from jax_blocksparse import __main__ as env_report
from jax_blocksparse import crossover, tune
from jax_blocksparse.ops import _lowering


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty user cache of its own."""
    monkeypatch.setenv(crossover.CACHE_ENV, str(tmp_path / "cache"))
    crossover.reset_default_table()
    yield tmp_path / "cache" / crossover.CACHE_FILE
    crossover.reset_default_table()


def test_cpu_device_kind_names_the_isa_and_cores():
    assert crossover.cpu_device_kind("avx2", 8) == "cpu:avx2:8"
    isa = jbs.extension_info().get("cpu_isa") or "unknown"
    assert crossover.cpu_device_kind().startswith(f"cpu:{isa}:")
    assert _lowering.device_kind("cpu") == crossover.cpu_device_kind()


def _e(kind, bs, value, family="avx2", target="jbs_bsmm_fprop"):
    return dict(
        platform="cpu", device_kind=kind, target=target, mode="float32", block_size=bs, crossover=value, family=family
    )


def test_lookup_own_then_nearest_of_the_family_then_none():
    table = crossover.CrossoverTable.from_entries(
        [_e("cpu:avx2:2", 32, 0.4), _e("cpu:avx2:16", 32, 0.9), _e("cpu:avx512:2", 32, 0.2, family="avx512")]
    )

    def find(kind, family):
        return crossover.crossover_for("cpu", kind, "jbs_bsmm_fprop", "float32", 32, family=family, table=table)

    assert find("cpu:avx2:2", "avx2") == 0.4  # its own
    assert find("cpu:avx2:4", "avx2") == 0.4  # nearest core count: 2 (4 from 16: 12)
    assert find("cpu:avx2:12", "avx2") == 0.9
    assert find("cpu:avx512:64", "avx512") == 0.2
    assert find("cpu:baseline:2", "baseline") is None  # nothing of its family
    assert crossover.UNMEASURED["cpu"] == 0.5


def _auto_calls(bs, density, table):
    grid = (8, 8)
    mask = np.zeros(grid, bool)
    mask.flat[: round(density * mask.size)] = True
    lay = jbs.Layout.from_mask(mask, bs)
    x = jnp.ones((4, grid[0] * bs))
    w = jnp.ones(lay.w_shape)
    with jbs.config.implementation("auto"), crossover.use_table(table):
        calls = kernel_calls(jax.jit(lambda x, w: jbs.bsmm(x, w, lay)).lower(x, w).as_text())
    return calls & {"jbs_bsmm_fprop"}  # the dense path calls the conversions of cuda/cpu/bsmm_cpu_dense.cc


def test_unmeasured_cpu_runs_the_kernels_below_half_density():
    require_kernels("cpu")
    empty = crossover.CrossoverTable()
    assert _auto_calls(16, 0.25, empty) == {"jbs_bsmm_fprop"}
    assert _auto_calls(16, 0.75, empty) == set()  # dense above 0.5


def test_tune_writes_the_cache_that_auto_prefers(cache):
    require_kernels("cpu")
    table = tune.tune(
        ["cpu"],
        out=None,
        progress=False,
        shape=(256, 256, 64),
        block_sizes=(32,),
        dtypes=("float32",),
        densities=(1.0, 0.25),
        repeats=1,
        min_time=0.0,
    )
    kind, isa = crossover.cpu_device_kind(), jbs.extension_info()["cpu_isa"]
    mine = [e for e in table.entries if e.device_kind == kind]
    assert sorted(e.target for e in mine) == ["jbs_bsmm_bprop", "jbs_bsmm_fprop", "jbs_bsmm_updat"]
    assert all(e.family == isa and e.block_size == 32 and 0.0 <= e.crossover <= 1.0 for e in mine)
    assert all("W 256 x 256, N = 64" in e.source for e in mine)
    # Density 1 timed at the stated batch, a quarter and a sixty-fourth of it: the batch model's points.
    assert all(e.rows == 64 and [p[0] for p in e.full_density] == [1, 16, 64] for e in mine)
    assert tune.batch_rows(1024) == (1024, 256, 16) and tune.batch_rows(2) == (2, 1)
    # The cache, and the table in force: this machine's entries over the shipped ones.
    on_disk = crossover.load_table(cache)
    assert set(on_disk.entries) == set(table.entries)
    in_force = crossover.default_table()
    assert in_force.lookup("cpu", kind, "jbs_bsmm_fprop", "float32", 32) == on_disk.lookup(
        "cpu", kind, "jbs_bsmm_fprop", "float32", 32
    )
    assert any("this machine's measurements (tune)" in line for line in crossover.table_sources())
    # A second tune keeps the cache's other entries.
    other = crossover.CrossoverTable.from_entries([_e("cpu:avx2:64", 16, 0.3)])
    cache.write_text(json.dumps(crossover.merged(other, on_disk).to_json()))
    crossover.reset_default_table()
    tune.tune(
        ["cpu"],
        progress=False,
        shape=(256, 256, 64),
        block_sizes=(32,),
        dtypes=("float32",),
        densities=(1.0,),
        repeats=1,
        min_time=0.0,
    )
    assert crossover.load_table(cache).lookup("cpu", "cpu:avx2:64", "jbs_bsmm_fprop", "float32", 16) == 0.3
    # The progress bar.
    bar = io.StringIO()
    show = tune.progress_bar(bar, width=10)
    show(3, 6, "fprop float32 bs32")
    show(6, 6, "done")
    assert "[#####-----] 3/6 fprop float32 bs32" in bar.getvalue() and bar.getvalue().endswith("\n")


def test_tune_command_line_checks(cache, capsys):
    with pytest.raises(SystemExit):
        tune.main(["--size", "100", "256", "64"])
    assert "multiples of 128" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--block-sizes", "12"])


def test_report_says_which_table_is_in_force_and_what_the_gate_verified(cache):
    text = env_report.report()
    assert "crossovers in force" in text and "no measurements of this machine yet" in text
    assert "the table shipped with the package" in text
    assert "CUDA kernels verified on hardware" in text and "compute capability 9.0" in text
    assert "ptxas report" in env_report.report(verbose=True)


def test_call_time_statistics():
    f = jax.jit(lambda x: x * 2.0)
    x = jnp.ones((64,))
    fastest = tune.call_time(f, x, repeats=5, min_time=0.0, statistic="min")
    assert 0 < fastest <= tune.call_time(f, x, repeats=5, min_time=0.0) * 10
    with pytest.raises(ValueError, match="statistic must be 'median' or 'min', got 'mean'"):
        tune.call_time(f, x, statistic="mean")


def test_near_ties_are_sampled_again_longer(monkeypatch):
    # The kernel and the dense path within the win margin of each other: noise decides one
    # set of samples, so the product is timed again with more repeats, each side keeping its
    # fastest. Here fprop's first timing ties (1.01) and its second shows the kernel 10%
    # ahead: a win at density 1; bprop wins clearly at once (no second timing); updat ties
    # in both and stays on the dense path.
    require_kernels("cpu")
    calls = []

    def fake_times(op, dense, hopper, a, b, lay, rows, timing):
        calls.append((op, rows, timing["repeats"]))
        if op == "bprop":
            return 1.0, 2.0
        if op == "fprop" and timing["repeats"] > 2:
            return 0.9, 1.0
        return 1.0, 1.01

    monkeypatch.setattr(tune, "_kernel_and_dense_times", fake_times)
    entries = tune.measure(
        "cpu", shape=(64, 64, 4), block_sizes=(32,), dtypes=("float32",), densities=(1.0,), repeats=2, min_time=0.0
    )
    crossovers = {e["target"]: e["crossover"] for e in entries}
    assert crossovers == {"jbs_bsmm_fprop": 1.0, "jbs_bsmm_bprop": 1.0, "jbs_bsmm_updat": 0.0}
    again = tune.NEAR_TIE_REPEATS * 2
    for rows in tune.batch_rows(4):
        assert calls.count(("fprop", rows, 2)) == calls.count(("fprop", rows, again)) == 1
        assert calls.count(("bprop", rows, 2)) == 1 and ("bprop", rows, again) not in calls
        assert calls.count(("updat", rows, again)) == 1


def test_measure_times_only_the_products_asked_for(monkeypatch):
    # bench/tune_sweep.py --ops: one product measured again after a change to its path
    # alone; the package's table keeps the others' entries from the sweep that measured them.
    require_kernels("cpu")
    calls = []

    def fake_times(op, dense, hopper, a, b, lay, rows, timing):
        calls.append(op)
        return 1.0, 2.0

    monkeypatch.setattr(tune, "_kernel_and_dense_times", fake_times)
    options = dict(shape=(64, 64, 4), block_sizes=(32,), dtypes=("float32",), densities=(1.0,), min_time=0.0)
    entries = tune.measure("cpu", ops=("updat",), **options)
    assert [e["target"] for e in entries] == ["jbs_bsmm_updat"] and set(calls) == {"updat"}
    with pytest.raises(ValueError, match=r"ops must be among \('fprop', 'bprop', 'updat'\), got \['wgrad'\]"):
        tune.measure("cpu", ops=("wgrad",), **options)
