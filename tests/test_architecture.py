"""The package's shape: the layers of docs/architecture.md hold, modules stay small, old paths still work."""

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_memfit"
REPO = PACKAGE.parent

# "One concept per module, about 500 lines at most" (issue 20); no module may grow past this without a split.
MAX_MODULE_LINES = 620


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed")
def test_the_layer_contract_holds():
    """`lint-imports` checks pyproject.toml's contract: no layer imports one above it (the import graph of
    every module, function-level imports included)."""
    run = subprocess.run(["lint-imports"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def test_no_module_is_too_long():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules: {long}"


def test_old_module_paths_alias_the_new_modules_with_a_warning():
    code = ("import warnings\n"
            "warnings.simplefilter('error', DeprecationWarning)\n"
            "import hf_memfit\n"
            "try:\n"
            "    import hf_memfit.planner_search_does_not_exist\n"
            "except ImportError:\n"
            "    pass\n"
            "try:\n"
            "    import hf_memfit.trainer\n"
            "except DeprecationWarning as exc:\n"
            "    print('warned:', exc)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert "warned: `hf_memfit.trainer` moved to `hf_memfit.integrations.trainer`" in run.stdout, run.stderr[-2000:]

    from hf_memfit import _moved

    for old, new in _moved.MOVED.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sys.modules.pop(old, None)
            module = __import__(old, fromlist=["_"])
        assert module is sys.modules[new], old
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old


def test_the_public_api_is_where_it_was():
    import hf_memfit
    from hf_memfit.estimator import estimate
    from hf_memfit.planner import plan

    assert hf_memfit.estimate is estimate and callable(hf_memfit.estimate)
    assert hf_memfit.plan is plan and callable(hf_memfit.plan)
    from hf_memfit.cli import main  # the console script `hf-memfit = hf_memfit.cli:main`

    assert callable(main)


def test_no_import_cycles():
    """No module imports itself through others, function-level imports included (grimp: import-linter's graph)."""
    import grimp

    graph = grimp.build_graph("hf_memfit", cache_dir=None)
    modules = sorted(graph.modules)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(imported) == 1:
                cycles.append(path[path.index(imported):] + [imported])
            elif imported not in state:
                visit(imported, path + [imported])
        state[module] = 2

    for module in modules:
        if module not in state:
            visit(module, [module])
    # Not cycles of code: a package's __init__ re-exporting its own modules, and a script's
    # `if __name__ == "__main__"` importing itself under its package name (integrations/recipe.py).
    real = [c for c in cycles if len(c) > 2
            and not any(a.startswith(b + ".") or b.startswith(a + ".") for a, b in zip(c, c[1:]))]
    assert not real, real
