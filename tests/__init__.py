"""The test suite, by what a test needs (a module goes where its heaviest test belongs):

- ``unit/``: pure logic: table tests of named cases, hypothesis properties; no server, database,
  socket or child process (but a fresh Python, to see what an import loads, and the import linter);
- ``integration/``: one part against real services: SQLite and PostgreSQL, Redis, sockets, runc, QEMU, model
  servers, the API or the gateway served in process;
- ``e2e/``: the whole stack as users run it: ``tensora up`` / ``serve`` / ``gateway`` / ``plan`` and the CLI as
  child processes, over HTTP, and a browser;
- ``support/``: the helpers they share (builders, services, stack, the API and controller harnesses, ``tensora
  serve`` and ``tensora up`` as children, the browser, hypothesis strategies, the one fake clock, the gateway
  harness, the doubles). A test module imports its helpers from here, never from another test module.
"""
