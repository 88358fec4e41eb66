"""End to end on 127.0.0.1 with TLS and site authentication: the coordinator and two ``fedsm site`` processes.

One federation run (FedSM with its default personalization rule, APFL; 2 sites, 2 rounds +
calibration) checks that

- the final global, selector and personalized weights equal ``fedsm simulate`` with the same
  seeds (max abs difference <= 1e-5): the transport is faithful, and APFL's private state (the
  model ``v`` and weight ``alpha``, persisted in the site's work folder between rounds) is not lost;
- APFL's private model stays at the site in training rounds; the last round sends the mixture once;
- every request a site sends to the coordinator (as recorded by the SuperLink's fleet listener) holds only weights
  shaped like the models' parameters, counts and metrics: no image, no mask, no file path;
- the Control and Runtime APIs cannot be reached through the address sites use, and the
  SuperLink listens on the loopback interface only;
- the sites' progress events carry the keys the desktop app reads.

Its first site starts as a fresh interpreter, as a user's ``fedsm site`` does; the other sites of the
loopback tests fork from a warm one (tests/federation/warm_start.py).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fed_fixtures import TRAINING, fed_data_two, pki, simulated_supermodel  # noqa: F401
from harness import (
    CoordinatorThread,
    LoopbackFederation,
    Processes,
    max_abs_difference,
    processes_mentioning,
    recorded_messages,
    wait_for,
)

from engine.bundle.supermodel import DEFAULT_PERSONALIZATION
from engine.errors import CancelledError
from engine.federation.config import load_federation_config
from engine.federation.events import EventWriter, read_events
from engine.federation.flower.fleet_listener import read_recorded
from engine.federation.flower.processes import free_port
from engine.models.style_gate_format import descriptor_size

SITES = ["site1", "site2"]
SITE_EVENT_KEYS = {
    "connected": {"coordinator"}, "received": {"round", "rounds", "method", "bytes", "contents"},
    "round_start": {"round", "rounds", "method"}, "batch": {"round", "batch", "batches", "loss", "method"},
    "metrics": {"round", "loss", "dice"}, "sent": {"round", "bytes", "contents"},
    "round_end": {"round", "rounds", "wall_s"}, "finished": {"rounds"},
    "run_settings": {"settings"},  # the signed run spec, verified by the site (engine.security.run_spec)
}


@pytest.mark.slow
def test_secure_loopback_federation(fed_data_two, pki, simulated_supermodel, tmp_path):  # noqa: F811

    # Prepare
    _, datalists = fed_data_two
    superlink_port = free_port()
    fed = LoopbackFederation(tmp_path, pki, datalists, SITES, TRAINING, {"superlink_port": superlink_port})
    sent_by_sites = tmp_path / "sent-by-sites"
    server = CoordinatorThread(fed, record_fleet=sent_by_sites)
    outcome = server.outcome
    procs = Processes()
    slow: list = []
    try:
        # Execute
        server.start()
        sites = [fed.start_site(procs, s, cold=k == 0) for k, s in enumerate(SITES)]  # site1: a fresh interpreter
        wait_for(fed.server_events, lambda e: e["event"] == "round_start", 180, [server, *sites])
        check_sites_address_serves_only_the_fleet_api(fed.port, superlink_port, pki)
        # the red-team's attack during the run: 1,000 anonymous connections, each announcing a 64 KiB body
        slow = hold_slow_anonymous_connections(fed.port, pki / "ca.pem", 1000)
        server.join(timeout=300)
        assert not server.is_alive(), "the federation did not finish within 300 s"
        assert "error" not in outcome, outcome.get("error")
        for site in SITES:
            wait_for(fed.site_events(site), lambda e: e["event"] == "finished", 60)
    finally:
        for sock in slow:
            sock.close()
        server.stop()
        procs.stop_all()

    # Assert: the rounds took their normal time beside the slow connections (a few seconds each here)
    round_s = [e["wall_s"] for e in read_events(fed.server_events) if e["event"] == "round_end"]
    print(f"round wall times beside 1,000 slow anonymous connections: {round_s}")
    assert len(round_s) == 3 and max(round_s) < 60, round_s
    # Assert: the same weights as the simulation
    difference = max_abs_difference(fed.work / "supermodel.safetensors", simulated_supermodel)
    print(f"max abs weight difference, loopback federation vs fedsm simulate: {difference:.2e}")
    assert difference <= 1e-5, difference
    summary = outcome["summary"]
    assert [r["answered"] for r in summary["rounds"]] == [SITES] * 3
    # Assert: every site measured the final models on its own splits; the bundle holds those Dice
    from engine.bundle import read_metadata

    meta = read_metadata(fed.work / "supermodel.safetensors")
    assert sorted(summary["site_dice"]) == sorted(SITES) and meta.extra["site_dice"] == summary["site_dice"]
    assert all(meta.val_dice[s] == summary["site_dice"][s]["validation"]["personalized"] for s in SITES)
    # Assert: site_routing auto's choice and the guard's paired statistics came through the network as simulated
    simulated = read_metadata(simulated_supermodel)
    assert meta.selector_width == simulated.selector_width == TRAINING["selector_width"]  # the signed setting
    assert meta.personalization == simulated.personalization == DEFAULT_PERSONALIZATION == "apfl"
    assert meta.site_routing == simulated.site_routing and "routing_choice" in meta.extra
    assert meta.extra["routing_choice"] == pytest.approx(simulated.extra["routing_choice"])
    assert all({"cases", "diff_sd"} <= set(meta.site_validation[s]) for s in SITES)
    assert all(meta.site_validation[s] == pytest.approx(simulated.site_validation[s]) for s in SITES)
    # Assert: what left the sites
    check_only_weights_counts_and_metrics_left(read_recorded(sent_by_sites), datalists)
    # Assert: progress events as the desktop app reads them
    for site in SITES:
        events = read_events(fed.site_events(site))
        kinds = {e["event"] for e in events}
        assert set(SITE_EVENT_KEYS) <= kinds, kinds
        for event in events:
            assert {"event", "time", "source", "site"} <= set(event) and event["source"] == "site"
            assert event["site"] == site
            assert SITE_EVENT_KEYS.get(event["event"], set()) <= set(event), event
        metrics = next(e for e in events if e["event"] == "metrics" and e["round"] == 1)
        assert set(metrics["dice"]) == {"global", "personalized", "local"}
        assert all(0.0 <= v <= 1.0 for v in metrics["dice"].values())
        shown = next(e for e in events if e["event"] == "run_settings")["settings"]
        assert shown["signed"] is True and shown["method"] == "fedsm" and shown["image_size"] == 32
        assert shown["personalization"] == "apfl"  # the default rule, shown before the site agrees
        sent = {e["round"]: e for e in events if e["event"] == "sent"}
        assert sorted(sent) == [1, 2, 3]
        # APFL's private model v stays at the site in training rounds; the last round sends the mixture once
        for rnd in (1, 2):
            assert sent[rnd]["contents"]["tensors"] == {"global": 63, "selector": 60, "selector_optim": 73,
                                                        "style_stats": 3}  # Adam state; style-gate sums
        assert sent[3]["contents"]["tensors"].get("personal") == 63, sent[3]
        assert sent[1]["contents"]["num_examples"] > 0 and "loss_global" in sent[1]["contents"]["metrics"]
    server_events = read_events(fed.server_events)
    assert [e["round"] for e in server_events if e["event"] == "checkpoint"] == [1, 2, 3]
    assert all(e["left_out"] == {} for e in server_events if e["event"] == "round_end")


def hold_slow_anonymous_connections(port: int, ca: Path, count: int) -> list:
    """``count`` TLS connections to the sites' address that announce a 64 KiB fleet upload and send one byte."""
    import resource
    import socket
    import ssl

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 500:
        if hard < count + 500:
            pytest.skip(f"needs {count + 500} open files, the limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count + 500, hard))
    context = ssl.create_default_context(cafile=str(ca))
    held = []
    for _ in range(count):
        sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=30),
                                   server_hostname="127.0.0.1")
        sock.sendall(b"POST /v1/fleet/push-object HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/protobuf\r\nContent-Length: 65536\r\n\r\nX")
        held.append(sock)
    return held


