"""The caching-allocator simulator on the GPU snapshots' own events: where cudaMalloc puts a new segment.

Each snapshot's alloc/free events (benchmarks/results/gpu_h100/*.pickle.gz, gpu_h200_2/*.pickle.gz) are replayed
through `CachingAllocatorSimulator` with its segments rebuilt as they stood when recording began, three ways: new
segments above every earlier one (ascending, the simulator's default), below (descending), and at the real
addresses the snapshot's `segment_alloc` events give. Measured max reserved is the sum of the snapshot's segments
(no segment is ever freed in these runs). docs/benchmarks.md section 21 records the table. Written by a helper
session as a probe and kept as it ran (2026-11-27).

    python benchmarks/snapshot_address_order.py      # -> stdout, one JSON line per snapshot
"""
import glob
import gzip
import json
import os
import pickle
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)
from hf_memfit.estimator.cuda_overhead import CachingAllocatorSimulator, _Block, round_allocation, K_SMALL_SIZE

MiB = 2**20

class Sim(CachingAllocatorSimulator):
    """mode: 'asc' (repo default: each new segment above all), 'desc' (each new segment below all),
    'gpu' (the real cudaMalloc addresses from the trace's segment_alloc events, in order)."""
    def __init__(self, mode, lo, hi, gpu_addrs=None):
        super().__init__()
        self.mode = mode; self._next_addr = hi; self._top = lo
        self._gpu = list(gpu_addrs or []); self.seg_log = []
    def _alloc_segment(self, alloc_size, small):
        if self.mode == 'asc':
            addr = self._next_addr; self._next_addr += alloc_size
        elif self.mode == 'desc':
            self._top -= alloc_size; addr = self._top
        else:
            addr, sz = self._gpu.pop(0) if self._gpu else (1 << 62, None)
            if sz is not None and sz != alloc_size:
                self.seg_log.append(('size mismatch', alloc_size, sz))
        self.seg_log.append((addr, alloc_size))
        b = _Block(addr, alloc_size, small)
        self._reserved += alloc_size; self.num_segments += 1
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        return b

    def add_existing_segment(self, addr, total, small, live_blocks):
        """live_blocks: sorted [(addr, block_size, requested, key)] inside the segment."""
        pieces = []; cur = addr
        for a, bs, req, key in live_blocks:
            assert a >= cur, (hex(a), hex(cur))
            if a > cur: pieces.append((cur, a - cur, None))
            pieces.append((a, bs, (req, key))); cur = a + bs
        if cur < addr + total: pieces.append((cur, addr + total - cur, None))
        assert cur <= addr + total
        prev = None
        for a, sz, live in pieces:
            b = _Block(a, sz, small, prev=prev)
            if prev is not None: prev.next = b
            prev = b
            if live:
                b.allocated = True; b.requested = live[0]
                self._live[live[1]] = b; self._allocated += sz; self._requested += live[0]
        b = prev
        while b is not None:
            if not b.allocated: self._insert_free(b)
            b = b.prev
        self._reserved += total; self.num_segments += 1
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        self._peak_allocated = max(self._peak_allocated, self._allocated)


