"""The segmentation tasks the engine knows: what goes in, what comes out, how it is scaled."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


@dataclass(frozen=True)
class TaskSpec:
    """Fixed facts about one segmentation task.

    Attributes
    ----------
    name
        ``"fundus"`` (2D RGB photos, optic disc and cup) or ``"prostate"`` (MRI volumes
        segmented slice by slice).
    in_channels
        Image channels the networks take.
    label_names
        One output channel per structure, sigmoid activation; channel ``i`` is
        ``label_names[i]``.
    normalisation
        How intensities are scaled before the networks see them (recorded in bundles):
        ``"rgb/255"`` or ``"volume-percentile-1-99"``.
    volumetric
        True when cases are volumes whose axial slices are segmented one by one.
    """

    name: str
    in_channels: int
    label_names: tuple[str, ...]
    normalisation: str
    volumetric: bool

    @property
    def out_channels(self) -> int:
        """Number of output channels (one per structure)."""
        return len(self.label_names)


FUNDUS = TaskSpec("fundus", 3, ("disc", "cup"), "rgb/255", volumetric=False)
PROSTATE = TaskSpec("prostate", 1, ("prostate",), "volume-percentile-1-99", volumetric=True)
TASKS: dict[str, TaskSpec] = {t.name: t for t in (FUNDUS, PROSTATE)}


def get_task(name: str) -> TaskSpec:
    """Return the :class:`TaskSpec` called ``name``.

    Raises
    ------
    ConfigError
        When ``name`` is not a known task.
    """
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(
            f"unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}"
        ) from None
