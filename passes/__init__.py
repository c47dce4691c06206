"""Graph passes: each rewrites or annotates the global graph under a written contract.

Import this package as `fxpar.passes`; it lives in the repository's top-level `passes/`
folder and is mapped into `fxpar` by setuptools' `package-dir`.
"""

if __name__ != "fxpar.passes":  # pragma: no cover - guards a mis-configured sys.path
    raise ImportError(
        f"the passes package was imported as {__name__!r}; import it as 'fxpar.passes' "
        "(install fxpar with `pip install -e .` instead of adding the repository to sys.path)"
    )