def check_sites_address_serves_only_the_fleet_api(port: int, superlink_port: int, pki_dir: Path) -> None:
    """From the sites' side only /v1/fleet/* exists; the SuperLink's whole API listens on loopback only."""
    import ssl

    from flwr.proto.control_pb2 import ListNodesRequest, StartRunRequest
    from flwr.supercore.control import ControlHttpClient
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

    ca = ssl.create_default_context(cafile=str(pki_dir / "ca.pem"))
    with httpx.Client(verify=ca, timeout=10) as client:
        for path in ("/v1/control/list-nodes", "/v1/control/start-run", "/v1/runtime/get-nodes",
                     "/v1/runtime/acquire-task", "/docs", "/v1/fleet/../control/list-nodes"):
            assert client.post(f"https://127.0.0.1:{port}{path}", content=b"").status_code == 404, path
        assert client.get(f"https://127.0.0.1:{port}/v1/fleet/pull-messages").status_code == 404
        # a fleet call reaches the SuperLink (and is refused there: no valid node signature)
        assert client.post(f"https://127.0.0.1:{port}/v1/fleet/pull-messages", content=b"").status_code != 404
    # Flower's own control client, pointed at the sites' address, cannot start a run
    control = ControlHttpClient.from_server_address(
        f"127.0.0.1:{port}", False, (pki_dir / "ca.pem").read_bytes(),
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI")])
    with pytest.raises(httpx.HTTPStatusError, match="404"):
        control.StartRun(StartRunRequest())
    control.close()
    # ... and on the coordinator's loopback interface (plain HTTP) it answers only the coordinator's
    # process, which holds the secret (local_auth; tests/federation/test_local_auth.py probes every call)
    local = ControlHttpClient.from_server_address(
        f"127.0.0.1:{superlink_port}", True, None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI")])
    with pytest.raises(httpx.HTTPStatusError, match="401"):
        local.ListNodes(ListNodesRequest())
    local.close()
    assert listening_addresses(superlink_port) == {"127.0.0.1"}


def listening_addresses(port: int) -> set[str]:
    """IPv4 addresses with a listening TCP socket on ``port`` (Linux /proc/net/tcp)."""
    table = Path("/proc/net/tcp")
    if not table.exists():
        pytest.skip("needs /proc/net/tcp to check listening addresses")
    found = set()
    for line in table.read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if int(port_hex, 16) == port and state == "0A":  # 0A = LISTEN
            found.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def check_only_weights_counts_and_metrics_left(requests: list[tuple[str, bytes]], datalists: list[Path]) -> None:
    """Rebuild every message the sites sent from the recorded requests and inspect it."""
    from engine.data.site_data import load_site
    from engine.federation.flower import records
    from engine.fl.selector_calibration import STAT_KEYS
    from engine.models import build_segmentation_net, build_selector
    from engine.tasks import get_task

    assert requests, "nothing was recorded at the fleet listener"
    template = {**build_segmentation_net(3, 2).state_dict(),
                **build_selector(3, len(SITES), "gap", TRAINING["selector_width"]).state_dict()}
    shapes = {k: tuple(v.shape) for k, v in template.items()}
    replies = 0
    for message in recorded_messages(requests):
        content = message.content
        allowed = {records.INFO, records.METRICS, records.LAYOUT} | {
            records.WEIGHTS_PREFIX + p
            for p in ("global", "personal", "selector", "selector_optim", "selector_stats", "selector_temperature",
                      "style_stats", "style_hist", "selector_gamma", "routing_stats")}
        assert set(content) <= allowed, set(content)
        info = content.config_records[records.INFO]
        assert set(info) <= {"site", "round"} and info["site"] in SITES
        for key, value in content.metric_records.get(records.METRICS, {}).items():
            assert isinstance(value, int | float), key
        for key in content.array_records:
            part = key[len(records.WEIGHTS_PREFIX):]
            tensors = records.unpack(content.array_records[key], content.config_records[records.LAYOUT][part], part)
            for name, tensor in tensors.items():
                if part == "selector_stats":
                    assert name in STAT_KEYS and tensor.dim() <= 2
                elif part == "style_stats":  # sums over the site's images: count, sum (d,), outer (d, d)
                    d = descriptor_size(3)  # 66 numbers per fundus image
                    assert name in ("count", "sum", "outer") and tensor.numel() <= d * d
                elif part == "style_hist":  # a histogram of validation distances, no per-image value
                    assert name == "counts" and tensor.dim() == 1
                elif part == "selector_gamma":  # site_routing auto: a confidence histogram and a missed count
                    assert (name, tuple(tensor.shape)) in (("counts", (1, 100)), ("missed", (1, 1)))
                elif part == "routing_stats":  # site_routing auto: two whole numbers
                    assert name in ("style_own", "count") and tuple(tensor.shape) == (1,)
                elif part == "selector_optim":  # Adam moments of selector parameters, and the step count
                    moment = name.removeprefix("exp_avg_sq.").removeprefix("exp_avg.")
                    assert name == "step" or shapes[moment] == tuple(tensor.shape), (part, name)
                else:
                    assert shapes[name] == tuple(tensor.shape), (part, name)  # a model parameter, nothing else
        replies += 1
    assert replies >= len(SITES) * 3  # every site, three rounds (plus their answers to control queries)
    # no byte of an image, a mask or a path in anything a site sent (weights are float32 too)
    task = get_task("fundus")
    needles = []
    for datalist in datalists:
        site = load_site(datalist, task, 32)
        needles += [distinctive_window(site.train.images), distinctive_window(site.train.masks),
                    str(datalist.parent).encode(), b"datalist", b".png"]
        image_file = json.loads(datalist.read_text())["training"][0]["image"]
        needles.append((datalist.parent / image_file).read_bytes()[100:164])
    for path, body in requests:
        for needle in needles:
            assert needle not in body, (path, needle[:40])


def distinctive_window(arrays: np.ndarray, size: int = 64) -> bytes:
    """Bytes of ``size`` consecutive float32 values of one of ``arrays`` that no weight tensor holds by chance.

    Image windows need many distinct values; mask windows (0/1) need at least two separate runs
    of ones, a pattern a freshly initialised layer (a block of ones, then zeros) cannot show.
    """
    for array in arrays:
        flat = array.astype(np.float32).ravel()
        for start in range(0, len(flat) - size, size // 4):
            window = flat[start:start + size]
            rising_edges = int(((window[1:] > 0.5) & (window[:-1] <= 0.5)).sum())
            if len(np.unique(window)) >= 16 or rising_edges >= 2:
                return window.tobytes()
    raise AssertionError("no distinctive window in these images or masks")


@pytest.mark.slow
def test_stop_flag_cancels_a_waiting_coordinator(pki, fed_data_two, tmp_path):  # noqa: F811
    """No sites: the coordinator waits for them and stops cleanly (children stopped) when asked."""
    from engine.federation.flower.server import run_server

    _, datalists = fed_data_two
    fed = LoopbackFederation(tmp_path, pki, datalists, SITES, TRAINING, {"start_timeout": 600})
    stop = threading.Event()
    serving: list[int] = []

    def waiting() -> bool:
        try:
            events = read_events(fed.server_events)
        except OSError:  # not written yet
            return False
        return any(f"waiting for {', '.join(SITES)}" in e.get("message", "") for e in events)

    def stop_once_waiting() -> None:
        # Asked to stop only once it really waits for the sites: on a loaded machine starting the
        # SuperLink alone can take longer than any fixed delay. The deadline only bounds a hang.
        deadline = time.monotonic() + 300
        while not waiting() and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.2)
        serving.extend(processes_mentioning(f"127.0.0.1:{fed.port}"))  # the SuperLink, while it waits
        stop.set()

    watcher = threading.Thread(target=stop_once_waiting, daemon=True)
    watcher.start()
    with EventWriter("server", path=fed.server_events) as events, pytest.raises(CancelledError):
        run_server(load_federation_config(fed.config), events=events, stop=stop.is_set)
    stop.set()
    watcher.join(timeout=5)
    assert waiting()
    # the SuperLink child was started and stopped, not orphaned: no process serves the federation's address
    # any more (checked by process, not by its goodbye line, which a loaded machine may not get to write
    # before the coordinator's SIGINT grace runs out and SIGTERM ends it)
    assert "Starting Flower SuperLink" in (fed.work / "superlink.log").read_text()
    assert serving and processes_mentioning(f"127.0.0.1:{fed.port}") == []
