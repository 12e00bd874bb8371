"""The TCPStore of a test's processes (reshard.vllm's StoreGroup runs over one): process 0
serves it on a free port and writes the port to a file, the others wait for the file and join."""

import os


def process_store(rank: int, port_file: str, timeout_s: float = 60):
    from reshard.vllm._group import join_store, serve_store
    if rank == 0:
        store = serve_store("127.0.0.1", timeout_s)
        with open(port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(port_file + ".tmp", port_file)
        return store
    while not os.path.exists(port_file):
        pass
    return join_store("127.0.0.1", int(open(port_file).read()), timeout_s)
