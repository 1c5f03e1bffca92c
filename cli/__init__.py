"""The `nmt` command-line interface: one small Typer module per subcommand."""
