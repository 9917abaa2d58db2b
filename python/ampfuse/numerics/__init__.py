"""The numerics watch: which dtype each layer's ops ran in and how close their values came to
fp16's range (``watch(model)``); see ``ampfuse.numerics.watch``."""

from ampfuse.numerics.watch import Flag, Report, Row, Watch, format_rows, watch

__all__ = ["watch", "Watch", "Row", "Report", "Flag", "format_rows"]
