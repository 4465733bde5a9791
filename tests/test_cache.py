"""The calibration cache: keys that cover what a value depends on, checked reads, atomic writes, the CLI."""

import json
import multiprocessing

import pytest
from conftest import TINY_QWEN3

from hf_memfit import cache
from hf_memfit.cli import main


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_an_entry_reads_back(cache_root):
    key = cache.config_key({"model_type": "x"}, {"seq_len": 8})
    cache.write_cache("fits", key, {"a": [1, 2]})
    assert cache.read_cache("fits", key) == {"a": [1, 2]}
    assert cache.cache_entries() == {"fits": 1}


def test_the_key_covers_the_config_the_libraries_and_the_code(cache_root, monkeypatch):
    base = cache.config_key({"model_type": "x"})
    assert cache.config_key({"model_type": "y"}) != base
    assert cache.config_key({"model_type": "x"}, "extra") != base
    monkeypatch.setattr(cache, "library_versions", lambda: {"torch": "9.9"})
    assert cache.config_key({"model_type": "x"}) != base
    monkeypatch.undo()
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(cache_root))
    monkeypatch.setattr(cache, "code_version", lambda: "edited")
    assert cache.config_key({"model_type": "x"}) != base


def test_the_code_version_follows_the_estimator_sources():
    assert len(cache.code_version()) == 16
    assert cache.library_version("torch").startswith("2.")
    assert cache.library_version("no_such_library_here") == "not installed"


@pytest.mark.parametrize("damage", ["truncate", "edit_value", "other_key", "not_json", "wrong_kind"])
def test_a_damaged_entry_is_never_trusted(cache_root, damage):
    key = cache.config_key({"model_type": "x"})
    cache.write_cache("fits", key, {"peak": 123})
    path = cache.entry_path("fits", key)
    text = path.read_text()
    entry = json.loads(text)
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
    elif damage == "edit_value":
        entry["value"]["peak"] = 1
        path.write_text(json.dumps(entry))
    elif damage == "other_key":
        entry["key"] = "0" * 24
        path.write_text(json.dumps(entry))
    elif damage == "not_json":
        path.write_bytes(b"\x00\xff")
    else:
        entry["kind"] = "specs"
        path.write_text(json.dumps(entry))
    assert cache.read_cache("fits", key) is None
    cache.write_cache("fits", key, {"peak": 123})  # what the caller does next: recompute, overwrite
    assert cache.read_cache("fits", key) == {"peak": 123}


def _writer(root: str, n: int) -> None:
    import os

    os.environ["HF_MEMFIT_CACHE"] = root
    from hf_memfit import cache as c

    for _ in range(n):
        c.write_cache("fits", "k" * 24, {"rows": list(range(2000))})


def test_concurrent_writers_never_leave_half_a_file(cache_root):
    """Two processes writing the same entry while a third reads: every read sees a whole, valid entry."""
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(str(cache_root), 60)) for _ in range(2)]
    for w in writers:
        w.start()
    seen = 0
    while any(w.is_alive() for w in writers):
        value = cache.read_cache("fits", "k" * 24)
        if value is not None:
            assert value == {"rows": list(range(2000))}
            seen += 1
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert cache.read_cache("fits", "k" * 24) == {"rows": list(range(2000))}
    assert not list((cache_root / "fits").glob(".*.tmp"))  # no temporary file left behind


def test_cache_cli_info_warm_clear(cache_root, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_QWEN3))
    assert main(["cache", "warm", str(config)]) == 0
    out = capsys.readouterr().out
    assert "calibration(s) made" in out and "done in" in out
    made = cache.cache_entries()
    assert made.get("specs") == 1 and made.get("calibrations", 0) + made.get("parametric", 0) >= 1
    assert main(["cache", "warm", str(config)]) == 0  # all cached now
    assert "0 calibration(s) made" in capsys.readouterr().out
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(cache_root) in out and "transformers" in out and "specs 1" in out
    assert main(["cache", "clear"]) == 0
    assert cache.cache_entries() in ({}, {"calibrations": 0, "specs": 0}, {"parametric": 0, "specs": 0},
                                     {"calibrations": 0, "parametric": 0, "specs": 0})


def test_cache_cli_bad_input_is_one_line(cache_root, capsys):
    assert main(["cache", "warm", "no/such-model-anywhere"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-memfit: error:") and err.count("\n") == 1
    assert main(["cache"]) == 2
    assert main(["cache", "warm", "gpt2"]) == 0  # hand-written: nothing to calibrate, and it says so
    assert "hand-written formulas, nothing to calibrate" in capsys.readouterr().out
