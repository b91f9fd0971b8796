"""The errors of TensorFlow ops: TensorFlow's own types, as Horovod's ops raise them.

Horovod's TensorFlow ops fail with TensorFlow's error types, and TensorFlow code catches
those: ``tf.errors.FailedPreconditionError`` when the ranks disagree on an op,
``tf.errors.InvalidArgumentError`` for an argument that cannot run (a root rank out of
range, alltoall splits that do not add up), ``tf.errors.UnknownError`` when the job's
collectives stopped (a rank gone or shut down). An eager op here raises a class that is
both: TensorFlow's type and hvdrun's (:mod:`collectives.errors`), so that
``except tf.errors.FailedPreconditionError`` and ``except hvd.TensorMismatchError`` both
catch a mismatch, and ``hvd.elastic.run`` still sees a ``HorovodInternalError``.

Inside a graph an op runs as ``tf.py_function``, and TensorFlow gives the error its code
from the Python exception's type alone: ``ValueError`` and ``TypeError`` become
``InvalidArgumentError``, ``NotImplementedError`` ``UnimplementedError``, anything else
``UnknownError``. Bad arguments and lost peers therefore keep Horovod's types in graphs too;
a mismatch (a ``ValueError``) arrives as ``InvalidArgumentError`` there, carrying the same
message.
"""

from __future__ import annotations

import tensorflow as tf

from collectives import errors

__all__ = [
    "HorovodInternalError",
    "InvalidArgumentError",
    "InvalidArgumentsError",
    "InvalidSplitsError",
    "InvalidTypeError",
    "NotInitializedError",
    "NotSupportedWithJoinError",
    "TensorMismatchError",
    "as_tensorflow_error",
]


class TensorMismatchError(tf.errors.FailedPreconditionError, errors.TensorMismatchError):
    """Ranks submitted the same op with different shapes, dtypes, ops or roots."""


class NotSupportedWithJoinError(
    tf.errors.FailedPreconditionError, errors.NotSupportedWithJoinError
):
    """An op that ``hvd.join()`` does not support ran while a rank had joined."""


class NotInitializedError(tf.errors.FailedPreconditionError, errors.NotInitializedError):
    """An op ran before ``hvd.init()``."""


class InvalidArgumentsError(tf.errors.InvalidArgumentError, errors.InvalidArgumentsError):
    """An op's arguments cannot run (splits that do not add up, a root outside the set)."""


class InvalidSplitsError(tf.errors.InvalidArgumentError, errors.InvalidSplitsError):
    """Alltoall splits that are not integers."""


class InvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """An argument the op refused at the call (a ``ValueError`` too, as before)."""


class InvalidTypeError(tf.errors.InvalidArgumentError, TypeError):
    """An argument of a type the op refused at the call (a ``TypeError`` too, as before)."""


class HorovodInternalError(tf.errors.UnknownError, errors.HorovodInternalError):
    """The job's collectives stopped: a rank is gone or shut down."""


#: hvdrun's exception types and their TensorFlow twins, most specific first.
_TWINS: tuple[tuple[type[BaseException], type[tf.errors.OpError]], ...] = (
    (errors.InvalidArgumentsError, InvalidArgumentsError),
    (errors.TensorMismatchError, TensorMismatchError),
    (errors.NotSupportedWithJoinError, NotSupportedWithJoinError),
    (errors.InvalidSplitsError, InvalidSplitsError),
    (errors.NotInitializedError, NotInitializedError),
    (errors.HorovodInternalError, HorovodInternalError),
    (ValueError, InvalidArgumentError),
    (TypeError, InvalidTypeError),
)


def as_tensorflow_error(error: BaseException) -> BaseException:
    """``error`` as its TensorFlow twin (the same message, and still an instance of what it
    was for the common cases); ``error`` itself when it is one already or has none
    (``HostsUpdatedInterrupt``, for one, stays what ``hvd.elastic.run`` expects)."""
    if isinstance(error, tf.errors.OpError):
        return error
    for original, twin in _TWINS:
        if isinstance(error, original):
            translated = twin(None, None, str(error))
            translated.__dict__.update(getattr(error, "__dict__", {}))
            return translated.with_traceback(error.__traceback__)
    return error
