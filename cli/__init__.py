"""The `nmt` command-line interface: one small Typer module per subcommand.

The folder is cli/ at the repository's top level and installs as `nmt.cli`
(pyproject.toml's package-dir), so that the wheel adds no top-level `cli` to
site-packages; run it as `nmt` or `python -m nmt.cli.main`.
"""
