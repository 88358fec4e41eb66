"""The dialogue transport's messages: round trips, strict decoding, and the site's consent to share activations."""

from types import SimpleNamespace

import pytest
import torch

from engine.errors import ConfigError, WeightsError
from engine.federation.flower.dialogue import (
    answer_exchange,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
from engine.fl.exchange import Reply, Request


def test_request_and_reply_round_trip():
    request = Request("client_probe", {"losses": torch.arange(4, dtype=torch.float64)}, {"round": 2, "step": 1})
    content = encode_request(request, rnd=2, rounds=3, method="blackfed-v1", spec_json="{}", session="s1",
                             site="site1", exchange_id=7)
    info, back = decode_request(content)
    assert info["exchange"] == 7 and info["site"] == "site1" and back.action == "client_probe"
    assert back.config == {"round": 2, "step": 1} and torch.equal(back.tensors["losses"], request.tensors["losses"])
    reply = Reply({"activations": torch.ones(2, 3, 4, 4), "masks": torch.zeros(1, 2, 4, 4, dtype=torch.uint8)},
                  {"loss": 0.5}, 6)
    got = decode_reply(encode_reply(reply, site="site1", rnd=2, exchange_id=7), "site1", 2, 7)
    assert got.num_samples == 6 and got.metrics == {"loss": 0.5}
    assert got.tensors["masks"].dtype == torch.uint8 and torch.equal(got.tensors["activations"], torch.ones(2, 3, 4, 4))
    empty = decode_request(encode_request(Request("server_batch"), rnd=1, rounds=1, method="m", spec_json="{}",
                                          session="s", site="a", exchange_id=1))[1]
    assert empty.tensors == {}


def test_a_reply_for_another_exchange_or_site_is_refused():
    content = encode_reply(Reply({}, {}, 3), site="site1", rnd=1, exchange_id=4)
    with pytest.raises(WeightsError, match="claims"):
        decode_reply(content, "site1", 1, 5)
    with pytest.raises(WeightsError, match="claims"):
        decode_reply(content, "site2", 1, 4)


def test_a_site_that_did_not_agree_does_not_answer_blackfed(tmp_path):
    from engine.federation.spec import MethodSpec, build_method

    spec = MethodSpec(method="blackfed-v1", task="fundus", site_names=("site1",), image_size=32)
    method = build_method(spec, "cpu")
    worker = SimpleNamespace(cfg=SimpleNamespace(name="site1", share_activations=False),
                             method=lambda spec_json: (method, spec))
    content = encode_request(Request("client_probe", {}, {"round": 1, "step": 0}), rnd=1, rounds=1,
                             method="blackfed-v1", spec_json=spec.to_json(), session="s", site="site1", exchange_id=1)
    with pytest.raises(ConfigError, match="share_activations"):
        answer_exchange(worker, content)


def test_blackfed_options_travel_in_the_spec():
    from engine.federation.spec import MethodSpec, build_method

    spec = MethodSpec.from_dict({"method": "blackfed-v2", "task": "fundus", "site_names": ["a", "b"],
                                 "image_size": 32, "blackfed_client_epochs": 3})
    assert spec.options == {"blackfed_client_epochs": 3}
    assert MethodSpec.from_json(spec.to_json()) == spec
    method = build_method(spec, "cpu")
    assert method.config.client_epochs == 3 and method.config.image_size == 32 and method.variant == "v2"
    with pytest.raises(ConfigError, match="unknown training setting"):
        MethodSpec.from_dict({"method": "fedavg", "task": "fundus", "site_names": ["a"], "blackfed_x": 1})


def test_the_upload_limit_fits_blackfeds_largest_reply():
    from testsupport import random_split

    from engine.federation.flower.dialogue import dialogue_reply_limit
    from engine.federation.flower.upload_limits import MIN_REPLY_LIMIT
    from engine.fl.blackfed import BlackFed, BlackFedConfig
    from engine.fl.exchange import Reply, Request
    from engine.fl.methods import SiteRuntime
    from engine.tasks import FUNDUS

    method = BlackFed(FUNDUS, ["a"], config=BlackFedConfig(batch_size=4, perturbations=2, image_size=32))
    site = SiteRuntime("a", 0, random_split(6, size=32))
    reply = method.answer(Request("client_probe", {}, {"round": 1, "step": 0}), site)
    assert isinstance(reply, Reply)
    assert method.max_reply_bytes() == sum(t.numel() * t.element_size() for t in reply.tensors.values())
    assert dialogue_reply_limit(method) == MIN_REPLY_LIMIT  # small images: the floor
    big = BlackFed(FUNDUS, ["a"], config=BlackFedConfig(image_size=256))
    assert dialogue_reply_limit(big) == 2 * big.max_reply_bytes() + 16 * 2**20


def test_bounds_leave_blackfed_to_the_consent_unless_the_site_listed_its_own_methods():
    from types import SimpleNamespace

    from engine.federation.flower.site import site_bounds
    from engine.federation.spec import MethodSpec

    agreed = site_bounds(SimpleNamespace(bounds={}, share_activations=True))
    own = site_bounds(SimpleNamespace(bounds={"allowed_methods": ["fedavg"]}, share_activations=True))
    spec = MethodSpec(method="blackfed-v2", task="fundus", site_names=("a", "b"), rounds=1, image_size=32,
                      batch_size=4, selector_lr=1e-5).as_dict()
    assert own.violations(spec)  # the operator's own list wins
    assert agreed.violations(spec) == []
    # a spec leaving selector_lr to the scheme's default (None) is checked with that default
    assert agreed.violations({**spec, "selector_lr": None}) == []
