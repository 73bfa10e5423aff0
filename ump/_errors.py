"""ump's exception hierarchy."""

from __future__ import annotations

__all__ = ["UmpError", "OutOfMemoryError", "InvalidArgumentError", "BackendUnavailableError", "UmpWarning"]


class UmpError(RuntimeError):
    """Base class of every error ump raises.

    Attributes
    ----------
    message : str
        What went wrong, without the error name.
    cuda_error : str or None
        The CUDA error name (``"CUDA_ERROR_OUT_OF_MEMORY"``, ...) or ump's own
        status name (``"UMP_ERR_CAP"``) behind the error, where there is one.
    """

    def __init__(self, message: str, cuda_error: str | None = None):
        self.message = message
        self.cuda_error = cuda_error
        super().__init__(f"{message} ({cuda_error})" if cuda_error else message)


class OutOfMemoryError(UmpError, MemoryError):
    """An arena's cap or the device ran out of memory.

    Raised for CuPy allocations as a subclass that is also a
    ``cupy.cuda.memory.OutOfMemoryError``, so code written for stock CuPy
    catches it unchanged.
    """


class InvalidArgumentError(UmpError, ValueError):
    """The C core refused an argument: a pointer that is no live block, a
    size past what the memory spans, a device not granted access.

    A ``ValueError`` as well, so code that validates input catches it as
    it catches Python's own refusals of bad values.
    """


class BackendUnavailableError(UmpError):
    """The backend asked for cannot run on this machine."""


class UmpWarning(UserWarning):
    """Something works, but not the way the user probably wants: a cap of
    managed or pinned memory above what the GPU has free."""