def analyse(path):
    s = pickle.load(gzip.open(path))
    t = s['device_traces'][0]
    segs = s['segments']
    traced_seg = [(e['addr'], e['size']) for e in t if e['action'] == 'segment_alloc']
    traced_addrs = {a for a, _ in traced_seg}
    pre_segs = [sg for sg in segs if sg['address'] not in traced_addrs]
    # final block map (addr -> block) for block sizes
    final_blocks = {}
    for sg in segs:
        for b in sg['blocks']:
            final_blocks[b['address']] = (b, sg)
    # walk the trace: events, and allocations that predate it
    live = {}; n = 0; ev = []; pre_live = {}  # addr -> (requested, key)
    for e in t:
        a = e['action']
        if a == 'alloc':
            n += 1; live[e['addr']] = n; ev.append((n, e['size']))
        elif a == 'free_completed':
            if e['addr'] in live:
                ev.append((-live.pop(e['addr']), e['size']))
            else:
                key = ('pre', e['addr']); pre_live[e['addr']] = (e['size'], key); ev.append((key, e['size']))
    for sg in segs:
        for b in sg['blocks']:
            if b['state'].startswith('active') and b['address'] not in live and b['address'] not in pre_live:
                pre_live[b['address']] = (b['requested_size'], ('pre', b['address']))
    # assign pre-existing live blocks to segments
    seg_of = lambda a: next((sg for sg in segs if sg['address'] <= a < sg['address'] + sg['total_size']), None)
    pre_by_seg = {}; orphan = []
    for a, (req, key) in pre_live.items():
        sg = seg_of(a)
        if sg is None or sg['address'] in traced_addrs:
            orphan.append((hex(a), req, None if sg is None else 'in traced seg')); continue
        # block size: final snapshot block size if same address is still a block start with same requested; else rounding
        fb = final_blocks.get(a)
        if fb and fb[0]['state'].startswith('active') and fb[0]['requested_size'] == req:
            bs = fb[0]['size']
        else:
            bs = round_allocation(req)
            small = sg['segment_type'] == 'small'
            rem = sg['address'] + sg['total_size'] - (a + bs)
            if not small and rem <= K_SMALL_SIZE: bs += rem  # unsplit tail (approx)
        pre_by_seg.setdefault(sg['address'], []).append((a, bs, req, key))
    info = dict(
        name=os.path.basename(path).replace('.pickle.gz', ''), n_events=len(t),
        n_segs=len(segs), n_traced_segs=len(traced_seg),
        pre_segs=[(hex(sg['address']), sg['total_size'], sg['segment_type'],
                   [(hex(a), bs, req) for a, bs, req, _ in sorted(pre_by_seg.get(sg['address'], []))]) for sg in pre_segs],
        n_pre_live=len(pre_live), orphans=orphan, final_reserved=sum(sg['total_size'] for sg in segs),
        first_event=t[0]['action'])
    allsegs_addrs = [sg['address'] for sg in segs]
    lo = min(allsegs_addrs + list(traced_addrs)); hi = max(sg['address'] + sg['total_size'] for sg in segs)
    pre_lo = min([sg['address'] for sg in pre_segs], default=1 << 47)
    pre_hi = max([sg['address'] + sg['total_size'] for sg in pre_segs], default=1 << 47)
    res = {}
    for mode in ('asc', 'desc', 'gpu'):
        sim = Sim(mode, lo=pre_lo, hi=pre_hi, gpu_addrs=traced_seg)
        for sg in sorted(pre_segs, key=lambda x: x['address']):
            sim.add_existing_segment(sg['address'], sg['total_size'], sg['segment_type'] == 'small',
                                     sorted(pre_by_seg.get(sg['address'], [])))
        sim._peak_reserved = sim._reserved
        for k, b in ev:
            if isinstance(k, tuple): sim.free(k)
            elif k > 0: sim.malloc(k, b)
            else: sim.free(-k)
        mism = [x for x in sim.seg_log if x[0] == 'size mismatch']
        res[mode] = dict(peak_reserved=sim.peak_reserved_bytes, peak_alloc=sim.peak_allocated_bytes,
                         nseg_new=len(sim.seg_log) - len(mism), mismatches=len(mism))
    # real-address ordering of traced segments
    addrs = [a for a, _ in traced_seg]
    below_all = sum(1 for i in range(1, len(addrs)) if addrs[i] < min(addrs[:i]))
    above_all = sum(1 for i in range(1, len(addrs)) if addrs[i] > max(addrs[:i]))
    below_prev = sum(1 for i in range(1, len(addrs)) if addrs[i] < addrs[i - 1])
    info['addr_order'] = dict(n=len(addrs) - 1, below_all_prev=below_all, above_all_prev=above_all, below_prev=below_prev)
    info['pre_vs_new'] = dict(pre_lo=hex(pre_lo), pre_hi=hex(pre_hi), new_min=hex(min(addrs)) if addrs else None, new_max=hex(max(addrs)) if addrs else None)
    info['res'] = res
    return info

if __name__ == '__main__':
    files = sys.argv[1:] or (sorted(glob.glob('benchmarks/results/gpu_h100/*.pickle.gz')) + sorted(glob.glob('benchmarks/results/gpu_h200_2/*.pickle.gz')))
    out = []
    for f in files:
        info = analyse(f); out.append(info)
        print(json.dumps(info), flush=True)
    json.dump(out, open('/tmp/addr_probe/results.json', 'w'), indent=1)
