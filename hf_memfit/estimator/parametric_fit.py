"""The algebra of the parametric fit (`parametric.py`): terms, least squares, depth by depth, and the check.

A region's bytes at one clock, category by category, are a polynomial in the micro-batch b and the
sequence length s with the terms of `TERMS`; these functions solve for its coefficients from the
traced points, prune the clocks that can never be a region's maximum, and measure the fit's miss at
the held-out check point. Imports numpy (and the trace's region names) only when called.
"""

from __future__ import annotations

from hf_memfit.estimator.breakdown import CATEGORIES

#: The terms of the fit, as (batch power, seq power): 1, s, s^2, b*s, b*s^2.
TERMS = ((0, 0), (0, 1), (0, 2), (1, 1), (1, 2))
#: The terms a fit at one micro-batch size can tell apart (a batch-1 regime: `parametric._points`). Its
#: coefficients are stored as TERMS' with the batch terms zero, so everything downstream reads one shape.
TERMS_IN_SEQ = ((0, 0), (0, 1), (0, 2))


def _term(b: int, s: int, term: tuple[int, int]) -> float:
    return float(b) ** term[0] * float(s) ** term[1]


def _value(coefficients: list[float], b: int, s: int) -> int:
    return max(0, int(round(sum(c * _term(b, s, t) for c, t in zip(coefficients, TERMS)))))


def _matrix(points, terms=None):
    import numpy as np

    terms = terms or TERMS  # read when called: a test fits fewer terms
    return np.array([[_term(b, s, t) for t in terms] for b, s, *_ in points])


def _solve_all(points, values, terms=None):
    """Coefficients of TERMS through the points for every column of `values` (points x ...) at once, solved
    for `terms` (the first len(terms) points determine them) and zero for the rest of TERMS."""
    import numpy as np

    terms = terms or TERMS
    n = len(terms)
    matrix = _matrix(points[:n], terms)
    scale = np.abs(matrix).max(axis=0)  # s^2 is ~1e7 at the points: scale the columns before solving
    solved = np.linalg.solve(matrix / scale, values.reshape(n, -1)) / scale[:, None]
    out = np.zeros((len(TERMS),) + solved.shape[1:])
    out[[TERMS.index(t) for t in terms]] = solved
    return out.reshape((len(TERMS),) + values.shape[1:])


def _fit_depth(point_series: list[dict], points, terms=None) -> dict:
    """Coefficients (terms x clocks x categories) per region class at one traced depth.

    The same step runs the same ops at every shape, so the k-th clock of a region is the same moment
    of the step at every point: each clock is fitted on its own, and the region's maximum is taken over
    the fitted clocks where it is asked for (it moves from clock to clock with the shape: eager
    attention's probabilities outgrow the MLP's intermediates as the sequence grows). A region whose
    clocks do not line up across points (a loop over chunks of the sequence) is fitted by its maxima.
    The first micro-batch's regions ("1.0|...") and the optimizer step are solved from the fit points;
    a later micro-batch's ("1.1|...") are the first one's plus a constant per category, read at the
    last fit point (the first with two micro-batches).
    """
    import numpy as np

    terms = terms or TERMS
    n = len(terms)
    fit_points = point_series[:n]
    out = {}
    for region in set.intersection(*(set(p) for p in fit_points)):
        if len({p[region].shape for p in fit_points}) == 1:
            out[region] = _solve_all(points, np.stack([p[region] for p in fit_points]), terms)
        else:
            out[region] = _fit_depth_maxima(point_series, points, region, terms)
    at = fit_points[n - 1]
    b, s = points[n - 1][:2]
    row = np.array([_term(b, s, t) for t in TERMS])
    for region in at:
        first = "1.0|" + region[4:]
        if region.startswith("1.1|") and first in out:
            out[region] = later_micro_batch(out[first], at[region], at.get(first),
                                            lambda coefficients: np.einsum("t,tlk->lk", row, coefficients))
    return out


