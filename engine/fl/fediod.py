"""FedIOD (Gong et al., "Federated Learning via Input-Output Collaborative Distillation", AAAI 2024).

Neither weights nor real images leave a site. Stage 1: each site trains its own teacher to
completion (early stopping on its validation split). Stage 2, every distillation step:

1. the coordinator's generator ``G`` maps noise to images ``x`` and sends them (``query``);
2. each site updates its discriminator ``D_k`` on real local images against ``x`` (Eq. 2) and
   answers with its teacher's logits ``z_k = T_k(x)`` and ``D_k(x)``;
3. the coordinator combines the adversarial, consensus, uniqueness, balance and (negated)
   mimic losses (:mod:`engine.fl.fediod_losses`) into the generator's loss, and sends each site
   the loss's gradient with respect to the site's answers (``gradient``);
4. each site returns the vector-Jacobian product with respect to ``x`` only, clipped and noised
   per its own privacy setting (:mod:`engine.fl.fediod_privacy`), and ``G`` takes a step;
5. the student ``S`` takes a step towards the importance-weighted ensemble ``A`` on ``x``.

So one step is two exchanges with every site. Round 1 starts with a ``setup`` exchange (the
teachers' training); every round runs :attr:`FedIODConfig.steps` steps. The student is the
result: one U-Net, saved as a single-model bundle. Deviations from the paper are listed in
``docs/architecture.md`` (section "FedIOD").
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from engine.bundle.single import single_model_bundle
from engine.errors import ConfigError, WeightsError
from engine.fl import fediod_losses as losses
from engine.fl.evaluation import segment_with
from engine.fl.exchange import ExchangeMethod, Reply, Request, RoundDialogue
from engine.fl.fediod_nets import Generator
from engine.fl.fediod_privacy import DEFAULT_DELTA, PrivacySetting, epsilon_spent
from engine.fl.fediod_site import (
    STATE_KEY,
    SiteState,
    answer_gradient,
    answer_query,
    label_frequency,
    mirror_state,
    restore_state,
    setup_site,
)
from engine.fl.local_training import Device, RoundContext
from engine.fl.methods import derived_seed
from engine.fl.weights import clone_weights
from engine.models import build_segmentation_net

if TYPE_CHECKING:
    from engine.bundle import SuperModelBundle
    from engine.fl.methods import SiteRuntime, WeightSet
    from engine.tasks import TaskSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FedIODConfig:
    """FedIOD's hyper-parameters (the coordinator's; each site's privacy setting is its own).

    Attributes
    ----------
    image_size
        Side of the generated images (the task's input size).
    steps
        Distillation steps per round.
    batch
        Generated images per step.
    z_dim
        Noise length of the generator.
    lr_g, lr_s, lr_d
        Adam learning rates of the generator, the student and the sites' discriminators.
    teacher_epochs, teacher_patience, batch_size, lr
        Stage 1: at most this many epochs, stop after ``patience`` epochs without a better
        validation Dice; the teacher's batch size and learning rate.
    w_gan, w_consensus, w_uniqueness, w_adv, w_balance
        Weights of the generator's loss terms (``w_adv`` multiplies the negated mimic loss).
    student_steps
        Student updates per distillation step (on the step's images).
    device
        Where the coordinator's and sites' networks run.
    """

    image_size: int = 64
    steps: int = 100
    batch: int = 8
    z_dim: int = 64
    lr_g: float = 1e-3
    lr_s: float = 1e-3
    lr_d: float = 2e-4
    teacher_epochs: int = 20
    teacher_patience: int = 4
    batch_size: int = 8
    lr: float = 1e-3
    w_gan: float = 1.0
    w_consensus: float = 1.0
    w_uniqueness: float = 1.0
    w_adv: float = 1.0
    w_balance: float = 1.0
    student_steps: int = 1
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.steps < 1 or self.student_steps < 1:
            raise ConfigError(f"FedIOD steps and student_steps must be >= 1, got {self.steps}, {self.student_steps}")
        if self.batch < 2:
            raise ConfigError(f"FedIOD needs at least 2 generated images per step (batch norm), got {self.batch}")
        if self.image_size < 16 or self.image_size % 16:
            raise ConfigError(f"image_size must be a multiple of 16, got {self.image_size}")
        for name in ("lr_g", "lr_s", "lr_d", "lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"FedIOD {name} must be > 0, got {getattr(self, name)}")


class FedIOD(ExchangeMethod):
    """FedIOD as a dialogue method (server half: generator and student; site half: teacher and D_k).

    Parameters
    ----------
    config
        Coordinator hyper-parameters.
    privacy
        Privacy setting of a site that has none of its own (``site.state["privacy"]``).
    """

    name = "fediod"
    REQUEST_CONTENTS: ClassVar[dict[str, str]] = {
        "images": "images generated by the coordinator's generator (no real data)",
        "logit_grad": "gradient of the generator's loss w.r.t. this site's teacher logits",
        "score_grad": "gradient of the generator's loss w.r.t. this site's discriminator scores",
    }
    REPLY_CONTENTS: ClassVar[dict[str, str]] = {
        "label_frequency": "fraction of the site's training pixels that are foreground, per label (once)",
        "logits": "the site's teacher's logits on the generated images",
        "scores": "the site's discriminator's real/generated scores on the generated images",
        "input_grad": "gradient w.r.t. the generated images only (clipped and noised per the site's setting)",
    }

    def __init__(self, task: TaskSpec, site_names: list[str], seed: int = 0, rounds: int = 1,
                 config: FedIODConfig | None = None, privacy: PrivacySetting | None = None) -> None:
        super().__init__(task, site_names, seed, rounds)
        self.config = config or FedIODConfig()
        self.privacy = privacy or PrivacySetting()

    # --- server half -----------------------------------------------------------------------
    def _student(self) -> torch.nn.Module:
        return build_segmentation_net(self.task.in_channels, self.task.out_channels)

    def _generator(self) -> Generator:
        return Generator(self.config.z_dim, self.task.in_channels, self.config.image_size)

    def initial_state(self) -> WeightSet:
        k, labels = len(self.site_names), self.task.out_channels
        torch.manual_seed(derived_seed(self.seed, "fediod", "student") % (2**63))
        student = clone_weights(self._student().state_dict())
        torch.manual_seed(derived_seed(self.seed, "fediod", "generator") % (2**63))
        generator = clone_weights(self._generator().state_dict())
        stats = {"num_samples": torch.zeros(k, dtype=torch.float64),
                 "label_frequency": torch.zeros(k, labels, dtype=torch.float64),
                 "teacher_val_dice": torch.full((k,), float("nan"), dtype=torch.float64)}
        privacy = {"noise_multiplier": torch.zeros(k, dtype=torch.float64),
                   "releases": torch.zeros(k, dtype=torch.float64),
                   "delta": torch.full((k,), DEFAULT_DELTA, dtype=torch.float64)}
        return {"student": student, "generator": generator, "stats": stats, "privacy": privacy}

    def _setup_config(self) -> dict[str, Any]:
        c = self.config
        return {"teacher_epochs": c.teacher_epochs, "teacher_patience": c.teacher_patience,
                "batch_size": c.batch_size, "lr": c.lr, "lr_d": c.lr_d, "device": c.device,
                "releases": c.steps * self.rounds}

    def dialogue(self, state: WeightSet, rnd: int) -> RoundDialogue:
        c = self.config
        state = {part: dict(weights) for part, weights in state.items()}
        state["stats"] = {k: v.clone() for k, v in state["stats"].items()}
        state["privacy"] = {k: v.clone() for k, v in state["privacy"].items()}
        stats, privacy = state["stats"], state["privacy"]
        if float(stats["num_samples"].sum()) == 0:
            requests = {s: Request("setup", config={**self._setup_config(),
                                                     "seed": derived_seed(self.seed, "fediod-site", s)})
                        for s in self.site_names}
            answers = yield requests
            for i, site in enumerate(self.site_names):
                reply = answers.get(site)
                if isinstance(reply, Reply):
                    stats["num_samples"][i] = float(reply.num_samples)
                    stats["label_frequency"][i] = reply.tensors["label_frequency"].to(torch.float64)
                    stats["teacher_val_dice"][i] = float(reply.metrics.get("teacher_val_dice", math.nan))
                    privacy["noise_multiplier"][i] = float(reply.metrics.get("noise_multiplier", 0.0))
                    privacy["delta"][i] = float(reply.metrics.get("delta", DEFAULT_DELTA))
        active = [i for i in range(len(self.site_names)) if stats["num_samples"][i] > 0]
        if not active:
            log.warning("fediod round %d: no site has a teacher; nothing to distil", rnd)
            return state

        device = Device.resolve(c.device).torch_device
        generator, student = self._generator().to(device), self._student().to(device)
        generator.load_state_dict(state["generator"])
        student.load_state_dict(state["student"])
        generator.train()
        student.train()
        opt_g = torch.optim.Adam(generator.parameters(), lr=c.lr_g, betas=(0.5, 0.999))
        opt_s = torch.optim.Adam(student.parameters(), lr=c.lr_s, betas=(0.9, 0.999))
        noise = torch.Generator()
        noise.manual_seed(derived_seed(self.seed, "fediod-noise", rnd) % (2**63))
        for step in range(c.steps):
            global_step = (rnd - 1) * c.steps + step
            w = torch.randn(c.batch, c.z_dim, generator=noise).to(device)
            x = generator(w)
            answers = yield {self.site_names[i]: Request("query", {"images": x.detach().cpu()},
                                                         {"step": global_step, "round": rnd, "steps": c.steps})
                             for i in active}
            ok = [i for i in active if isinstance(answers.get(self.site_names[i]), Reply)]
            if not ok:
                log.warning("fediod round %d step %d: no site answered", rnd, step)
                continue
            replies = [answers[self.site_names[i]] for i in ok]
            assert all(isinstance(r, Reply) for r in replies)
            logits = torch.stack([r.tensors["logits"] for r in replies]).to(device).requires_grad_(True)  # type: ignore[union-attr]
            scores = [r.tensors["scores"].to(device).requires_grad_(True) for r in replies]  # type: ignore[union-attr]
            site_w = stats["num_samples"][ok] / stats["num_samples"][ok].sum()
            fg, bg = losses.class_weights(stats["num_samples"][ok], stats["label_frequency"][ok])
            federation_freq = (site_w.view(-1, 1) * stats["label_frequency"][ok]).sum(0)
            terms = self._generator_terms(logits, scores, student(x), site_w.to(device), fg.to(device),
                                          bg.to(device), federation_freq.to(device))
            loss_g = sum(getattr(c, f"w_{name}") * value * (-1.0 if name == "adv" else 1.0)
                         for name, value in terms.items())
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward(retain_graph=True)  # type: ignore[union-attr]
            # the cotangents are scaled by the batch size so a site's release is the gradient of
            # the per-image loss summed over images (the scale its clipping norm refers to)
            requests = {self.site_names[i]: Request("gradient", {
                "logit_grad": (logits.grad[j] * c.batch).cpu(),  # type: ignore[index]
                "score_grad": (scores[j].grad * c.batch).cpu()}, {"step": global_step})  # type: ignore[operator]
                for j, i in enumerate(ok)}
            answers = yield requests
            grads = [answers[self.site_names[i]] for i in ok]
            input_grad = sum((g.tensors["input_grad"].to(device) for g in grads if isinstance(g, Reply)),
                             torch.zeros_like(x))
            for i in ok:
                reply = answers.get(self.site_names[i])
                if isinstance(reply, Reply):
                    privacy["releases"][i] += 1
            x.backward(input_grad / c.batch)
            opt_g.step()
            target = losses.ensemble_logits(logits.detach(), losses.importance_weights(
                torch.sigmoid(logits.detach()), site_w.to(device), fg.to(device), bg.to(device)))
            images = x.detach()
            for _ in range(c.student_steps):
                opt_s.zero_grad(set_to_none=True)
                mimic = losses.mimic_loss(student(images), target)
                mimic.backward()
                opt_s.step()
            if step % 20 == 0 or step == c.steps - 1:
                log.info("fediod round %d step %d: %s mimic=%.4f", rnd, step,
                         " ".join(f"{k}={float(v.detach()):.4f}" for k, v in terms.items()), float(mimic.detach()))
        state["generator"] = clone_weights({k: v.detach().cpu() for k, v in generator.state_dict().items()})
        state["student"] = clone_weights({k: v.detach().cpu() for k, v in student.state_dict().items()})
        return state

    @staticmethod
    def _generator_terms(logits: torch.Tensor, scores: list[torch.Tensor], student_logits: torch.Tensor,
                         site_w: torch.Tensor, fg: torch.Tensor, bg: torch.Tensor,
                         federation_freq: torch.Tensor) -> dict[str, torch.Tensor]:
        """The generator's loss terms for one step (see :mod:`engine.fl.fediod_losses`)."""
        q = torch.sigmoid(logits)
        pi = losses.importance_weights(q, site_w, fg, bg)
        ensemble = losses.ensemble_logits(logits, pi)
        return {
            "gan": losses.generator_gan_loss(scores, site_w),
            "consensus": losses.consensus_loss(logits, site_w),
            "uniqueness": losses.jensen_shannon(q, site_w),
            "balance": losses.balance_loss(torch.sigmoid(ensemble), federation_freq),
            "adv": losses.mimic_loss(student_logits, ensemble),
        }

    # --- site half -------------------------------------------------------------------------
    def answer(self, request: Request, site: SiteRuntime, progress: Any = None, cancel: Any = None) -> Reply:
        n = len(site.train.images)
        if request.action == "setup":
            ctx = RoundContext(self.name, 1, site.name, progress, cancel)
            state = setup_site(self.task, site, request.config, self.privacy, ctx)
            site.state[STATE_KEY] = state
            mirror_state(site, state)
            freq = torch.from_numpy(label_frequency(site.train.masks))
            metrics = {**state.teacher_metrics, "noise_multiplier": state.noise_multiplier,
                       "delta": state.privacy.delta}
            # only finite numbers travel (a transport may encode metrics as strict JSON)
            return Reply({"label_frequency": freq}, {k: v for k, v in metrics.items() if math.isfinite(v)}, n)
        state = site.state.get(STATE_KEY)
        if not isinstance(state, SiteState):
            state = restore_state(self.task, site, self.config.device)
            if state is None:
                raise WeightsError(f"{site.name} has no FedIOD teacher yet; the run must start with a setup request")
            site.state[STATE_KEY] = state
        step = int(request.config.get("step", -1))
        if request.action == "query":
            logits, scores, d_loss = answer_query(state, site.train, request.tensors["images"], step)
            mirror_state(site, state, teacher=False)
            if progress is not None:
                steps = int(request.config.get("steps", 0))
                progress({"event": "batch", "method": self.name, "round": int(request.config.get("round", 0)),
                          "site": site.name, "batch": step % steps + 1 if steps else step + 1,
                          "batches": steps, "loss": {"discriminator": round(d_loss, 5)}})
            return Reply({"logits": logits, "scores": scores}, {"d_loss": d_loss} if math.isfinite(d_loss) else {}, n)
        if request.action == "gradient":
            grad = answer_gradient(state, step, request.tensors["logit_grad"], request.tensors["score_grad"])
            mirror_state(site, state, teacher=False)
            return Reply({"input_grad": grad}, {"releases": float(state.releases)}, n)
        raise WeightsError(f"unknown FedIOD request {request.action!r}")

    def validate_reply(self, request: Request, site: str, reply: Reply) -> None:
        super().validate_reply(request, site, reply)
        c, labels = self.config, self.task.out_channels
        s = c.image_size
        expected: dict[str, tuple[int, ...]] = {
            "setup": {"label_frequency": (labels,)},
            "query": {"logits": (c.batch, labels, s, s), "scores": (c.batch, 1, s // 8, s // 8)},
            "gradient": {"input_grad": (c.batch, self.task.in_channels, s, s)},
        }.get(request.action, {})  # type: ignore[assignment]
        for name, shape in expected.items():  # type: ignore[attr-defined]
            got = reply.tensors.get(name)
            if got is None or tuple(got.shape) != shape:
                raise WeightsError(f"reply of {site} to {request.action!r}: {name} must have shape {shape}, "
                                   f"got {None if got is None else tuple(got.shape)}")
        freq = reply.tensors.get("label_frequency")
        if freq is not None and ((freq < 0).any() or (freq > 1).any()):
            raise WeightsError(f"reply of {site}: label frequencies must lie in [0, 1]")
        if request.action == "setup" and reply.num_samples < 1:
            raise WeightsError(f"reply of {site}: a site with no training images cannot teach")

    def max_reply_bytes(self) -> int:
        """Largest reply: a query's logits and scores, or a gradient request's input gradient (float32)."""
        c, s = self.config, self.config.image_size
        query = self.task.out_channels * s * s + (s // 8) ** 2
        return 4 * c.batch * max(query, self.task.in_channels * s * s)

    # --- evaluation and results ------------------------------------------------------------
    def segmenter(self, state: WeightSet, sites: list[SiteRuntime],
                  device: str = "auto") -> Callable[[int, np.ndarray], np.ndarray]:
        student = state["student"]
        return lambda k, images: segment_with(self.task, student, images, device)

    def site_segmenters(self, sites: list[SiteRuntime], device: str = "auto"
                        ) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
        """Each site's own teacher as a segmenter (simulation only: "Standalone" in the paper's tables)."""
        out: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
        dev = Device.resolve(device).torch_device
        for site in sites:
            state = site.state.get(STATE_KEY)
            if isinstance(state, SiteState):
                out[site.name] = _net_segmenter(state.teacher, dev)
        return out

    def epsilons(self, state: WeightSet) -> dict[str, float | None]:
        """Epsilon each site spent on the run (``None``: the site added no noise, no guarantee)."""
        p = state["privacy"]
        out: dict[str, float | None] = {}
        for i, site in enumerate(self.site_names):
            eps = epsilon_spent(float(p["noise_multiplier"][i]), int(p["releases"][i]), float(p["delta"][i]))
            out[site] = eps if math.isfinite(eps) else None
        return out

    def report_extra(self, state: WeightSet, sites: list[SiteRuntime]) -> dict[str, Any]:
        """Privacy per site and the teachers' validation Dice (added to the simulation report)."""
        p = state["privacy"]
        return {
            "epsilon": self.epsilons(state),
            "delta": {s: float(p["delta"][i]) for i, s in enumerate(self.site_names)},
            "noise_multiplier": {s: float(p["noise_multiplier"][i]) for i, s in enumerate(self.site_names)},
            "releases": {s: int(p["releases"][i]) for i, s in enumerate(self.site_names)},
            "teacher_val_dice": {s: _finite_or_none(float(state["stats"]["teacher_val_dice"][i]))
                                 for i, s in enumerate(self.site_names)},
            "label_frequency": {s: state["stats"]["label_frequency"][i].tolist()
                                for i, s in enumerate(self.site_names)},
        }


    def bundle(self, state: WeightSet, extra: Mapping[str, Any] | None = None,
               val_dice: Mapping[str, float | None] | None = None) -> SuperModelBundle:
        """The distilled student as a single-model bundle whose metadata says how it was made.

        ``extra`` adds free-form details (e.g. the seed); ``val_dice`` is the student's
        validation Dice per site where measured.
        """
        p = state["privacy"]
        return single_model_bundle(
            self.task.name, "fediod", state["student"], self.site_names, self.config.image_size, self.rounds,
            val_dice, {"distilled": True, "epsilon": self.epsilons(state),
                       "delta": {s: float(p["delta"][i]) for i, s in enumerate(self.site_names)},
                       "noise_multiplier": {s: float(p["noise_multiplier"][i]) for i, s in enumerate(self.site_names)},
                       "distillation_steps": self.config.steps * self.rounds, **dict(extra or {})})


    # --- the end of a network run: the student at every site ---------------------------------
    #: What the coordinator sends each site once, after the last round.
    FINAL_CONTENTS: ClassVar[dict[str, str]] = {
        "student": "the distilled student U-Net (the run's result), sent once after the last round",
    }

    def final_models(self, state: WeightSet, site: str) -> dict[str, dict[str, torch.Tensor]]:
        """Server half, after the last round: what ``site`` receives (the student, the same for every site)."""
        return {"student": state["student"]}

    def site_bundle(self, received: Mapping[str, Mapping[str, torch.Tensor]], site: SiteRuntime, image_size: int,
                    extra: Mapping[str, Any] | None = None) -> SuperModelBundle:
        """Site half: the received student as a single-model bundle, with the privacy this site spent.

        ``received`` holds the :attr:`FINAL_CONTENTS` parts (the transport checked their names and that
        they are finite); a student of another shape raises :class:`WeightsError`. The bundle records
        only this site's own epsilon (the coordinator sends no other site's privacy figures).
        """
        student = dict(received["student"])
        try:
            self._student().load_state_dict(student)
        except RuntimeError as exc:
            raise WeightsError(f"the student the coordinator sent does not fit this run's U-Net "
                               f"({str(exc).splitlines()[0]})") from None
        spent: dict[str, Any] = {}
        state = site.state.get(STATE_KEY)
        if isinstance(state, SiteState):
            spent = {"epsilon": {site.name: _finite_or_none(state.epsilon)}, "releases": {site.name: state.releases},
                     "noise_multiplier": {site.name: state.noise_multiplier}}
        return single_model_bundle(
            self.task.name, "fediod", student, self.site_names, image_size or self.config.image_size, self.rounds,
            None, {"distilled": True, "assembled_at": site.name, "distillation_steps": self.config.steps * self.rounds,
                   **spent, **dict(extra or {})})


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _net_segmenter(net: torch.nn.Module, device: torch.device) -> Callable[[np.ndarray], np.ndarray]:
    def predict(images: np.ndarray) -> np.ndarray:
        net.eval()
        out = []
        with torch.inference_mode():
            for start in range(0, len(images), 16):
                x = torch.from_numpy(images[start:start + 16]).to(device)
                out.append((net(x).float() > 0).cpu().numpy().astype(np.uint8))
        return np.concatenate(out) if out else np.zeros((0,), np.uint8)

    return predict


def build_fediod(name: str, task: TaskSpec, site_names: list[str], settings: Mapping[str, Any]) -> FedIOD:
    """Registry factory: FedIOD from a run's flat settings (``fedsm simulate`` or the network spec).

    Keys read (all optional): ``seed``, ``rounds``, ``image_size``, ``batch_size``, ``lr``,
    ``device``, ``fediod_steps``, ``fediod_batch``, ``teacher_epochs``, ``teacher_patience``,
    and the default privacy setting of sites without their own: ``dp_noise``, ``dp_epsilon``,
    ``dp_clip``, ``dp_delta``. Each FedIOD key may also be written with the ``fediod_`` prefix
    (``fediod_teacher_epochs``, ``fediod_dp_noise``): that is how ``federation.toml``'s
    ``[training]`` passes a dialogue method's options (:class:`engine.federation.spec.MethodSpec`).
    """
    def get(key: str, default: Any) -> Any:
        value = settings.get(f"fediod_{key}", settings.get(key))
        return default if value is None else value

    config = FedIODConfig(
        image_size=int(get("image_size", 64)), steps=int(get("fediod_steps", 100)),
        batch=int(get("fediod_batch", 8)), teacher_epochs=int(get("teacher_epochs", 20)),
        teacher_patience=int(get("teacher_patience", 4)), batch_size=int(get("batch_size", 8)),
        lr=float(get("lr", 1e-3)), device=str(get("device", "auto")))
    privacy = PrivacySetting(noise_multiplier=float(get("dp_noise", 0.0)),
                             epsilon=None if get("dp_epsilon", None) is None else float(get("dp_epsilon", None)),
                             clip_norm=float(get("dp_clip", 1.0)), delta=float(get("dp_delta", DEFAULT_DELTA)))
    return FedIOD(task, site_names, int(get("seed", 0)), int(get("rounds", 1)), config, privacy)


__all__ = ["FedIOD", "FedIODConfig", "build_fediod"]
