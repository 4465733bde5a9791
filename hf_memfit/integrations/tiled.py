"""`apply_tiled_mlp(model)`: ALST's TiledMLP on a model the plan says to tile (`Plan.tiled_mlp`).

TiledMLP is not a `TrainingArguments` field: Arctic Long Sequence Training patches the MLP's forward
in the training script. `MemFitTrainer` does it for its model when the plan says so; a script that
trains with the plain Trainer calls this after loading the model. It runs DeepSpeed's
`deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`, the same code the estimator traces.
"""

from hf_memfit.errors import MemFitError


def apply_tiled_mlp(model) -> int:
    """Compute every layer's dense MLP in sequence shards of about `hidden_size` tokens; returns how many MLPs.

    Needs DeepSpeed (`pip install deepspeed`). Raises `MemFitError` when the model has no dense MLP to tile.
    """
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise MemFitError("the plan tiles the MLPs with DeepSpeed's TiledMLP: `pip install deepspeed`, or plan "
                          "with `--tiled-mlp no`")
    from hf_memfit.estimator.step_levers import tile_mlps

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    tiled = tile_mlps(model, config.hidden_size)
    if not tiled:
        raise MemFitError(f"`{type(model).__name__}` has no per-layer dense `mlp` to tile: plan with `--tiled-mlp no`")
    return tiled
