"""The `accel` command line: typer app, one module per subcommand, each a thin call into the library."""
