"""The recipes `nmt prep` ships: the `*.toml` files in this directory, installed as the
package `nmt.recipes` (pyproject.toml's package-dir).

A package only so that the TOML files travel as package data in a wheel or a non-editable
`pip install .`; nmt.data.recipes reads them through importlib.resources. No code lives here.
"""
