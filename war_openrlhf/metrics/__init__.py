"""Reporting shared by benchmarks and training runs."""

from .report import format_table, machine_info, write_json

__all__ = ["format_table", "machine_info", "write_json"]
