"""Reports: estimates, plans and timelines as text (`text`) and as a picture (`plot`). Nothing here computes."""

from hf_memfit.report.text import format_estimate, format_plan, format_timeline

__all__ = ["format_estimate", "format_plan", "format_timeline"]
