"""The order of a main stack traced by kinds (`models/depths.py`): each layer's kind from its per-layer config
lists, the traced copy's order, and that order written into a config. Apart from depths.py so that
`generic.py`, which checks that a config builds such an order as given, needs nothing that imports the spec."""

from __future__ import annotations


def kinds(lists: dict[str, list]) -> list[tuple]:
    """Each layer's kind: its values in the per-layer lists."""
    return list(zip(*lists.values()))


def distinct(kinds: list[tuple]) -> list[tuple]:
    """The kinds in the order the stack first has them."""
    return list(dict.fromkeys(kinds))


def main_order(kinds: list[tuple], counts: dict[tuple, int]) -> list[tuple]:
    """A main stack with `counts` layers of each kind (two or more each), in an order whose ends stand for the real
    stack's: one layer of each kind at each end, the real first and last layers' kinds first and last, and the
    layers past two of a kind in the middle, so a grown copy adds its layer where no region class reads it.
    Gemma-3 (sliding S, global G; the real stack starts and ends with S): [S, G, G, S], grown [S, G, S, G, S]."""
    order = distinct(kinds)
    first, last = kinds[0], kinds[-1]
    head = [first] + [kind for kind in order if kind != first]
    tail = [kind for kind in reversed(order) if kind != last] + [last]
    middle = [kind for kind in order for _ in range(counts[kind] - 2)]
    return head + middle + tail


def write_order(config: dict, depth_key: str, lists: dict[str, list] | list[str], order: list[tuple]) -> dict:
    """Set each per-layer list named in `lists` to its values in `order`, in the dict that holds the stack's depth
    key (`text_config.num_hidden_layers`: the text config); returns that dict."""
    *parents, _ = depth_key.split(".")
    holder = config
    for part in parents:
        holder = holder[part]
    for i, name in enumerate(lists):
        holder[name] = [kind[i] for kind in order]
    return holder
