"""Reporting shared by benchmarks and training runs."""

from .report import (command_line, format_table, git_commit, machine_info, provenance, read_json, spread,
                     timed_call, timer_overhead_us, write_json)

__all__ = ["command_line", "format_table", "git_commit", "machine_info", "provenance", "read_json", "spread", "timed_call",
           "timer_overhead_us", "write_json"]
