"""The machine-memory watch the demo's run record uses: it parses /proc/meminfo's fields,
names the file and field it cannot read, and keeps the peak its thread sampled. (A real
allocation is not the test: the kernel's figures lag by up to a second, and on the virtual
machines tried a 768 MiB block moved MemAvailable by anything from 0.15 to 0.7 GiB while the
suite ran, so a test-sized block is not reliably seen.)"""

import time

import pytest

from war_openrlhf.metrics.memory_watch import MemoryWatch, memory_in_use_bytes


def test_memory_in_use_is_total_less_available(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert memory_in_use_bytes(f) == 4000000 * 1024


@pytest.mark.parametrize("text, expected", [
    ("MemTotal: 100 kB\n", "no MemAvailable field"),
    ("MemFree: 1 kB\n", "no MemTotal or MemAvailable field"),
    ("MemTotal: 100 kB\nMemAvailable: lots\n", "field MemAvailable is 'lots'"),
])
def test_an_unreadable_meminfo_names_its_file_and_field(tmp_path, text, expected):
    f = tmp_path / "meminfo"
    f.write_text(text)
    with pytest.raises(ValueError) as exc:
        memory_in_use_bytes(f)
    assert str(f) in str(exc.value) and expected in str(exc.value)


def _meminfo(path, used_kib, total_kib=24_000_000):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"MemTotal: {total_kib} kB\nMemFree: 1 kB\nMemAvailable: {total_kib - used_kib} kB\n")
    tmp.replace(path)  # the watch's thread never reads half a file


def test_the_watch_keeps_the_peak_its_thread_saw_and_the_baseline_before(tmp_path):
    """The thread samples on its own: a rise that lasts a few intervals and falls again before
    the job ends is the peak; the baseline is the first sample."""
    f = tmp_path / "meminfo"
    _meminfo(f, 1_000_000)
    with MemoryWatch(interval_s=0.02, meminfo=f) as watch:
        time.sleep(0.1)
        _meminfo(f, 3_000_000)
        time.sleep(0.2)
        _meminfo(f, 1_500_000)
        time.sleep(0.1)
    s = watch.summary()
    assert watch.baseline == 1_000_000 * 1024 and watch.peak == 3_000_000 * 1024
    assert s["peak_added_gib"] == pytest.approx(2_000_000 / 2**20, abs=1e-3) and s["samples"] >= 10


def test_the_watch_reads_this_machine():
    with MemoryWatch(interval_s=0.05) as watch:
        time.sleep(0.2)
    s = watch.summary()
    assert 0 < s["baseline_gib"] <= s["peak_gib"] and s["samples"] >= 3


def test_an_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        MemoryWatch(interval_s=0)
