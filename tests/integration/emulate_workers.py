"""Rank-side programs run under `pdv emulate` by the emulator tests (plain sockets: starts in milliseconds).

    python emulate_workers.py env          print this rank's launcher environment as JSON
    python emulate_workers.py bw MB        rank 0 sends MB megabytes to every other rank in turn; each
                                           receiver prints the measured bandwidth (bytes/s) as JSON
    python emulate_workers.py fail RANK C  rank RANK exits with code C, the others sleep
    python emulate_workers.py sleep S      every rank sleeps S seconds
    python emulate_workers.py spin S       every rank busy-loops S seconds and prints its CPU seconds per
                                           0.25 s window of wall time as JSON
    python emulate_workers.py stream S     rank 0 streams bytes to rank 1 for S seconds; rank 1 calls
                                           pdv_ext.emulate.events.mark_start() when the first bytes arrive and
                                           prints the bytes received per 0.25 s window as JSON
    python emulate_workers.py hol MARK     rank 2 streams bulk bytes to rank 0 (MARK 1: on a connection marked as
                                           the snapshot keepers' copies are, recovery.keeper.background_socket)
                                           while rank 0 times 8 KB round trips to rank 2 on another connection;
                                           rank 0 prints their medians, idle and under the stream, as JSON
    python emulate_workers.py groups       print this rank's CPU group before and after
                                           pdv_ext.emulated_device.enter_device_group(), and the cores its
                                           device clock reads, as JSON
"""
import json
import os
import socket
import sys
import time

KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PDV_DEVICE_NAME",
        "PDV_HOST", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS"]


def _addr(iface: str) -> str:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface.encode()[:15]))  # SIOCGIFADDR
    return socket.inet_ntoa(packed[20:24])


def env() -> None:
    out = {k: os.environ.get(k) for k in KEYS}
    out["ADDR"] = _addr(os.environ["GLOO_SOCKET_IFNAME"])
    print(json.dumps(out), flush=True)


def _recv_exact(conn: socket.socket, n: int) -> None:
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    while n > 0:
        got = conn.recv_into(view[: min(n, len(buf))])
        if not got:
            raise ConnectionError("peer closed")
        n -= got


def bw(mb: float) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"]) + 1
    nbytes = int(mb * 1e6)
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((os.environ["MASTER_ADDR"], port))
        srv.listen(world)
        conns = {}
        while len(conns) < world - 1:
            c, _ = srv.accept()
            conns[int(_recv_line(c))] = c
        payload = b"\0" * (1 << 20)
        for peer in sorted(conns):
            c = conns[peer]
            c.sendall(b"go\n")
            _recv_line(c)  # peer is ready
            left = nbytes
            while left > 0:
                left -= c.send(payload[: min(left, len(payload))])
            _recv_line(c)  # peer has everything
            c.close()
        srv.close()
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                c = socket.create_connection((os.environ["MASTER_ADDR"], port), timeout=60)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        c.sendall(f"{rank}\n".encode())
        _recv_line(c)
        c.sendall(b"ready\n")
        t0 = time.perf_counter()
        _recv_exact(c, nbytes)
        dt = time.perf_counter() - t0
        c.sendall(b"done\n")
        c.close()
        print(json.dumps({"rank": rank, "bw_from_0": nbytes / dt}), flush=True)


WINDOW = 0.25


def spin(seconds: float) -> None:
    """[wall start, wall end, CPU seconds] per window: what the rank's CPU quota let it run."""
    windows = []
    end = time.time() + seconds
    t0, c0 = time.time(), time.process_time()
    while t0 < end:
        while time.time() - t0 < WINDOW:
            pass
        t1, c1 = time.time(), time.process_time()
        windows.append([t0, t1, c1 - c0])
        t0, c0 = t1, c1
    print(json.dumps({"rank": int(os.environ["RANK"]), "windows": windows}), flush=True)


