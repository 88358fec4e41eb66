"""A dialogue method's coordinator (BlackFed over :class:`DialogueRunner`) survives whatever sites answer.

# Prepare: BlackFed's server half at 32 px and a grid whose two "sites" answer every exchange
#          as a hostile site would: a reply whose layout declares a [2^32, 2^32] tensor, and a
#          reply of valid shapes claiming 10^12 training images; then a dialogue that raises on
#          the sites' answers, and one whose result holds NaN.
# Execute: one round each.
# Assert: the round ends (no exception), every hostile answer is left out with an ``error``
#         event naming its site and the reason, and the model is the one from before the round.
"""

from __future__ import annotations

import json

import pytest
import torch
from fakegrid import over_the_wire
from test_server_app import assert_same_state

from engine.federation.events import EventWriter
from engine.federation.flower import records
from engine.federation.flower.dialogue import DialogueRunner, decode_request, encode_reply
from engine.federation.flower.server_app import RegisteredSites, RoundSettings
from engine.federation.spec import MethodSpec, build_method
from engine.fl.exchange import Reply

SITES = ("site1", "site2")
NODES = {"site1": 11, "site2": 12}


class AnsweringGrid:
    """Sites by node id, answering each exchange with ``answer(site, request) -> RecordDict``."""

    def __init__(self, answer) -> None:
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0  # as FakeGrid
        self.answer = answer
        self.replies: dict[str, object] = {}

    def get_nodes(self):
        from types import SimpleNamespace

        return [SimpleNamespace(node_id=n, status="online") for n in NODES.values()]

    def push_messages(self, messages):
        from flwr.app import Message

        ids = []
        for message in messages:
            received = over_the_wire(message)
            ids.append(received.metadata.message_id)
            site = next(s for s, n in NODES.items() if n == message.metadata.dst_node_id)
            info, request = decode_request(received.content)
            reply = Message(self.answer(site, info, request), reply_to=received)
            self.replies[received.metadata.message_id] = over_the_wire(reply)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]


class _NoWriter:
    def submit(self, checkpoint, path):
        pass


@pytest.fixture(scope="module")
def blackfed():
    spec = MethodSpec(method="blackfed-v1", task="fundus", site_names=SITES, rounds=1, image_size=32, batch_size=2)
    return spec, build_method(spec, "cpu")


def _runner(spec, method, events, tmp_path):
    return DialogueRunner(method, spec, RoundSettings(min_sites=1, round_timeout=5.0, start_timeout=1.0,
                                                      round_attempts=1, poll_interval=0.01),
                          RegisteredSites(NODES), EventWriter("server", listener=events.append),
                          tmp_path / "ckpt.safetensors", "session1", "sha256:" + "0" * 64)


def _shaped_reply(method, request, num_samples):
    """A reply of the shapes BlackFed expects for ``request`` (zeros)."""
    if request.action == "client_update":
        return Reply({}, {}, num_samples)
    c, s, out = method.config.channels, method.config.image_size, method.task.out_channels
    copies = method.copies_per_image(request.action)
    return Reply({"activations": torch.zeros(copies, c, s, s), "masks": torch.zeros(1, out, s, s, dtype=torch.uint8)},
                 {}, num_samples)


def test_hostile_dialogue_answers_are_left_out_and_the_round_ends(blackfed, tmp_path):
    spec, method = blackfed
    events: list[dict] = []

    def answer(site, info, request):
        rnd, ex = int(info["round"]), int(info["exchange"])
        if site == "site1":  # a [2^32, 2^32] layout: decoding would reserve 2^64 values
            content = encode_reply(_shaped_reply(method, request, 4), site=site, rnd=rnd, exchange_id=ex)
            layouts = content.config_records[records.LAYOUT]
            if "reply" in layouts:
                layout = json.loads(layouts["reply"])
                layout[0][2] = [2**32, 2**32]
                layouts["reply"] = json.dumps(layout)
            else:  # a reply without tensors: a layout for tensors that are not there
                layouts["reply"] = json.dumps([["activations", "float32", [2**32, 2**32]]])
            return content
        return encode_reply(_shaped_reply(method, request, 10**12), site=site, rnd=rnd, exchange_id=ex)

    before = method.initial_state()
    state = _runner(spec, method, events, tmp_path)._round(AnsweringGrid(answer), before, 1, _NoWriter())

    end = next(e for e in events if e["event"] == "round_end")
    assert end["answered"] == [] and set(end["left_out"]) == set(SITES), end
    assert "answer rejected" in end["left_out"]["site1"], end["left_out"]
    assert "claims 1000000000000 training samples" in end["left_out"]["site2"], end["left_out"]
    for site in SITES:
        assert any(e["event"] == "error" and e["site"] == site for e in events)
    assert_same_state(state, before)


@pytest.mark.parametrize("failure", ["raises", "nan"])
def test_a_dialogue_that_fails_on_the_answers_discards_the_round(blackfed, tmp_path, failure):
    spec, method = blackfed
    events: list[dict] = []
    before = method.initial_state()
    honest = method.dialogue

    def dialogue(state, rnd):  # the method's own round, broken after the sites' first answers
        inner = honest(state, rnd)
        requests = next(inner)
        yield requests  # the sites answer
        if failure == "raises":
            raise ValueError("activations out of range")
        inner.close()
        return {part: {k: torch.full_like(v, float("nan")) if v.dtype.is_floating_point else v
                       for k, v in tensors.items()} for part, tensors in state.items()}

    def answer(site, info, request):
        return encode_reply(_shaped_reply(method, request, 4), site=site, rnd=int(info["round"]),
                            exchange_id=int(info["exchange"]))

    method.dialogue = dialogue
    try:
        state = _runner(spec, method, events, tmp_path)._round(AnsweringGrid(answer), before, 1, _NoWriter())
    finally:
        del method.dialogue

    end = next(e for e in events if e["event"] == "round_end")
    reason = "activations out of range" if failure == "raises" else "NaN or Inf"
    assert end["left_out"] and all("round 1 is discarded" in r and reason in r for r in end["left_out"].values())
    assert any(e["event"] == "error" and e["site"] in SITES and reason in e["message"] for e in events)
    assert_same_state(state, before)
