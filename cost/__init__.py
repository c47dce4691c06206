"""The cost model: sympy formulas for compute, communication and memory per rank.

Import this package as `fxpar.cost`; it lives in the repository's top-level `cost/` folder
and is mapped into `fxpar` by setuptools' `package-dir`.
"""

if __name__ != "fxpar.cost":  # pragma: no cover - guards a mis-configured sys.path
    raise ImportError(
        f"the cost package was imported as {__name__!r}; import it as 'fxpar.cost' "
        "(install fxpar with `pip install -e .` instead of adding the repository to sys.path)"
    )
