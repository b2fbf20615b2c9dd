"""`trtopt check`: one plan on every backend, and against the export it was built from (Polygraphy-style).

runner.run_check drives the workload and returns a CheckReport; driver packs the steps; original runs the export
with past KV; marking adds layer-wise outputs; compare holds the tolerances; backends says what can run here; quantized makes a
quantized plan against its float export a quantization check (trtopt/quantize/sensitivity.py ranks its layers).
"""

from trtopt.check.compare import DEFAULT_TOLERANCES, ErrorStats, QuantStats, QuantTolerance, Tolerance
from trtopt.check.runner import CheckReport, Workload, random_workload, run_check

__all__ = ["DEFAULT_TOLERANCES", "CheckReport", "ErrorStats", "QuantStats", "QuantTolerance", "Tolerance", "Workload",
           "random_workload", "run_check"]
