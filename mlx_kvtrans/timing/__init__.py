"""Timing a switch: time to first token after a switch against re-reading, beside its bound.

- `switch.py`: `bench_switch` (its options a `BenchConfig`), the measurements (warm, cold and
  gated switches, re-reading, the bound), the gated switch being `session.receive_span` itself;
- `shaped.py`: a translator of a fit's shapes with random weights, for timing;
- `report.py`: `switch_report`, the result `kvtrans bench` prints and writes.
"""

from .report import report_table, switch_report, write_report
from .shaped import shaped_translator
from .switch import BenchConfig, BenchRow, bench_switch, cache_nbytes, translation_flops

__all__ = ["BenchConfig", "BenchRow", "bench_switch", "cache_nbytes", "report_table",
           "shaped_translator", "switch_report", "translation_flops", "write_report"]
