"""The six services as thin adapters over the libraries (receive, call the library, publish).

Each `radixserve.services.<name>` module exposes:

    add_arguments(parser: argparse.ArgumentParser) -> None   # its own flags
    run(ns: argparse.Namespace) -> int                       # blocking; the exit code

`radixserve serve <name>` calls them; `runtime.py` holds what every service shares
(settings, logging, connect, supervised tasks, heartbeat, drain on SIGTERM). Each
module's docstring (its `serve NAME --help`) says what it consumes and publishes, its
flags, how it scales and what it does on failure; the images are built from `docker/`.
"""
