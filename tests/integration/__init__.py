"""One part against real services: databases, Redis, sockets, runc, QEMU, model servers, servers in process."""
