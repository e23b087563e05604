"""The engine core process: the loop serving 1..N frontends over pipes, and the messages on those pipes."""
