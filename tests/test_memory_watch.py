"""The machine-memory watch the demo's run record uses: it parses /proc/meminfo's fields,
names the file and field it cannot read, and sees memory a process takes while it runs."""

import time

import pytest

from war_openrlhf.metrics.memory_watch import GIB, MemoryWatch, memory_in_use_bytes


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


def test_the_watch_sees_memory_taken_and_released_while_it_runs():
    with MemoryWatch(interval_s=0.05) as watch:
        time.sleep(0.2)
        block = bytearray(b"\x01") * (768 * 2 ** 20)  # written, so resident
        time.sleep(0.4)
        del block
        time.sleep(0.2)
    s = watch.summary()
    assert s["samples"] >= 8
    assert s["peak_added_gib"] >= 0.5, s  # other work on the machine can add, not hide it
    assert s["peak_gib"] == pytest.approx(s["baseline_gib"] + s["peak_added_gib"], abs=2e-3)
    assert watch.peak >= watch.baseline + 0.5 * GIB


def test_an_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        MemoryWatch(interval_s=0)
