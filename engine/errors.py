"""One exception hierarchy for the whole engine.

Every message says what is wrong and what to do about it, so a user sees a sentence, not a
traceback::

    FedSMError
    ├── ConfigError          a setting or argument is out of range or inconsistent
    ├── DataError            a dataset, datalist, image or mask cannot be used
    ├── BundleError          a super-model file is corrupt, foreign or incompatible
    ├── WeightsError         a weight update has wrong keys, shapes, dtypes or non-finite values
    ├── DeviceError          the requested compute device is not available
    └── CancelledError       long work was cancelled by the caller
"""

from __future__ import annotations


class FedSMError(Exception):
    """Base class of every error the engine raises on purpose."""


class ConfigError(FedSMError):
    """A setting or argument is out of range or inconsistent with another one."""


class DataError(FedSMError):
    """A dataset, datalist, image or mask cannot be used as given."""


class BundleError(FedSMError):
    """A super-model bundle is corrupt, foreign, or from an incompatible version."""


class WeightsError(FedSMError):
    """A set of weights does not match the model it is meant for."""


class DeviceError(FedSMError):
    """The requested compute device is not available on this machine."""


class CancelledError(FedSMError):
    """Long-running work stopped because the caller set its cancel flag."""
