"""Pure logic in process: table tests and hypothesis properties; no server, database or child process."""
