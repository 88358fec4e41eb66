"""The one module that speaks Flower's Runtime API: error answers and a task's end, without a SuperNode."""

from __future__ import annotations

import pytest
from flwr.app import Message, RecordDict
from flwr.common.constant import ErrorCode

from engine.federation.flower.runtime_api import ERROR_CODES, error_reply, finish_task


def _instruction() -> Message:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as a task's process (FakeGrid)
    return Message(RecordDict(), dst_node_id=7, message_type="train")


@pytest.mark.parametrize(("why", "code"), [("app_not_approved", ErrorCode.INVALID_FAB),
                                           ("refused", ErrorCode.MOD_FAILED_PRECONDITION),
                                           ("failed", ErrorCode.CLIENT_APP_RAISED_EXCEPTION)])
def test_a_sites_error_answer_carries_flowers_code_and_the_reason(why, code):
    reply = error_reply(_instruction(), why, "the operator declined")
    assert reply.has_error() and not reply.has_content()
    assert reply.error.code == code and reply.error.reason == "the operator declined"


def test_an_unknown_kind_of_error_is_a_programming_error():
    assert set(ERROR_CODES) == {"app_not_approved", "refused", "failed"}
    with pytest.raises(KeyError):
        error_reply(_instruction(), "declined", "no")


class _Client:
    def __init__(self, fails: bool) -> None:
        self.fails, self.sent, self.closed = fails, [], False

    def PushTaskOutput(self, request):  # Flower's method name
        if self.fails:
            raise ConnectionError("the SuperLink is gone")
        self.sent.append(request)

    def close(self) -> None:
        self.closed = True


class _Heartbeat:
    is_running = True

    def stop(self) -> None:
        self.is_running = False


@pytest.mark.parametrize("completed", [True, False])
def test_a_task_end_is_reported_with_its_status(completed):
    client, heartbeat = _Client(fails=False), _Heartbeat()
    finish_task(client, heartbeat, completed, "" if completed else "the site stopped")
    (sent,) = client.sent
    assert sent.sub_status == ("completed" if completed else "failed")
    assert sent.details == ("" if completed else "the site stopped")
    assert not heartbeat.is_running and client.closed


def test_a_task_end_that_cannot_be_reported_still_stops_the_heartbeat_and_closes(caplog):
    client, heartbeat = _Client(fails=True), _Heartbeat()
    finish_task(client, heartbeat, True)
    assert not heartbeat.is_running and client.closed
    assert "could not report the task's end" in caplog.text
