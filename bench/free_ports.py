"""Prints a free TCP port on 127.0.0.1 for each argument N: the first of N consecutive free
ports (the bench scripts' etcd, master, proxy and per-role port runs).

    python3 bench/free_ports.py 1 1 4 4   ->   41231 40877 35012 38120
"""

import socket
import sys


def free(n=1):
    while True:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
        s.close()
        if base + n > 65000:
            continue
        ok = True
        for p in range(base, base + n):
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", p))
            except OSError:
                ok = False
            t.close()
        if ok:
            return base


print(*(free(int(n)) for n in sys.argv[1:]))
