"""The network transport: FedSM over Flower's deployment engine.

Coordinator (``fedsm server``)::

    SuperLink (child process), two listeners in one event loop (:mod:`.fleet_listener`):
      federation address, TLS: the Fleet API alone (POST /v1/fleet/*); what sites reach
      127.0.0.1, plain HTTP: Fleet, Control and Runtime APIs, for this machine only
      ^  loopback
    ServerApp (in the server process): the round loop, per-site messages through a Grid

Site (``fedsm site``)::

    SuperNode (child process): connects to the coordinator with TLS and the site's key
      ^  loopback Runtime API
    ClientApp executor (the site process): approves the app, trains with the installed engine

Modules: :mod:`.launch` (runs a Flower component as a child with a parent watchdog),
:mod:`.processes` (starting, watching and stopping children by PID), :mod:`.records`
(payloads as Flower records), :mod:`.transfer` (prompt object pulls), :mod:`.app_bundle` (the
FAB a site approves), :mod:`.control` (control API calls), :mod:`.fleet_listener`
(the SuperLink's two listeners), :mod:`.memory` (allocator settings for large messages),
:mod:`.server_app`, :mod:`.server`, :mod:`.client_app`, :mod:`.site`.
"""

import os

# Flower reads these when it is imported (telemetry) or when a component starts; they are set
# here, before any flwr import in this package, and children inherit them.
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",  # no usage reports to Flower Labs
    "FLWR_DISABLE_UPDATE_CHECK": "1",  # no calls home for new versions
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # never `uv sync` an app's dependencies
}
os.environ.update(FLOWER_ENV)
