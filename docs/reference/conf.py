"""Sphinx configuration of the pskv API reference (``python -m sphinx -W docs/reference OUT``).

The pages are built from the docstrings (numpydoc style, read by ``sphinx.ext.napoleon``).
Why Sphinx rather than mkdocs + mkdocstrings: the docstrings are numpydoc, as MXNet's and
NumPy's are, and napoleon reads them as they are; ``nitpicky`` + ``-W`` turns every broken
cross-reference into an error; and one package (``pip install -e '.[docs]'``) is all it
needs, with the built-in theme. No network is needed: there is no intersphinx, so every
cross-reference must resolve inside pskv.
"""
from __future__ import annotations

import sys
from pathlib import Path

# build from this checkout's sources, whatever pskv is installed
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import pskv  # noqa: E402

project = "pskv"
author = "the pskv authors"
copyright = "the pskv authors, Apache-2.0"  # noqa: A001 - Sphinx's name for it
release = pskv.__version__
version = release

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# numpydoc sections only; types stay text (there is no inventory to link numpy's names to)
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_preprocess_types = False

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "groupwise"
# signatures show names and defaults; the types are in each Parameters section
autodoc_typehints = "none"
autoclass_content = "class"

nitpicky = True
# Parameter types in numpydoc sections ("int or str, optional", "sequence of NDArray") are
# prose: only pskv's own classes must resolve there. Every :func:/:meth:/:attr:/:mod: and
# every pskv class reference must resolve.
nitpick_ignore_regex = [("py:class", r"(?!pskv\.).*"),
                        # private bases (``_Momentum``) that show-inheritance names
                        ("py:class", r"pskv(\.\w+)*\._\w+")]

html_theme = "alabaster"
html_title = f"pskv {release}"


def _public_bases(app: object, name: str, obj: object, options: object,
                  bases: list[type]) -> None:
    """Show only public base classes: a private mixin (``pskv.kvstore._tables.TableMethods``)
    is an implementation detail, and its methods are documented on the class itself."""
    bases[:] = [b for b in bases
                if not any(part.startswith("_") for part in b.__module__.split(".")[1:])]


def setup(app: object) -> None:
    app.connect("autodoc-process-bases", _public_bases)  # type: ignore[attr-defined]

