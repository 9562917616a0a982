"""Reporting shared by benchmarks and training runs."""

from .report import command_line, format_table, git_commit, machine_info, provenance, read_json, spread, write_json

__all__ = ["command_line", "format_table", "git_commit", "machine_info", "provenance", "read_json", "spread", "write_json"]
