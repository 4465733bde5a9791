"""The plan: the fastest settings whose estimate fits the budget, and the configs that run them.

`search` walks the settings grid and explains its choice (`explain`), timing each candidate with `speed`;
`deepspeed` and `accelerate` write the DeepSpeed JSON and the accelerate / FSDP settings a plan needs.
"""

from hf_memfit.planner.result import Plan, PlanResult
from hf_memfit.planner.search import plan

__all__ = ["Plan", "PlanResult", "plan"]
