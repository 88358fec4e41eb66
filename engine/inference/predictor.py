"""Routed super-model inference: selector first, then one U-Net per image.

The cost of FedSM inference is the selector plus exactly one U-Net per image, not K + 1
U-Nets: images are grouped by the model they are routed to and each model only sees its group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.bundle.supermodel import SuperModelBundle
from engine.data.preprocess import resize_images
from engine.device import resolve_device
from engine.errors import BundleError, CancelledError, ConfigError, DataError
from engine.fl.cases import case_sizes
from engine.fl.style_gate import gate_nearest, judges_cases, route_by_style
from engine.inference.guard import apply_guard, guard_decisions, routing_reasons
from engine.inference.routing import (
    case_mean_probabilities,
    confidence,
    route_fedsm,
    route_fedsm_extra,
    routing_gamma,
)
from engine.models import build_segmentation_net, build_selector

ProgressCallback = Callable[[int, int], None]
CancelCheck = Callable[[], bool]

#: Sigmoid probability above which a pixel belongs to a structure.
MASK_THRESHOLD = 0.5


@dataclass
class Prediction:
    """Result of :meth:`SuperModelPredictor.predict` for N images (or slices).

    Attributes
    ----------
    masks
        ``uint8 (N, L, H, W)`` binary masks, one channel per label, at the input resolution.
    routed
        ``int64 (N,)`` model that segmented each image: 0 = global, k = site k.
    probabilities
        ``float32 (N, K)`` (FedSM) or ``(N, K + 1)`` (FedSM-extra) selector softmax, per image.
    confidence
        ``float32 (N,)`` the selector confidence routing compared with gamma: the largest selector
        probability of the image, or, where the bundle's gate judges cases and cases are given, the
        largest of its volume's mean probabilities (a volume is routed whole).
    reasons
        One sentence per image: why it went to its model (:mod:`engine.inference.guard`).
    guarded
        ``bool (N,)``: images the routing guard sent to the global model instead of the
        personalized model the selector chose.
    unlike_sites
        ``bool (N,)``: images the site-style gate found unlike every participating site's images
        (:mod:`engine.fl.style_gate`); they go to the global model. All ``False`` without a gate.
    nearest_site
        ``int64 (N,)``: the site (1..K) whose images each image is most alike under the gate,
        what style routing picks inside the gate; all 0 without a gate.
    style_distance
        ``float64 (N,)``: each image's distance to that site as the gate judged it (for a gate that
        judges cases, its case's mean, which the threshold bounds); NaN without a gate.
    """

    masks: np.ndarray
    routed: np.ndarray
    probabilities: np.ndarray
    confidence: np.ndarray
    reasons: list[str] = field(default_factory=list)
    guarded: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    unlike_sites: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    nearest_site: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    style_distance: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))

    def routed_names(self, site_names: Sequence[str]) -> list[str]:
        """Name of the model used per image: ``"global"`` or the site's name."""
        names = ["global", *site_names]
        return [names[int(k)] for k in self.routed]


