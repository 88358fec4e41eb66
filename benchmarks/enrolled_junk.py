"""How much an *enrolled* site's junk uploads grow the SuperLink's memory (issue 16).

Starts a real SuperLink through the FedSM launcher (TLS, fleet listener, enrolled site1 key,
the same allocator settings as ``fedsm server``), then sends ``--count`` bodies of
``--size`` bytes of junk to ``/v1/fleet/push-object`` from ``--threads`` connections at once,
each request signed with site1's key (so the fleet listener's header check lets it through,
as it would a real site's). Prints the SuperLink's resident memory before and after.

    PYTHONPATH=. python benchmarks/enrolled_junk.py --count 192 --size 7900000 --threads 16
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import datetime as dt
import json
import tempfile
import time
from pathlib import Path


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def signed_headers(key_path: Path, pub_path: Path) -> dict[str, str]:
    """Flower's fleet authentication headers for site1, freshly timestamped."""
    from flwr.common.constant import TIMESTAMP_HEADER
    from flwr.supercore.constant import FLEET_HTTP_PUBLIC_KEY_HEADER, FLEET_HTTP_SIGNATURE_HEADER
    from flwr.supercore.primitives.asymmetric import sign_message

    from engine.security.certs import load_site_private_key

    stamp = dt.datetime.now(dt.UTC).isoformat()
    signature = sign_message(load_site_private_key(key_path), stamp.encode())
    return {FLEET_HTTP_PUBLIC_KEY_HEADER: base64.b64encode(pub_path.read_bytes()).decode(),
            FLEET_HTTP_SIGNATURE_HEADER: base64.b64encode(signature).decode(), TIMESTAMP_HEADER: stamp,
            "content-type": "application/protobuf"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=192)
    parser.add_argument("--size", type=int, default=7_900_000)
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()

    import ssl

    import httpx

    from engine.federation.flower import local_auth
    from engine.federation.flower.control import ControlClient
    from engine.federation.flower.fleet_auth import write_keys
    from engine.federation.flower.processes import ChildProcess, free_port, launcher_argv
    from engine.security import certs

    with tempfile.TemporaryDirectory(prefix="fedsm-junk-") as tmp:
        root = Path(tmp)
        certs.create_ca(root)
        certs.create_server_certificate(root, root, ["127.0.0.1"])
        certs.create_site_keys("site1", root)
        link_port, fleet_port = free_port(), free_port()
        secret = local_auth.new_secret()
        site_key = (root / "site1.pub.pem").read_bytes()
        tls = ["--ssl-ca-certfile", str(root / "ca.pem"), "--ssl-certfile", str(root / "server.pem"),
               "--ssl-keyfile", str(root / "server.key"), "--enable-supernode-auth"]
        superlink = ChildProcess(
            "SuperLink", launcher_argv("superlink", ["--host", "127.0.0.1", "--port", str(link_port), "--isolation",
                                                     "process", *tls], fleet_address=f"127.0.0.1:{fleet_port}",
                                       fleet_keys=str(write_keys(root / "fleet-keys.pem", [site_key]))),
            root / "superlink.log", env={"FLWR_HOME": str(root / "home"), local_auth.ENV: secret})
        try:
            superlink.start()
            superlink.wait_for_port("127.0.0.1", link_port, timeout=120)
            superlink.wait_for_port("127.0.0.1", fleet_port, timeout=60)
            control = ControlClient(f"127.0.0.1:{link_port}", secret)
            control.register_sites({"site1": site_key})  # enrolment, as fedsm server does it
            control.close()
            pid = superlink.pid
            assert pid is not None
            time.sleep(1.0)
            before = rss_mib(pid)
            body = b"\x0a" + b"\xff" * (args.size - 1)  # junk: not a valid request
            url = f"https://127.0.0.1:{fleet_port}/v1/fleet/push-object"
            context = ssl.create_default_context(cafile=str(root / "ca.pem"))

            def upload(_: int) -> int:
                try:
                    return httpx.post(url, content=body, timeout=120, verify=context,
                                      headers=signed_headers(root / "site1.key", root / "site1.pub.pem")).status_code
                except httpx.TransportError:
                    return -1

            started = time.monotonic()
            peak = before
            with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
                futures = [pool.submit(upload, k) for k in range(args.count)]
                while not all(f.done() for f in futures):
                    peak = max(peak, rss_mib(pid))
                    time.sleep(0.05)
                codes = [f.result() for f in futures]
            after = rss_mib(pid)
            print(json.dumps({"count": args.count, "size": args.size, "threads": args.threads,
                              "rss_before_mib": round(before), "rss_peak_mib": round(max(peak, after)),
                              "rss_after_mib": round(after), "wall_s": round(time.monotonic() - started, 1),
                              "codes": {str(c): codes.count(c) for c in sorted(set(codes))}}))
        finally:
            superlink.stop()


if __name__ == "__main__":
    main()
