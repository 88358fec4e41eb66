"""FedSM's one door into Flower's Runtime API: a task held from acquisition to its reported end.

Both ends of the network federation execute their own Flower app instead of letting Flower start
a ``flwr-serverapp`` / ``flwr-clientapp`` process (``--isolation process``): the coordinator's
``fedsm server`` takes the run's ServerApp task from its SuperLink, each site's ``fedsm site``
takes ClientApp tasks from its SuperNode. Flower's public API has no client for that: the
names below are what Flower's own runners use, and this module is the only place that speaks
that part of Flower (issue 33; docs/federation.md, "Flower's public API: where FedSM stands").
Why not Flower's runners: they start a fresh process for every message a site receives, which
measured 10.4 s a round at FedSM's message sizes and 20.4 s once each process imports the
engine (``benchmarks/public_flower_overhead.py``), against 3.1 s here.

A task's life: :func:`runtime_client` (the loopback listener's secret and, once acquired, the
task's token), :func:`acquire_task`, :func:`start_heartbeat`, :func:`take_task_input` (the run,
its app bundle and context; also tells Flower's process-wide ``TaskIdentity`` which task this
process serves, as Flower's runners do), then :func:`push_reply` (sites) and
:func:`finish_task`. :func:`error_reply` builds the error answers a site sends instead of a
result, in Flower's error codes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.serde import context_from_proto, context_to_proto, fab_from_proto, run_from_proto
from flwr.proto.runtime_pb2 import AcquireTaskRequest, PullTaskInputRequest, PushTaskOutputRequest
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supernode.runtime.run_clientapp import push_message

from engine.federation.flower.local_auth import interceptors

log = logging.getLogger(__name__)

#: Which app a process runs: Flower's component names, also sent as its version header.
Component = Literal["serverapp", "clientapp"]
_TASK_TYPES = {"serverapp": TaskType.SERVER_APP, "clientapp": TaskType.CLIENT_APP}

#: Why a site answers with an error instead of a result, and Flower's code for each.
ERROR_CODES = {
    "app_not_approved": ErrorCode.INVALID_FAB,  # the bundle's hash is not in the site's approved_apps
    "refused": ErrorCode.MOD_FAILED_PRECONDITION,  # the signed settings, [bounds] or the operator said no
    "failed": ErrorCode.CLIENT_APP_RAISED_EXCEPTION,  # the site's training or evaluation raised
}


def version_interceptor(component: str) -> Any:
    """The header with which Flower's servers recognise a caller of this Flower version."""
    return RuntimeVersionHttpInterceptor(component_name=component)


def runtime_client(address: str, component: Component, local_secret: str | None = None,
                   token: str | None = None) -> Any:
    """A client of the Runtime API at ``address`` (a loopback listener, plain HTTP).

    ``local_secret``: the listener's per-process secret (:mod:`.local_auth`); ``token``: the
    acquired task's (every call after :func:`acquire_task` needs it).
    """
    chain: list[Any] = [version_interceptor(f"flwr-{component}"), *interceptors(local_secret)]
    if token is not None:
        chain.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                 interceptors=chain)


def acquire_task(client: Any, component: Component) -> str | None:
    """The token of a waiting task of ``component``'s kind, or ``None`` when none waits."""
    res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[_TASK_TYPES[component]]))
    return str(res.token) if res.HasField("task") and res.token else None


def start_heartbeat(client: Any) -> Any:
    """Start telling the Runtime API that the task is alive (Flower ends tasks that fall silent).

    Returns the sender; pass it to :func:`finish_task`.
    """
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    return heartbeat


@dataclass
class TaskInput:
    """What the Runtime API hands a task before any message: its run, app bundle and context."""

    task_id: int
    run: Any  # flwr Run
    fab: Any  # flwr Fab (its ``content`` is the bundle's bytes)
    context: Any  # flwr Context (node id, run config, state)


def take_task_input(client: Any) -> TaskInput:
    """The acquired task's input; this process now serves that task (Flower's ``TaskIdentity``)."""
    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id = res.task_id
    TaskIdentity.run_id = res.run.run_id
    TaskIdentity.node_id = res.context.node_id
    return TaskInput(int(res.task_id), run_from_proto(res.run),
                     fab_from_proto(res.fab) if res.HasField("fab") else None, context_from_proto(res.context))


def error_reply(message: Message, why: str, reason: str) -> Message:
    """A site's error answer to ``message`` (``why``: a key of :data:`ERROR_CODES`)."""
    return Message(Error(ERROR_CODES[why], reason), reply_to=message)


def push_reply(client: Any, reply: Message, context: Any) -> None:
    """Hand the task's reply to the SuperNode, which sends it to the coordinator."""
    push_message(client, reply, context)


def finish_task(client: Any, heartbeat: Any, completed: bool, details: str = "", context: Any = None) -> None:
    """Report the task's end (``completed`` or failed, with ``details``), stop its heartbeat, close ``client``.

    Best effort: the other end may already be gone (a stopped SuperLink, a restarted SuperNode).
    """
    try:
        client.PushTaskOutput(PushTaskOutputRequest(
            context=None if context is None else context_to_proto(context),
            sub_status=SubStatus.COMPLETED if completed else SubStatus.FAILED, details=details))
    except Exception as exc:
        log.warning("could not report the task's end to Flower: %s", exc)
    finally:
        if heartbeat is not None and heartbeat.is_running:
            heartbeat.stop()
        client.close()