def _fit_weights(net: nn.Module, weights: Mapping[str, torch.Tensor], what: str, where: str) -> None:
    """Load ``weights`` into ``net`` strictly, explaining any mismatch in words.

    ``load_state_dict`` would also refuse, but with a wall of text; this names the first
    few missing/unexpected keys and wrong shapes and says what to do.
    """
    expected = net.state_dict()
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    wrong_shape = [
        f"{k} is {tuple(weights[k].shape)} but the network expects {tuple(v.shape)}"
        for k, v in expected.items()
        if k in weights and tuple(weights[k].shape) != tuple(v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing key(s) (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s) (e.g. {', '.join(unexpected[:3])})")
    if wrong_shape:
        problems.append(f"{len(wrong_shape)} key(s) with the wrong shape ({'; '.join(wrong_shape[:3])})")
    if problems:
        raise BundleError(
            f"{where}: the weights of the {what} do not fit the network: {', '.join(problems)}; the bundle "
            "is damaged or was written for a different network layout, export it again with this FedSM"
        )
    bad = [k for k, t in weights.items() if t.dtype.is_floating_point and not bool(torch.isfinite(t).all())]
    if bad:
        raise BundleError(
            f"{where}: the weights of the {what} contain NaN or Inf (e.g. {', '.join(bad[:3])}); "
            "training diverged, use a bundle from an earlier round"
        )
    try:
        net.load_state_dict(dict(weights), strict=True)
    except RuntimeError as exc:  # dtype or other problems the checks above do not cover
        raise BundleError(f"{where}: the weights of the {what} cannot be loaded ({exc})") from exc


def _gate_detail(style: tuple[np.ndarray, np.ndarray] | None,
                 gate: Mapping[str, object] | None) -> tuple[np.ndarray, float] | None:
    """What a routing reason says of the gate: each image's judged distance and the threshold.

    ``None`` when the bundle has no gate or the gate no threshold.
    """
    if style is None or not gate or gate.get("threshold") is None:
        return None
    return style[0], float(gate["threshold"])  # type: ignore[arg-type]


def _batches(count: int, batch_size: int) -> Iterator[slice]:
    for start in range(0, count, batch_size):
        yield slice(start, min(start + batch_size, count))


class SuperModelPredictor:
    """Runs a FedSM super model: selector, routing, then the routed U-Net per image.

    Parameters
    ----------
    bundle
        The super model (see :func:`engine.bundle.load_bundle`).
    device
        ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:<i>"`` (see
        :func:`engine.device.resolve_device`). On CUDA the networks run under fp16
        autocast.

    Raises
    ------
    BundleError
        When any part's weights do not fit its network (checked for all parts up front, so a
        bad bundle fails when it is opened, not halfway through a volume).

    Attributes
    ----------
    metadata
        The bundle's :class:`~engine.bundle.BundleMetadata`.
    global_net, personal_nets, selector
        The networks in eval mode; ``personal_nets[k - 1]`` is site ``k``'s model.
    device, use_amp
        Where the networks run and whether mixed precision is on.
    """

    def __init__(self, bundle: SuperModelBundle, device: str = "auto") -> None:
        # Only the metadata is kept: the networks hold their own copy of the weights.
        self.metadata = bundle.metadata
        self.device, self.use_amp = resolve_device(device)
        meta = self.metadata
        where = bundle.describe()
        layout = f"U-Net for {meta.task}, {meta.in_channels} in, {len(meta.label_names)} out"

        # All K + 1 U-Nets are built and loaded eagerly: each is a few MB, and checking every
        # part now turns a damaged bundle into an error at open time.
        self.global_net = build_segmentation_net(meta.in_channels, len(meta.label_names))
        _fit_weights(self.global_net, bundle.global_weights, f"global model ({layout})", where)
        self.personal_nets: list[nn.Module] = []
        for site in meta.personal_sites:
            net = build_segmentation_net(meta.in_channels, len(meta.label_names))
            what = f"personalized model of site {site!r} ({layout})"
            _fit_weights(net, bundle.personal_weights[site], what, where)
            self.personal_nets.append(net)
        # A single-model bundle (FedAvg, FedProx, Scaffold) has no selector: every image goes to the global model.
        self.selector: nn.Module | None = None
        if not meta.single_model:
            self.selector = build_selector(meta.in_channels, meta.selector_classes,  # type: ignore[arg-type]
                                           meta.selector_head, meta.selector_width)
            _fit_weights(
                self.selector,
                bundle.selector_weights,
                f"model selector (VGG-11 width {meta.selector_width}, {meta.selector_head} head, "
                f"{meta.selector_classes} classes)",
                where,
            )
        for net in self._models():
            net.to(self.device).eval()

    def _models(self) -> list[nn.Module]:
        return [self.global_net, *self.personal_nets, *([self.selector] if self.selector is not None else [])]

    @property
    def num_models(self) -> int:
        """K + 1 routable U-Nets (index 0 global, k site k)."""
        return 1 + len(self.personal_nets)

    def segmentation_net(self, index: int) -> nn.Module:
        """The U-Net routed model ``index`` names: 0 global, k site k's personalized model."""
        return self.global_net if index == 0 else self.personal_nets[index - 1]

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.use_amp:
            return torch.autocast(device_type=self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    def _to_device(self, batch: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)).to(self.device)

    def _check_images(self, images: np.ndarray) -> np.ndarray:
        arr = np.asarray(images)
        channels = self.metadata.in_channels
        if arr.ndim != 4 or arr.shape[1] != channels:
            raise DataError(
                f"images must be a (N, {channels}, H, W) array for task {self.metadata.task!r}, got shape "
                f"{arr.shape}; normalise them first (engine.data.preprocess)"
            )
        if not np.issubdtype(arr.dtype, np.floating):
            raise DataError(
                f"images must be floating point and already normalised ({self.metadata.normalisation}), "
                f"got {arr.dtype}"
            )
        if arr.shape[2] < 1 or arr.shape[3] < 1:
            raise DataError(f"images have an empty side: shape {arr.shape}")
        return arr.astype(np.float32, copy=False)

    def predict(
        self,
        images: np.ndarray,
        gamma: float | None = None,
        batch_size: int = 16,
        force_model: int | None = None,
        progress: ProgressCallback | None = None,
        cancel: CancelCheck | None = None,
        routing_guard: bool | None = None,
        style_gate: bool | None = None,
        cases: np.ndarray | None = None,
    ) -> Prediction:
        """Segment ``images`` with the routed super model.

        Parameters
        ----------
        images
            ``float32 (N, C, H, W)``, already normalised (any H, W; N may be slices of a volume).
        gamma
            Routing threshold in [0, 1] for FedSM bundles; ``None`` uses the bundle's. Checked
            but not used by FedSM-extra bundles (argmax routing).
        batch_size
            Images per forward pass, for the selector and for each U-Net.
        force_model
            Segment every image with this model (0 global, k site k) instead of routing, e.g.
            to compare models. The selector still runs, so probabilities stay meaningful.
        progress
            Called after every batch with ``(done, total)`` image-steps: each image counts
            once for the selector and once for its U-Net, so ``total = 2 * N`` is known up front.
        cancel
            Checked before every batch; when it returns True, :class:`CancelledError` is raised.
        routing_guard
            Route to a site's personalized model only where it beat the global model on the
            site's validation data (:mod:`engine.inference.guard`); ``None`` uses the bundle's
            setting. Only FedSM (gamma) bundles have a guard.
        style_gate
            Send images unlike every participating site's images to the global model (the
            bundle's site-style gate, :mod:`engine.fl.style_gate`); ``None`` uses it when the
            bundle has one, ``False`` routes by the selector alone.
        cases
            The case of each image (the slices of one volume share one; ``None``: each image a case of
            its own). A gate that judges cases (``style_gate["unit"] == "case"``) sends all of a case's
            images to the global model, or none, by the mean distance of its images, and the rest of
            the routing decides the case whole too (:meth:`decides_volumes`): one model per case.

        Returns
        -------
        Prediction
            Masks at the input resolution, routed model, selector probabilities and confidence.
        """
        arr = self._check_images(images)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
        if force_model is not None and (
            isinstance(force_model, bool)
            or not isinstance(force_model, (int, np.integer))
            or not 0 <= force_model < self.num_models
        ):
            raise ConfigError(
                f"force_model must be 0 (global) or 1..{self.num_models - 1} (a site's model), "
                f"got {force_model!r}"
            )
        meta = self.metadata
        threshold = routing_gamma(meta.gamma, gamma)
        n, _, height, width = arr.shape
        total = 2 * n
        done = 0

        def step(count: int) -> None:
            nonlocal done
            done += count
            if progress is not None:
                progress(done, total)

        def check_cancel(stage: str) -> None:
            if cancel is not None and cancel():
                raise CancelledError(f"inference cancelled during {stage} after {done} of {total} steps")

        # single model: one "choice", the global model, with probability 1 (there is nothing to choose)
        probs = np.zeros((n, max(meta.selector_classes, 1)), dtype=np.float32)
        if self.selector is None:
            probs[:] = 1.0
        masks = np.zeros((n, len(meta.label_names), height, width), dtype=np.uint8)
        with torch.inference_mode(), self._autocast():
            for sl in _batches(n, batch_size) if self.selector is not None else ():
                check_cancel("model selection")
                x = self._to_device(resize_images(arr[sl], meta.selector_size))
                # Softmax in float32: under autocast the logits may be fp16.
                probs[sl] = torch.softmax(self.selector(x).float(), dim=1).cpu().numpy()
                step(sl.stop - sl.start)

            guard_on = meta.routing_guard if routing_guard is None else bool(routing_guard)
            gate_on = bool(meta.style_gate) and (style_gate is None or bool(style_gate))
            unlike = np.zeros(n, dtype=bool)
            nearest = np.zeros(n, dtype=np.int64)
            style = None  # (distance, nearest site) per image under the gate
            if self.selector is not None and meta.style_gate and meta.routing == "gamma":
                # computed whenever the bundle has a gate, so forced and ungated runs still report it
                distance, nearest, unlike = gate_nearest(resize_images(arr, meta.image_size), meta.style_gate,
                                                         meta.site_names, cases)
                style = (distance, nearest)
            by_style = meta.site_routing == "style" and style is not None
            # a gate that judges cases decides a volume whole: the gate (gate_nearest), the nearest
            # site and the selector's choice, from its slices' mean probabilities, so one model
            # segments every slice of a volume
            by_case = self.decides_volumes(cases)
            decided = case_mean_probabilities(probs, cases) if by_case else probs
            sizes = case_sizes(cases) if by_case else np.ones(n, dtype=np.int64)
            decisions = None
            if self.selector is None:  # a single-model bundle
                chosen = np.zeros(n, dtype=np.int64)
                step(n)
            elif force_model is not None:
                chosen = np.full(n, int(force_model), dtype=np.int64)
            elif meta.routing == "argmax":
                chosen = route_fedsm_extra(probs)
            else:
                # style routing ignores style_gate=False: without the gate it has no "none of them"
                chosen = route_by_style(style[1], unlike) if by_style else route_fedsm(decided, threshold)
                if gate_on:
                    chosen = np.where(unlike, 0, chosen).astype(np.int64)
                if guard_on:
                    decisions = guard_decisions(meta.site_names, meta.site_validation)
            routed, guarded = (apply_guard(chosen, decisions) if decisions is not None
                               else (chosen, np.zeros(n, dtype=bool)))
            reasons = routing_reasons(chosen, routed, decided, threshold, meta.model_names, decisions,
                                      forced=force_model is not None, argmax=meta.routing == "argmax",
                                      unlike_sites=unlike if (gate_on or by_style) else None,
                                      style=(style[0], meta.style_gate["threshold"]) if by_style else None,
                                      gate=_gate_detail(style, meta.style_gate), volume_sizes=sizes)

            for model_index in np.unique(routed):
                net = self.segmentation_net(int(model_index))
                members = np.flatnonzero(routed == model_index)
                for sl in _batches(len(members), batch_size):
                    check_cancel("segmentation")
                    idx = members[sl]
                    x = self._to_device(resize_images(arr[idx], meta.image_size))
                    masks[idx] = self._segment(net, x, height, width)
                    step(len(idx))

        return Prediction(
            masks=masks,
            routed=routed,
            probabilities=probs,
            confidence=confidence(decided).astype(np.float32),
            reasons=reasons,
            guarded=guarded,
            unlike_sites=unlike,
            nearest_site=nearest,
            style_distance=style[0] if style is not None else np.full(n, np.nan),
        )

    def decides_volumes(self, cases: np.ndarray | None) -> bool:
        """Whether :meth:`predict` routes these images volume by volume rather than image by image.

        True for a FedSM bundle routing by gamma whose site-style gate judges cases (``unit``
        ``case``), given the images' cases: the gate, the nearest site and the selector's choice
        (from the volume's mean probabilities) are then decided once per volume.
        """
        meta = self.metadata
        return (self.selector is not None and bool(meta.style_gate) and meta.routing == "gamma"
                and judges_cases(meta.style_gate, cases))

    @staticmethod
    def _segment(net: nn.Module, x: torch.Tensor, height: int, width: int) -> np.ndarray:
        """Binary masks ``uint8 (B, L, height, width)`` for a batch at the network's size.

        Probabilities, not masks, are resized back: bilinear interpolation of the sigmoid map
        then thresholding gives smooth contours placed with sub-pixel accuracy, while nearest
        resizing of a 256-pixel mask onto a 2000-pixel photo leaves 8-pixel staircases and
        shifts edges by up to half a coarse pixel. Anti-aliasing keeps thin structures fair when
        the input is smaller than the network's size.
        """
        prob = torch.sigmoid(net(x).float())
        if prob.shape[-2:] != (height, width):
            prob = F.interpolate(
                prob, size=(height, width), mode="bilinear", align_corners=False, antialias=True
            )
        return (prob > MASK_THRESHOLD).to(torch.uint8).cpu().numpy()
