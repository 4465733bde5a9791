"""What was alive at the peak of a CUDA caching-allocator snapshot, grouped by where it was allocated.

`hf-memfit check --memory-snapshot FILE` records the allocator's history of a run
(`torch.cuda.memory._record_memory_history`; pytorch.org/memory_viz draws the pickle). memory_viz shows it;
this reads it: it replays the history's `alloc` / `free_completed` events (the allocator's own order, in
`device_traces`), finds the moment the live bytes peak, and lists the blocks alive then by the Python line
that allocated them. That is what a prediction that is off needs: which tensors the GPU held that the
estimate did not (docs/benchmarks.md section 19).

Blocks allocated before the recording began (cuBLAS's workspaces) have no `alloc` event: the ones still
alive at the end are read from the snapshot's segments, the ones freed on the way from their `free_completed`
events, and both are counted as `before the recording` until freed.
"""

from __future__ import annotations

import gzip
import pickle

# The frames that name an allocation: the innermost outside torch's own Python (autograd, nn.Module
# plumbing, the checkpoint machinery), which is where a model or a library asked for the tensor.
_PLUMBING = ("torch/nn/modules/module.py", "torch/autograd/", "torch/utils/checkpoint.py", "torch/_tensor.py",
             "torch/utils/_contextlib.py", "torch/amp/", "torch/_dynamo/", "torch/overrides.py")


def load_snapshot(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def peak_blocks(snapshot: dict, *, device: int = 0, top: int = 25) -> dict:
    """The live bytes at the history's peak, the blocks alive then grouped by allocating line, and the events
    just before it (which phase of the step peaked)."""
    trace = snapshot["device_traces"][device]
    # A free of an address nothing in the history allocated (as yet: addresses are reused) is a block from
    # before the recording, and so is a block alive at the end that the history did not allocate.
    live: dict[int, dict] = {}
    early_freed = 0
    for e in trace:
        if e["action"] == "free_completed" and e["addr"] not in live:
            early_freed += e["size"]
        _delta(e, live)
    before = early_freed + sum(block["size"] for block in _blocks(snapshot, device)
                               if block["state"] == "active_allocated" and block.get("address") not in live)

    total, peak, peak_index = before, before, -1
    live.clear()
    for index, e in enumerate(trace):
        total += _delta(e, live)
        if total > peak:
            peak, peak_index = total, index
    live.clear()
    before_left = before
    for e in trace[:peak_index + 1]:
        if e["action"] == "free_completed" and e["addr"] not in live:
            before_left -= e["size"]
        _delta(e, live)
    groups: dict[str, list[int]] = {}
    for e in live.values():
        entry = groups.setdefault(allocation_site(e.get("frames") or []), [0, 0])
        entry[0] += e["size"]
        entry[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    recent = [{"action": e["action"], "size": e["size"], "site": allocation_site(e.get("frames") or [])}
              for e in trace[max(0, peak_index - 12):peak_index + 1] if e["action"] in ("alloc", "free_completed")]
    return {
        "peak_live_bytes": peak,
        "before_recording_bytes": before_left,
        "events": len(trace),
        "peak_event": peak_index,
        "groups": [{"site": site, "bytes": size, "blocks": count} for site, (size, count) in ranked[:top]],
        "other_bytes": sum(size for _, (size, _) in ranked[top:]),
        "events_before_peak": recent,
    }


def allocation_site(frames: list[dict]) -> str:
    """`file.py:line function` of the innermost frame outside torch's plumbing (frames are innermost first)."""
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if not any(part in filename for part in _PLUMBING) and filename not in ("??", ""):
            short = filename.split("site-packages/")[-1]
            return f"{short}:{frame.get('line', 0)} {frame.get('name', '')}"
    return frames[0].get("name", "?") if frames else "(no stack)"


def _delta(event: dict, live: dict[int, dict]) -> int:
    if event["action"] == "alloc":
        live[event["addr"]] = event
        return event["size"]
    if event["action"] == "free_completed":
        if event["addr"] in live:
            return -live.pop(event["addr"])["size"]
        return -event["size"]  # allocated before the recording (counted in `before`)
    return 0


def _blocks(snapshot: dict, device: int):
    """The segments' blocks of `device`, each with its address (older snapshots give only the segment's)."""
    for segment in snapshot.get("segments", []):
        if segment.get("device", device) != device:
            continue
        address = segment.get("address")
        for block in segment.get("blocks", []):
            if "address" not in block and address is not None:
                block = dict(block, address=address)
            yield block
            if address is not None:
                address += block["size"]
