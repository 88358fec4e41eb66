"""The site's differential-privacy step on what FedIOD's generator learns, and its accounting.

Where the coordinator's generator needs gradients through a site's teacher ``T_k`` or
discriminator ``D_k`` (both trained on the site's private images), the site releases only the
vector-Jacobian product with respect to the generated images ``x`` (never a weight). Before it
leaves, the whole release (all images of the step, one vector) is clipped to L2 norm ``C`` and
Gaussian noise of standard deviation ``sigma * C`` is added to every element: the gradient
sanitisation of DP-CGAN / GS-WGAN.

Accounting (deliberately conservative, see ``docs/architecture.md``): the released gradient is a
function of the *whole* local dataset (the teacher saw all of it), so no subsampling
amplification is claimed (sample rate 1), and two neighbouring datasets may move a clipped
vector by up to ``2C``, so each release is a Gaussian mechanism with noise multiplier
``sigma / 2``. Opacus's RDP accountant composes the releases into ``(epsilon, delta)``.
The teachers' logits and the discriminators' scores are sent unnoised and are *not* covered
by this epsilon.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import ConfigError
from engine.fl.setting_bounds import bounded, number

if TYPE_CHECKING:  # torch is imported where it is used: site.toml parsing needs only PrivacySetting
    import torch

#: Default delta of the reported (epsilon, delta) guarantee.
DEFAULT_DELTA = 1e-5


@dataclass(frozen=True)
class PrivacySetting:
    """A site's privacy knob (``site.toml`` ``[privacy]`` or the simulation's settings).

    Attributes
    ----------
    noise_multiplier
        ``sigma``: noise standard deviation in units of the clipping norm; 0 = no noise (no DP).
    epsilon
        Target epsilon for the whole run; when set, the site picks the smallest ``sigma`` that
        meets it for the run's number of releases (``noise_multiplier`` must then be 0).
    clip_norm
        ``C``: L2 bound of one release (all images of one step together).
    delta
        Delta of the reported guarantee.
    """

    # hard bounds of the default a coordinator may sign for sites without their own ([training]
    # fediod_dp_*; engine.fl.fediod_config.OPTIONS); a site's own [privacy] is checked below
    noise_multiplier: float = bounded(0.0, number(0.0, 100.0, help="noise std in units of the clip norm (0: no DP)"))
    epsilon: float | None = bounded(None, number(0.0, 1e6, low_open=True, nullable=True, null_means="no target",
                                                 help="epsilon target for the whole run"))
    clip_norm: float = bounded(1.0, number(0.0, 1e6, low_open=True, help="L2 bound of one release"))
    delta: float = bounded(DEFAULT_DELTA, number(0.0, 1.0, low_open=True, high_open=True,
                                                 help="delta of the reported guarantee"))

    def __post_init__(self) -> None:
        if not math.isfinite(self.noise_multiplier) or self.noise_multiplier < 0:
            raise ConfigError(f"privacy noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if self.epsilon is not None and (not math.isfinite(self.epsilon) or self.epsilon <= 0):
            raise ConfigError(f"privacy epsilon must be > 0, got {self.epsilon}; leave it out for no target")
        if self.epsilon is not None and self.noise_multiplier > 0:
            raise ConfigError("give either a privacy epsilon target or a noise_multiplier, not both")
        if not math.isfinite(self.clip_norm) or self.clip_norm <= 0:
            raise ConfigError(f"privacy clip_norm must be > 0, got {self.clip_norm}")
        if not 0 < self.delta < 1:
            raise ConfigError(f"privacy delta must lie in (0, 1), got {self.delta}")

    @property
    def enabled(self) -> bool:
        """True when the site adds noise (a finite epsilon is reported)."""
        return self.epsilon is not None or self.noise_multiplier > 0

    def resolved_noise(self, releases: int) -> float:
        """``sigma`` the site uses for a run of ``releases`` noised gradients."""
        if self.epsilon is None:
            return self.noise_multiplier
        if releases < 1:
            raise ConfigError(f"a privacy target needs the number of releases, got {releases}")
        from opacus.accountants.utils import get_noise_multiplier

        # The accountant's multiplier is sigma / 2 (sensitivity 2C, see the module docstring).
        return 2.0 * get_noise_multiplier(target_epsilon=self.epsilon, target_delta=self.delta,
                                          sample_rate=1.0, steps=releases, accountant="rdp")


def clip_and_noise(gradient: torch.Tensor, clip_norm: float, noise_multiplier: float,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, float]:
    """Clip ``gradient`` (as one vector) to L2 norm ``clip_norm``, then add ``N(0, (sigma C)^2)`` per element.

    ``generator``: a seeded torch generator for noise that repeats (a simulation); ``None`` (a
    network site) draws the noise from the operating system's secure generator
    (:func:`engine.fl.secure_noise.secure_gaussian`), which no one can predict or repeat.

    Returns
    -------
    released, norm
        The sanitised gradient (same shape, float32) and the norm before clipping (kept at
        the site; it is not released).
    """
    import torch

    g = gradient.detach().to(torch.float32)
    norm = float(torch.linalg.vector_norm(g))
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    released = g * scale
    if noise_multiplier > 0:
        std = noise_multiplier * clip_norm
        if generator is None:
            from engine.fl.secure_noise import secure_gaussian

            noise = secure_gaussian(g.shape, std)
        else:
            noise = torch.randn(g.shape, generator=generator, dtype=torch.float32) * std
        released = released + noise.to(g.device)
    return released, norm


def epsilon_spent(noise_multiplier: float, releases: int, delta: float = DEFAULT_DELTA) -> float:
    """Epsilon of ``releases`` noised gradients at ``noise_multiplier`` (``inf`` without noise)."""
    if releases <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier / 2.0, 1.0, releases)]
    return float(accountant.get_epsilon(delta))