def stream(seconds: float) -> None:
    """Rank 0 sends to rank 1 as fast as the emulated link lets it; rank 1 reports [start, end, bytes] per
    window and the wall time of its mark (when the bytes started to flow)."""
    rank = int(os.environ["RANK"])
    port = int(os.environ["MASTER_PORT"]) + 1
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((os.environ["MASTER_ADDR"], port))
        srv.listen(1)
        c, _ = srv.accept()
        payload = b"\0" * (1 << 16)
        try:
            while True:
                c.sendall(payload)
        except OSError:  # the receiver closed: done
            pass
        c.close()
        srv.close()
        return
    if rank != 1:
        return
    from pdv_ext.emulate.events import mark_start

    deadline = time.monotonic() + 30
    while True:
        try:
            c = socket.create_connection((os.environ["MASTER_ADDR"], port), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    buf = bytearray(1 << 20)
    c.recv_into(buf)
    mark_start()
    mark = time.time()
    windows = []
    t0, got = mark, 0
    while t0 < mark + seconds:
        n = c.recv_into(buf)
        if not n:
            raise ConnectionError("sender closed")
        got += n
        t1 = time.time()
        if t1 - t0 >= WINDOW:
            windows.append([t0, t1, got])
            t0, got = t1, 0
    c.close()
    print(json.dumps({"rank": rank, "mark": mark, "windows": windows}), flush=True)


def _recv_line(c: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        ch = c.recv(1)
        if not ch:
            raise ConnectionError("peer closed")
        data += ch
    return data.decode().strip()


def groups() -> None:
    def mine() -> str:  # the CPU controller's group: v1's "N:cpu,cpuacct:/path" line, else v2's "0::/path"
        with open("/proc/self/cgroup") as f:
            rows = [line.split(":", 2) for line in f.read().splitlines()]
        cpu = [r[2] for r in rows if "cpu" in r[1].split(",")]
        return (cpu or [r[2] for r in rows if r[0] == "0"])[0]

    from pdv_ext.emulated_device import device_clock, enter_device_group

    before = mine()
    entered = enter_device_group()
    print(json.dumps({"before": before, "entered": entered, "after": mine(), "cores": device_clock().cores()}),
          flush=True)


HOL_MSG = 8192


def hol(mark: bool) -> None:
    import statistics
    import threading

    from pdv_ext.recovery.keeper import _recv_exact as _exact, background_socket

    rank = int(os.environ["RANK"])
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 2
    if rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, port))
        srv.listen(2)
        conns = {}
        while len(conns) < 2:
            c, _ = srv.accept()
            conns[_exact(c, 1)] = c
        bulk, echo = conns[b"b"], conns[b"e"]

        def rtts(n: int) -> float:
            out = []
            for _ in range(n):
                t = time.perf_counter()
                echo.sendall(b"x" * HOL_MSG)
                _exact(echo, HOL_MSG)
                out.append(time.perf_counter() - t)
                time.sleep(0.01)
            return statistics.median(out)

        idle = rtts(30)
        bulk.sendall(b"g")

        def drain() -> None:
            try:
                while bulk.recv(1 << 20):
                    pass
            except OSError:
                pass

        threading.Thread(target=drain, daemon=True).start()
        time.sleep(1.0)  # the stream's queue built up
        loaded = rtts(60)
        print(json.dumps({"idle_ms": idle * 1e3, "loaded_ms": loaded * 1e3}), flush=True)
        echo.sendall(b"q" * HOL_MSG)
    elif rank == 2:
        deadline = time.monotonic() + 30
        while True:
            try:
                bulk = background_socket((addr, port), 60) if mark else socket.create_connection((addr, port), 60)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        bulk.sendall(b"b")
        echo = socket.create_connection((addr, port), 60)
        echo.sendall(b"e")

        def stream() -> None:
            _exact(bulk, 1)  # go
            payload = b"\0" * (1 << 20)
            try:
                while True:
                    bulk.sendall(payload)
            except OSError:
                pass

        threading.Thread(target=stream, daemon=True).start()
        while True:
            msg = _exact(echo, HOL_MSG)
            if msg[:1] == b"q":
                break
            echo.sendall(msg)
        os._exit(0)  # (the stream's thread is still sending)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "env":
        env()
    elif what == "bw":
        bw(float(sys.argv[2]))
    elif what == "fail":
        if os.environ["RANK"] == sys.argv[2]:
            time.sleep(0.5)
            sys.exit(int(sys.argv[3]))
        time.sleep(600)
    elif what == "sleep":
        time.sleep(float(sys.argv[2]))
    elif what == "spin":
        spin(float(sys.argv[2]))
    elif what == "stream":
        stream(float(sys.argv[2]))
    elif what == "groups":
        groups()
    elif what == "hol":
        hol(sys.argv[2] == "1")
