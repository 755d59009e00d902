"""One module per `kvstore` subcommand: `add_arguments(parser)` and `run(args) -> int`."""
