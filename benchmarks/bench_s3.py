"""Saving and loading many small leaves on an S3-compatible object store: xckpt against plain boto3.

A moto S3 server runs on loopback (as in the tests), behind a small TCP proxy that counts the HTTP requests
by method and holds each request back ``--latency-ms`` (default 20) before passing it on, as the round trip
to a store in another building or region would (every connection is held back on its own, so requests in
flight together wait together). One process, ``--repeats`` times after a warm-up: saves W2 at ``--scale``
(default 0.05: 500 fp32 vectors of 1024 and 3 small matrices) to a fresh prefix with ``xckpt.save``, against
boto3 writing the same objects (names and bytes) with one ``put_object`` after another; then loads it whole
with ``xckpt.load`` (checked element by element), against boto3 reading every object of the checkpoint, one
``get_object`` after another (the peer: a client that knows every name and moves each object once, one at a
time). boto3 goes through the proxy too.

    python benchmarks/bench_s3.py [--scale 0.05] [--repeats 3] [--latency-ms 20]

moto itself answers about one request every few milliseconds on loopback, one at a time; ``--latency-ms 0``
measures that alone.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from typing import Any, Callable

import numpy as np

import _common as C

METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")


class CountingProxy:
    """127.0.0.1:port -> the moto server, counting the requests that go through by HTTP method."""

    def __init__(self, target: int, latency_s: float = 0.0) -> None:
        self.target = target
        self.latency_s = latency_s
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(256)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if requests:
                    for m in METHODS:
                        if data.startswith(m):  # a request's first bytes arrive at the start of a read
                            with self.lock:
                                self.counts[m.decode().strip()] += 1
                            if self.latency_s:
                                time.sleep(self.latency_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def take(self) -> dict[str, int]:
        """The counts since the last call."""
        with self.lock:
            out, self.counts = dict(self.counts), Counter()
        return out


def _start_moto() -> tuple[subprocess.Popen[bytes], int]:
    port = C.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


def _compare(what: str, ours: Callable[[], dict[str, int]], peer: Callable[[], Any],
             repeats: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Time ``ours`` (xckpt, returning its requests) against ``peer`` (boto3) in alternating rounds after a warm-up;
    the seconds of each timed run, by method, and the requests of xckpt's last run."""
    times: dict[str, list[float]] = {"xckpt": [], "boto3": []}
    requests: dict[str, int] = {}
    for rep, order in C.rounds(["xckpt", "boto3"], repeats):
        for m in order:
            t0 = time.perf_counter()
            if m == "xckpt":
                requests = ours()
            else:
                peer()
            seconds = time.perf_counter() - t0
            if rep is not None:
                times[m].append(seconds)
            C.log(f"{C.run_name(rep)} {what} {m}: {seconds:.2f} s")
    return times, requests


def main() -> int:
    """Run the measurement and print its table."""
    p = C.common_args(__doc__.splitlines()[0], workload=False)
    p.set_defaults(scale=0.05)
    p.add_argument("--latency-ms", type=float, default=20.0,
                   help="how long the proxy holds each request back, as a store's round trip (default 20)")
    args = C.parse(p)
    import boto3

    proc, port = _start_moto()
    try:
        proxy = CountingProxy(port, args.latency_ms / 1000)
        endpoint = f"http://127.0.0.1:{proxy.port}"
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
                          AWS_ENDPOINT_URL_S3=endpoint)
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1")
        peer = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")  # through the proxy, as xckpt
        deadline = time.monotonic() + 30
        while True:
            try:
                client.create_bucket(Bucket="bench")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        import xckpt

        C.log_xckpt()
        wl = C.w2(args.scale)
        tree: dict[str, Any] = C.full_arrays(wl)
        url = f"s3://bench/{uuid.uuid4().hex[:8]}/w2"
        C.log(f"saving {C.size_note(wl)} to {url}")
        xckpt.save(tree, url)
        prefix = url[len("s3://bench/"):] + "/"
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix=prefix)
                for o in page.get("Contents", [])]
        objects = {k: client.get_object(Bucket="bench", Key=k)["Body"].read() for k in keys}
        proxy.take()
        saved: list[str] = []

        def save() -> dict[str, int]:
            proxy.take()
            to = f"s3://bench/{uuid.uuid4().hex[:8]}/w2"
            xckpt.save(tree, to)
            saved.append(to)
            return proxy.take()

        def boto_writes() -> None:
            base = f"{uuid.uuid4().hex[:8]}/w2/"
            for k, data in objects.items():
                peer.put_object(Bucket="bench", Key=base + k[len(prefix):], Body=data)

        save_times, save_requests = _compare("save", save, boto_writes, args.repeats)
        for to in saved:  # what each save wrote loads back exactly
            out = xckpt.load(to)
            for k, v in tree.items():
                C.check_equal(k, np.asarray(out[k]), np.asarray(v), "xckpt save to S3")
        proxy.take()

        def load() -> dict[str, int]:
            proxy.take()  # the peer's requests before it are not this load's
            out = xckpt.load(url)
            for k, v in tree.items():
                C.check_equal(k, np.asarray(out[k]), np.asarray(v), "xckpt load from S3")
            return proxy.take()

        def boto_reads() -> int:
            return sum(len(peer.get_object(Bucket="bench", Key=k)["Body"].read()) for k in keys)

        times, requests = _compare("load", load, boto_reads, args.repeats)
        t = C.Table(f"Save to and load from S3 (moto on loopback, each request held back {args.latency_ms:g} ms), one "
                    f"process, median of {args.repeats}\n  {C.size_note(wl)}; {len(keys)} objects", ["xckpt", "boto3"])
        t.add("save s (peer: every object, one put_object after another)",
              [C.median(save_times["xckpt"]), C.median(save_times["boto3"])])
        t.add("requests (PUT) of one xckpt save", [float(save_requests.get("PUT", 0)), float(len(keys))], fmt="{:.0f}",
              note="xckpt: " + ", ".join(f"{n} {m}" for m, n in sorted(save_requests.items())))
        t.add("load s (peer: every object, one get_object after another)",
              [C.median(times["xckpt"]), C.median(times["boto3"])])
        t.add("requests (GET, HEAD) of one xckpt load",
              [float(requests.get("GET", 0) + requests.get("HEAD", 0)), float(len(keys))], fmt="{:.0f}",
              note=f"xckpt: {requests.get('GET', 0)} GET, {requests.get('HEAD', 0)} HEAD")
        t.print()
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
