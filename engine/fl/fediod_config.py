"""FedIOD's settings and their hard bounds, without torch (the method is :mod:`engine.fl.fediod`).

Each field of :class:`FedIODConfig` declares its bounds beside it
(:func:`engine.fl.setting_bounds.bounded`). A network run's FedIOD options (``[training]``
``fediod_<name>``, signed with the run spec) are :data:`OPTIONS`: the distillation's steps and
batch, the teachers' epoch cap and patience, and the privacy setting of sites that have none of
their own (bounded where :class:`engine.fl.fediod_privacy.PrivacySetting` declares it). A site
checks them before it pulls any payload and tightens them in ``site.toml`` ``[bounds]``
(``max_fediod_steps``, ``min_fediod_dp_noise``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError
from engine.fl.fediod_privacy import PrivacySetting
from engine.fl.setting_bounds import bounded, bounds_of, integer, number


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
        Where the coordinator's and sites' networks run (each site's own choice over the network).
    """

    image_size: int = bounded(64, integer(16, 4096, multiple_of=16, help="side of the generated images"))
    steps: int = bounded(100, integer(1, 10_000, help="distillation steps per round (two exchanges each)"))
    batch: int = bounded(8, integer(2, 1024, help="generated images per step (batch norm needs 2)"))
    z_dim: int = bounded(64, integer(1, 4096, help="noise length of the generator"))
    lr_g: float = bounded(1e-3, number(0.0, 1.0, low_open=True, help="the generator's learning rate"))
    lr_s: float = bounded(1e-3, number(0.0, 1.0, low_open=True, help="the student's learning rate"))
    lr_d: float = bounded(2e-4, number(0.0, 1.0, low_open=True, help="the discriminators' learning rate"))
    teacher_epochs: int = bounded(20, integer(1, 1000, help="most epochs a site trains its teacher (once)"))
    teacher_patience: int = bounded(4, integer(1, 1000, help="epochs without a better teacher before it stops"))
    batch_size: int = bounded(8, integer(1, 4096, help="the teacher's batch size"))
    lr: float = bounded(1e-3, number(0.0, 1.0, low_open=True, help="the teacher's learning rate"))
    w_gan: float = bounded(1.0, number(0.0, 1000.0, help="weight of the adversarial loss"))
    w_consensus: float = bounded(1.0, number(0.0, 1000.0, help="weight of the consensus loss"))
    w_uniqueness: float = bounded(1.0, number(0.0, 1000.0, help="weight of the uniqueness loss"))
    w_adv: float = bounded(1.0, number(0.0, 1000.0, help="weight of the negated mimic loss"))
    w_balance: float = bounded(1.0, number(0.0, 1000.0, help="weight of the balance loss"))
    student_steps: int = bounded(1, integer(1, 1000, help="student updates per distillation step"))
    device: str = "auto"

    def __post_init__(self) -> None:
        # the declared bounds are the checks (batch >= 2: the generator's batch norm needs two images)
        broken = [p for name, bound in bounds_of(FedIODConfig).items()
                  if (p := bound.problem(name, getattr(self, name)))]
        if broken:
            raise ConfigError("FedIOD: " + "; ".join(broken))


_CONFIG = bounds_of(FedIODConfig)
_PRIVACY = bounds_of(PrivacySetting)

#: The options a coordinator may sign for FedIOD (``fediod_<name>``) and their bounds; the run's
#: image size, batch size, learning rate, seed and rounds are the spec's own (bounded there).
OPTIONS = {
    "steps": _CONFIG["steps"],
    "batch": _CONFIG["batch"],
    "teacher_epochs": _CONFIG["teacher_epochs"],
    "teacher_patience": _CONFIG["teacher_patience"],
    "dp_noise": _PRIVACY["noise_multiplier"],
    "dp_epsilon": _PRIVACY["epsilon"],
    "dp_clip": _PRIVACY["clip_norm"],
    "dp_delta": _PRIVACY["delta"],
}
#: FedIOD has no limit on its options taken together.
TOTALS = ()

__all__ = ["OPTIONS", "TOTALS", "FedIODConfig"]
