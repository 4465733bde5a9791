"""The shapes a round of calibrations traced (`parametric.calibrate_many`), kept for the rounds after it.

A fit that misses its check point is made again: by batch regime (`parametric._points`: three lengths and a check
at batch 1, lengths at batches 2 and 4), or with its check at its own precision. Half the shapes the second round
asks for are the first round's: two of the batch-1 lengths, the batch-2 shapes and the check point (the batch-2+
regime is laid out to read them), or every shape but the check point. Jamba-v0.1's plan makes three of its four
fits again by regime: 28 traces of 135 shapes, where tracing every round afresh would take 28 of 186.
"""

from __future__ import annotations

import json

from hf_memfit.estimator.warm_up import warm_up_without_a_pass


class TracedShapes:
    """Every shape a calibration traced, by traced step and depths: what a fit made again reads instead of tracing
    it again. A shape's series do not depend on the shapes traced before it on the same model: each starts from the
    same states, with the activations of the one before freed (the fits are those of rounds that trace afresh:
    `tests/test_ssm.py`)."""

    def __init__(self):
        self.shapes: dict[tuple, dict] = {}  # (step, depths) -> {shape: (series, host peak, tensors held at it)}
        self.run: dict[tuple, dict] = {}  # (step, depths) -> the warm-up's host peak, facts and tensors

    @staticmethod
    def _key(plan: dict, depths) -> tuple:
        traced = plan["traced"]
        fields = traced.to_dict()
        if warm_up_without_a_pass(traced):  # the warm-up is the optimizer step alone: no shape of the traced step's
            fields.pop("batch_size"), fields.pop("seq_len")
        return json.dumps(fields, sort_keys=True, default=str), tuple(depths)

    def jobs(self, spec, plans: list[dict]) -> tuple[list[tuple], list[tuple]]:
        """One job per (traced step, depths) with the plans' shapes not traced yet, in the order they first ask
        for them; and each job's key."""
        wanted: dict[tuple, list] = {}
        for plan in plans:
            for depths in plan["depth_sets"]:
                key = self._key(plan, depths)
                new = wanted.setdefault(key, [plan["traced"], depths, []])[2]
                new += [shape for shape in plan["depth_shapes"][tuple(depths)]
                        if shape not in self.shapes.get(key, {}) and shape not in new]
        keys = [key for key, (_, _, shapes) in wanted.items() if shapes]
        return [(spec, wanted[key][0], wanted[key][1], tuple(wanted[key][2])) for key in keys], keys

    def add(self, jobs: list[tuple], keys: list[tuple], summaries: list[dict]) -> None:
        for (_, _, _, shapes), key, summary in zip(jobs, keys, summaries):
            self.run.setdefault(key, {"warm_up_host": summary["host_peaks"][0],
                                      "warm_up_host_held": summary["host_held"][0], "facts": summary["facts"],
                                      "trainable_tensors": summary["trainable_tensors"]})
            self.shapes.setdefault(key, {}).update(zip(shapes, zip(summary["series"], summary["host_peaks"][1:],
                                                                   summary["host_held"][1:])))

    def summary(self, plan: dict, depths) -> dict:
        """`_trace_summary` of the plan's shapes at `depths`, in the plan's order."""
        key = self._key(plan, depths)
        run, shapes, wanted = self.run[key], self.shapes[key], plan["depth_shapes"][tuple(depths)]
        return {"series": [shapes[s][0] for s in wanted],
                "host_peaks": [run["warm_up_host"]] + [shapes[s][1] for s in wanted],
                "host_held": [run["warm_up_host_held"]] + [shapes[s][2] for s in wanted],
                "facts": run["facts"], "trainable_tensors": run["trainable_tensors"]}