def later_micro_batch(first, seen, seen_first, at):
    """A later micro-batch's region as coefficients: the first micro-batch's (`first`: terms x clocks x categories,
    the constant term first), clock by clock, plus what is live beside each clock at the traced shape where both
    ran (`seen`, and the first one's clocks there, `seen_first`); `at(coefficients)` evaluates them at that shape.
    Where the clocks cannot be matched (the first region fitted by its maxima, or no op in common), the first
    one's clocks shifted by the difference of the maxima."""
    aligned = seen_first is not None and len(seen_first) == first.shape[1]  # not fitted by its maxima
    same = _matching_clocks(seen, seen_first) if aligned else None
    if same is None:
        predicted = at(first)
        shifted = first.copy()
        shifted[0] += seen[seen.sum(axis=1).argmax()] - predicted[predicted.sum(axis=1).argmax()]
    else:
        shifted = first[:, same].copy()
        shifted[0] += seen - at(shifted)
    return shifted


def _matching_clocks(later, first) -> list[int] | None:
    """For each clock of a later micro-batch's region, the clock of the first micro-batch's that is the same
    moment of the step, both read at one shape: a later micro-batch runs the same ops with the gradients
    already live, plus a few of its own (accumulating a gradient into the one that is there). The ops are
    matched by what each does to the live bytes (the change from one clock to the next, category by
    category); a clock of its own reads as the last matched one before it. None when no op matches."""
    import difflib

    def changes(values):
        return [tuple(row) for row in (values[1:] - values[:-1]).astype(int).tolist()]

    ops_later, ops_first = changes(later), changes(first)
    matcher = difflib.SequenceMatcher(None, ops_later, ops_first, autojunk=False)
    blocks = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            blocks[block.a + k] = block.b + k
    if not blocks and len(ops_later):
        return None
    same, at = [0] * len(later), 0  # clock 0 is the region's entry
    for clock in range(1, len(later)):
        if clock - 1 in blocks:
            at = blocks[clock - 1] + 1
        same[clock] = at
    return same


def _fit_depth_maxima(point_series: list[dict], points, region: str, terms=None):
    """A region fitted by its maximum at each point (one clock): for clocks that do not line up."""
    import numpy as np

    terms = terms or TERMS
    n = len(terms)
    maxima = np.stack([p[region][p[region].sum(axis=1).argmax()] for p in point_series[:n]])[:, None, :]
    return _solve_all(points, maxima, terms)


def _as_maxima(coefficients, points, terms=None):
    """A clock-by-clock fit refitted by its maximum at each fit point (one clock): for depths whose clocks differ."""
    import numpy as np

    terms = terms or TERMS
    n = len(terms)
    at = np.einsum("pt,tlk->plk", _matrix(points[:n]), coefficients)
    maxima = np.stack([at[p][at[p].sum(axis=1).argmax()] for p in range(n)])[:, None, :]
    return _solve_all(points, maxima, terms)


def _batch_regimes_differ(series, points) -> bool:
    """Whether some region's clocks line up among the fit points at batch 1 and among those at batch 2 or
    more, but not between the two: the step runs other ops at batch 1 (a reshape that is a view there and a
    copy from batch 2 on: `parametric._points`), so the two are different polynomials."""
    n = len(TERMS)
    single = [i for i, p in enumerate(points[:n]) if p[0] == 1]
    many = [i for i, p in enumerate(points[:n]) if p[0] > 1]
    if not single or not many:
        return False
    for classes in series:
        for region in set.intersection(*(set(classes[i]) for i in range(n))):
            shapes_single = {classes[i][region].shape for i in single}
            shapes_many = {classes[i][region].shape for i in many}
            if len(shapes_single) == 1 and len(shapes_many) == 1 and shapes_single != shapes_many:
                return True
    return False


#: Where the fitted clocks are compared to keep only those that can be a region's maximum: micro-batches
#: 1-256 and sequences of 64-1M tokens, by factors of 2 (what the planner and users ask for).
_GRID = tuple((b, s) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) for s in (2 ** k for k in range(6, 21)))


