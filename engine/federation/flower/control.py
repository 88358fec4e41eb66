"""Calls to the SuperLink's Control API (loopback only): enrol keys, start and stop runs.

Only the coordinator's own process makes these calls; the Control API is never reachable
from the sites' side (see :mod:`engine.federation.flower.fleet_listener`).
"""

from __future__ import annotations

import hashlib
import logging

import httpx
from flwr.common.serde import fab_to_proto, user_config_to_proto
from flwr.proto.control_pb2 import (
    ListNodesRequest,
    ListRunsRequest,
    RegisterNodeRequest,
    StartRunRequest,
    StopRunRequest,
    UnregisterNodeRequest,
)
from flwr.supercore.control import ControlHttpClient
from flwr.supercore.fab import Fab

from engine.errors import FedSMError
from engine.federation.flower.local_auth import interceptors
from engine.federation.flower.runtime_api import version_interceptor

log = logging.getLogger(__name__)

#: Run states that no longer need stopping.
_FINISHED = {"finished"}


class ControlClient:
    """A client of the SuperLink's Control API on its loopback listener (plain HTTP).

    Parameters
    ----------
    address
        ``127.0.0.1:<port>`` of the SuperLink.
    local_secret
        The secret the SuperLink was started with (:mod:`.local_auth`).
    """

    def __init__(self, address: str, local_secret: str | None = None) -> None:
        self._client = ControlHttpClient.from_server_address(
            address, True, None, interceptors=[version_interceptor("flwr CLI"),
                                               *interceptors(local_secret)])

    def close(self) -> None:
        self._client.close()

    def list_nodes(self) -> list[tuple[int, bytes, str, str]]:
        """``(node_id, public key PEM, name, status)`` of every registered node."""
        res = self._client.ListNodes(ListNodesRequest())
        return [(n.node_id, n.public_key.encode() if isinstance(n.public_key, str) else bytes(n.public_key),
                 n.name, n.status) for n in res.nodes_info]

    def register_sites(self, keys: dict[str, bytes]) -> dict[str, int]:
        """Register each site's public key (PEM) and return ``{site: node_id}``.

        Keys registered earlier keep their node id. Registered keys of sites no longer
        enrolled are unregistered, so a withdrawn enrolment takes effect at the next start.
        """
        existing = {_normal(pem): node_id for node_id, pem, _name, _status in self.list_nodes()}
        wanted = {_normal(pem): site for site, pem in keys.items()}
        for pem, node_id in existing.items():
            if pem not in wanted:
                log.info("unregistering node %d: its key is no longer enrolled", node_id)
                self._client.UnregisterNode(UnregisterNodeRequest(node_id=node_id))
        out: dict[str, int] = {}
        for site, pem in keys.items():
            node_id = existing.get(_normal(pem))
            if node_id is None:
                res = self._client.RegisterNode(RegisterNodeRequest(public_key=pem, name=site))
                node_id = int(res.node_id)
            out[site] = node_id
        return out

    def stop_unfinished_runs(self) -> list[int]:
        """Stop runs left by an earlier coordinator process (so sites drop their messages)."""
        stopped = []
        for run_id, run in self._client.ListRuns(ListRunsRequest()).run_dict.items():
            if run.status.status not in _FINISHED:
                try:
                    self._client.StopRun(StopRunRequest(run_id=run_id))
                    stopped.append(int(run_id))
                except httpx.HTTPStatusError as exc:
                    log.warning("could not stop earlier run %d: %s", run_id, exc)
        return stopped

    def start_run(self, fab: bytes, run_config: dict[str, str] | None = None) -> int:
        """Start a run of the app bundle ``fab`` (with ``run_config``, e.g. the signed run spec); return its run id."""
        res = self._client.StartRun(StartRunRequest(fab=fab_to_proto(Fab(hashlib.sha256(fab).hexdigest(), fab, {})),
                                                    override_config=user_config_to_proto(dict(run_config or {}))))
        if not res.HasField("run_id"):
            raise FedSMError("the SuperLink did not start the run; see superlink.log in the work folder")
        return int(res.run_id)


def _normal(pem: bytes) -> bytes:
    return b"".join(pem.split())