def _prune(coefficients) -> list[dict[str, list[float]]]:
    """The region's clocks that are its maximum somewhere on `_GRID`, as {category: coefficients}."""
    import numpy as np

    totals = coefficients.sum(axis=2)  # terms x clocks
    keep = sorted(set(np.argmax(_matrix(_GRID) @ totals, axis=1).tolist()))
    return [{k: [float(c) for c in coefficients[:, clock, i]] for i, k in enumerate(CATEGORIES)} for clock in keep]


def _check(series, fitted, points) -> tuple[float, str]:
    """The fit's largest miss at the held-out point, relative to the step's peak there, and where."""
    import numpy as np

    b, s = points[-1][:2]
    row = np.array([_term(b, s, t) for t in TERMS])
    worst, where = 0.0, ""
    for classes, fit in zip(series, fitted):
        seen = classes[-1]
        peak = max(float(v.sum(axis=1).max()) for v in seen.values())
        for region, values in seen.items():
            if region not in fit:
                continue
            predicted = float(np.einsum("t,tlk->l", row, fit[region]).max())
            miss = abs(predicted - float(values.sum(axis=1).max())) / max(peak, 1.0)
            if miss > worst:
                worst, where = miss, region
    return worst, where


def _point_series(trace, count: int, period: int | None = None) -> list[dict]:
    """Per point (traced step 1..count): region class -> live bytes by category at each of its clocks.

    Rows are the region's entry and every allocation and release in it, by final category (a gradient
    made in backward counts as a gradient). The step index is normalised to 1, as exact mode names
    its steady-state step; the optimizer step is one region whatever the micro-batches before it.
    `period`: the layers at each end of a stack that stand for it in a reduced copy (`regions.py`).
    """
    import numpy as np

    from hf_memfit.estimator.regions import depth_of, region_class

    tracker = trace.tracker
    index = {k: i for i, k in enumerate(CATEGORIES)}
    categories = [index[a.category] for a in tracker.allocations]
    rows: dict[str, list] = {}
    totals = [0] * len(CATEGORIES)
    events, e = tracker.events, 0
    starts = tracker.region_starts
    for j, (clock, region) in enumerate(starts):
        end = starts[j + 1][0] if j + 1 < len(starts) else len(events)
        while e < clock:  # event e happens at clock e + 1
            signed, nbytes = events[e]
            totals[categories[abs(signed) - 1]] += nbytes if signed > 0 else -nbytes
            e += 1
        keep = "|" in region and not region.startswith("0.")
        out = rows.setdefault(region, []) if keep else None
        if keep:
            out.append(tuple(totals))
        while e < end:
            signed, nbytes = events[e]
            totals[categories[abs(signed) - 1]] += nbytes if signed > 0 else -nbytes
            e += 1
            if keep:
                out.append(tuple(totals))
    _copy_repeated_optimizer_steps(rows, trace.repeated_optimizer_steps)
    points = [{} for _ in range(count)]
    for region, values in rows.items():
        step, rest = region.split(".", 1)
        name = "1.0|opt" if rest.endswith("|opt") else "1." + rest
        stack = name.split("|")[-1].split(".")[0]
        for cls in region_class(name, depth_of(stack, trace.stack_depths or trace.depths), period):
            points[int(step) - 1][cls] = np.array(values, dtype=float)
    return points


def _copy_repeated_optimizer_steps(rows: dict[str, list], repeated: list[int]) -> None:
    """The optimizer step of each step in `repeated` (not run: `trace._step_repeats`) as the first shape's, each
    clock moved by what was live at the step's start beyond what was at the first one's (by category)."""
    if not repeated:
        return
    step_of = {region.split(".", 1)[0]: region for region in rows if region.endswith("|opt")}
    first = rows[step_of["1"]]
    for step in repeated:
        region = step_of[str(step)]
        moved = [now - then for now, then in zip(rows[region][0], first[0])]
        rows[region] = [tuple(value + by for value, by in zip(row, moved)) for row in first]
