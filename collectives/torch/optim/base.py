"""The base class of ``DistributedOptimizer`` (its semantics: :mod:`collectives.torch.optimizer`).

:func:`wrap` builds the wrapper: an instance of a class created on the fly, with a mixin
(:class:`DistributedOptimizerBase` or a subclass) in front of the wrapped optimizer's own
class, that takes over the wrapped optimizer's attributes. The mixin hooks every parameter,
plans the buckets of :mod:`.gradient_buckets` once, starts a bucket's asynchronous in-place
grouped allreduce as soon as its last gradient is ready (one negotiation per bucket, however
many tensors it holds), and waits for all of them before the wrapped optimizer's step; dense
floating gradients without compression travel as views of one flat tensor per bucket. The
mismatch of a bucket whose parameters differ between ranks is raised again naming them
(``_explained``).

Because the mixin sits in front of the user's optimizer class, everything it adds besides
Horovod's public methods (and ``_parameter_names``, which scripts read) is named ``_hvd_*``,
so that it cannot shadow the wrapped class's
own attributes. Those names are the mixin's namespace, shared with its subclasses:
:class:`~collectives.torch.optim.adasum_optimizer.DistributedAdasumOptimizer` overrides
``_hvd_plan``, ``_hvd_start`` and ``_hvd_finish``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from collectives import ops, runtime
from collectives.common import ProcessSet, ReduceOp
from collectives.errors import TensorMismatchError
from collectives.torch.compression import Compression, Compressor
from collectives.torch.functions import explain_mismatch
from collectives.torch.optim.gradient_buckets import (
    NOTHING,
    Bucket,
    parameter_names,
    plan_buckets,
)

__all__ = ["STEP_AFTER_SYNCHRONIZE", "DistributedOptimizerBase", "wrap"]

#: Starts as Horovod's warning does, so that filters written for Horovod's match it.
STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
    "code. (Here the gradients are not reduced a second time.)"
)


class DistributedOptimizerBase(torch.optim.Optimizer):
    """Methods mixed in front of the wrapped optimizer's class (never instantiated alone):
    gradients reduced in buckets with an allreduce of ``op``, then the wrapped step."""

    _hvd_params: list[torch.Tensor]
    _hvd_names: dict[torch.Tensor, str]
    _hvd_buckets: list[Bucket]
    _hvd_bucket_of: dict[torch.Tensor, Bucket]
    _hvd_compression: type[Compressor] | Compressor
    # Horovod's public attributes, under its names: a script may read them.
    op: ReduceOp
    gradient_predivide_factor: float
    sparse_as_dense: bool
    process_set: ProcessSet
    backward_passes_per_step: int
    _hvd_prescale: float
    _hvd_postscale: float
    _hvd_delay: dict[torch.Tensor, int]
    _hvd_sparse: list[torch.Tensor]
    _hvd_densified: dict[torch.Tensor, int]
    _hvd_hooked: dict[torch.Tensor, Any]
    _hvd_backward: bool  # a gradient arrived since the last synchronize()
    _hvd_should_synchronize: bool
    _hvd_synchronized: bool
    _hvd_reduces: bool  # hooked: this rank reduces gradients with others
    #: Whether a rank alone skips the hooks (the Adasum optimizer steps in its hooks).
    _hvd_skip_alone = True

    def _hvd_setup(
        self,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        compression: type[Compressor] | Compressor,
        backward_passes_per_step: int,
        op: ReduceOp,
        gradient_predivide_factor: float,
        groups: Any,
        sparse_as_dense: bool,
        process_set: ProcessSet,
    ) -> None:
        all_params: list[torch.Tensor] = []
        seen: set[torch.Tensor] = set()
        for group in self.param_groups:
            for param in group["params"]:
                if param not in seen:
                    seen.add(param)
                    all_params.append(param)
        self._hvd_params = all_params
        self._hvd_names = parameter_names(named_parameters, self.param_groups, all_params)
        self._hvd_compression = compression
        self.op, self.gradient_predivide_factor = op, gradient_predivide_factor
        # Average: its division by the size split around the sum (by the factor before it).
        average = op == ReduceOp.AVERAGE
        self._hvd_prescale = 1.0 / gradient_predivide_factor if average else 1.0
        self._hvd_postscale = gradient_predivide_factor if average else 1.0
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._hvd_buckets = self._hvd_plan(groups)
        self._hvd_bucket_of = {p: bucket for bucket in self._hvd_buckets for p in bucket.params}
        self._hvd_sparse = []
        self._hvd_densified = {}
        self._hvd_sparse_params: set[torch.Tensor] = set()  # seen with a sparse gradient
        self._hvd_hooked = {}
        self._hvd_delay = {}
        self._hvd_backward = False
        self.set_backward_passes_per_step(backward_passes_per_step)
        self._hvd_should_synchronize = True
        self._hvd_synchronized = False
        # Alone (a job of one rank that cannot grow) there is nothing to reduce: as in
        # Horovod, no hooks, and step() is the wrapped optimizer's own.
        alone = runtime.size() == 1 and not runtime.is_elastic()
        self._hvd_reduces = process_set.included() and not (alone and self._hvd_skip_alone)
        if self._hvd_reduces:
            self._hvd_attach_hooks()

    def _hvd_plan(self, groups: Any, params: list[torch.Tensor] | None = None) -> list[Bucket]:
        """The buckets of ``params`` (by default all the optimizer's parameters)."""
        return plan_buckets(self._hvd_params if params is None else params, self._hvd_names, groups)

    # ---- hooks and submission ----------------------------------------------------------

    def _hvd_attach_hooks(self) -> None:
        """Hooks every parameter that requires a gradient and has no hook yet."""
        # The hook holds the optimizer weakly: a model outlives the optimizers made for it,
        # and the hooks of one that is gone must not keep reducing.
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            optimizer = ref()
            if optimizer is not None:
                optimizer._hvd_on_gradient(param)

        for param in self._hvd_params:
            if param.requires_grad and param not in self._hvd_hooked:
                self._hvd_hooked[param] = param.register_post_accumulate_grad_hook(hook)

    def _hvd_on_gradient(self, param: torch.Tensor) -> None:
        """Counts one accumulation of the parameter's gradient; on the last one the
        gradient is ready, and its bucket starts once all of the bucket's are."""
        self._hvd_backward = True
        delay = self._hvd_delay.get(param, self.backward_passes_per_step) - 1
        if delay < 0:
            raise AssertionError(  # (Horovod's class for it)
                f"the gradient of {self._hvd_names[param]!r} was computed more than "
                f"backward_passes_per_step={self.backward_passes_per_step} times before "
                "optimizer.step() or optimizer.synchronize(); raise backward_passes_per_step to "
                "accumulate more passes locally"
            )
        self._hvd_delay[param] = delay
        if delay:
            return
        bucket = self._hvd_bucket_of[param]
        if bucket.waiting < 0:  # the bucket's first gradient of this step
            bucket.waiting = sum(1 for p in bucket.params if p.requires_grad)
            bucket.early = self._hvd_flat_ok(bucket)
        if bucket.early:
            if not param.is_cuda:
                # A CPU gradient moves into the flat tensor at once, while it is still in
                # the cache, and its memory is free for the next layer's gradient (held
                # back, even small ones left malloc's heap fragmented: +11 MB peak RSS in
                # bench/training.py).
                self._hvd_move(bucket, param)
            else:
                # CUDA ones (a kernel launch each) move together when the bucket starts.
                bucket.produced(param)
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._hvd_start(bucket)

    def _hvd_start(self, bucket: Bucket) -> None:
        """Starts the bucket's allreduce, in place (zeros for a missing gradient: another
        rank may have one, and every rank must hand the same tensors to the collective)."""
        if self._hvd_start_flat(bucket):
            return
        sent = bucket.sent
        for param in bucket.params:
            if not param.requires_grad:
                continue
            grad = param.grad
            if grad is None:
                grad = param.grad = torch.zeros_like(param)
            elif grad.is_sparse:
                if not self.sparse_as_dense:
                    self._hvd_sparse.append(param)
                    continue
                grad = param.grad = _densify(self._hvd_densified, param, grad)
            tensor, ctx = self._hvd_compression.compress(grad)
            sent.append((param, tensor, ctx))
        if not sent:
            bucket.handle = NOTHING
            return
        tensors = [tensor for _, tensor, _ in sent]
        bucket.handle = ops.submit_allreduce(
            tensors,
            tensors,
            self.op,
            self._hvd_prescale,
            self._hvd_postscale,
            self.process_set,
            bucket.name,
            ops.outputs_of,
        )

    def _hvd_start_flat(self, bucket: Bucket) -> bool:
        """The fast path for dense floating gradients without compression (DDP's
        ``gradient_as_bucket_view``): the gradients move into views of the bucket's flat
        tensor, scaled for Average on the way (one pass), ``param.grad`` becomes that view,
        and one in-place Sum allreduce of the flat tensor needs no fusion copies at all.
        Gradients usually moved already, as each became ready (see ``_hvd_on_gradient``).
        False when the bucket does not qualify (the same on every rank)."""
        if not (bucket.early if bucket.early is not None else self._hvd_flat_ok(bucket)):
            return False
        flat = bucket.flat
        assert flat is not None
        self._hvd_move_rest(bucket)
        # (Average of float16 gradients: summed, then divided; of others, divided first)
        half = self.op == ReduceOp.AVERAGE and flat.dtype is torch.float16
        bucket.handle = ops.submit_allreduce(
            [flat],
            [flat],
            ReduceOp.AVERAGE if half else ReduceOp.SUM,
            1.0,
            1.0,
            self.process_set,
            bucket.name,
            ops.outputs_of,
        )
        return True

    def _hvd_flat_ok(self, bucket: Bucket) -> bool:
        """Whether the bucket reduces as one flat tensor this step (see _hvd_start_flat)."""
        if self._hvd_compression is not Compression.none or self.op not in (
            ReduceOp.AVERAGE,
            ReduceOp.SUM,
        ):
            return False
        for param in bucket.params:
            if not param.requires_grad or not param.is_floating_point():
                return False
            if param in self._hvd_sparse_params:  # its slot would carry zeros every step
                return False
        if bucket.flat_views() is None:
            return False
        # Average divides each gradient on its way in, so that the Sum is the average; not
        # float16, whose small gradients would flush to zero: its Sum is divided afterwards.
        average = self.op == ReduceOp.AVERAGE
        divide_first = average and bucket.params[0].dtype is not torch.float16
        bucket.factor = 1.0 / self.process_set.size() if divide_first else 1.0
        return True

    def _hvd_move(self, bucket: Bucket, param: torch.Tensor) -> None:
        """Puts the parameter's gradient, scaled for Average, into its view of the flat
        tensor and makes the view its gradient. A sparse gradient stays as it is (its slot
        reduces zeros) and is reduced on its own, unless ``sparse_as_dense``."""
        bucket.moved.add(param)
        view = bucket.views[bucket.position[param]]
        factor = bucket.factor
        grad = param.grad
        if grad is not None and grad.is_sparse:
            if not self.sparse_as_dense:
                view.zero_()
                self._hvd_sparse.append(param)
                self._hvd_sparse_params.add(param)
                return
            grad = _densify(self._hvd_densified, param, grad)
        if grad is view:  # accumulated in place (zero_grad(set_to_none=False))
            if factor != 1.0:
                view.mul_(factor)
        elif grad is None:
            view.zero_()
        elif factor != 1.0:
            torch.mul(grad, factor, out=view)
        else:
            view.copy_(grad)
        param.grad = view

    def _hvd_move_rest(self, bucket: Bucket) -> None:
        """:meth:`_hvd_move` for every gradient of the bucket not moved yet (CUDA ones, and
        gradients that no backward pass produced: set by the script, or missing), after the
        streams that produced them: the dense ones together (``Bucket.move_together``)."""
        bucket.follow_producers()
        together: list[tuple[torch.Tensor, torch.Tensor]] = []
        for param in bucket.params:
            if param in bucket.moved:
                continue
            grad = param.grad
            view = bucket.views[bucket.position[param]]
            if grad is None or grad is view or grad.is_sparse or grad.shape != view.shape:
                self._hvd_move(bucket, param)  # (zeros, in place, sparse: one at a time)
            else:
                together.append((param, grad))
        bucket.move_together(together)

    def _hvd_finish(self, bucket: Bucket) -> None:
        """Waits for the bucket's allreduce and puts the results in place."""
        assert bucket.handle is not None
        bucket.handle.wait()
        decompress = self._hvd_compression.decompress
        for param, tensor, ctx in bucket.sent:
            grad = param.grad
            if tensor is not grad and grad is not None:
                grad.copy_(decompress(tensor, ctx))

    def __del__(self) -> None:
        for hook in getattr(self, "_hvd_hooked", {}).values():
            hook.remove()

    # ---- the public methods ------------------------------------------------------------

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Each parameter's name, under Horovod's attribute name, which scripts read (the
        names given by ``named_parameters``, else ``noname.<group>.<index>``)."""
        return self._hvd_names

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Sets how many backward passes accumulate locally before gradients are reduced."""
        if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be a positive integer, got {passes}")
        self.backward_passes_per_step = passes
        self._hvd_delay.clear()

    def synchronize(self) -> None:
        """Waits for the gradients' reductions (starting those not started yet): afterwards
        every rank holds the averaged (or op-reduced) gradients."""
        if not self._hvd_reduces:
            self._hvd_synchronized = True
            return
        runtime.require("DistributedOptimizer.synchronize()")
        try:
            # Every rank starts every bucket that has a parameter requiring a gradient,
            # whether or not its own backward pass produced them all.
            for bucket in self._hvd_buckets:
                if bucket.handle is None and any(p.requires_grad for p in bucket.params):
                    self._hvd_start(bucket)
            for bucket in self._hvd_buckets:
                if bucket.handle is not None and bucket.handle is not NOTHING:
                    try:
                        self._hvd_finish(bucket)
                    except TensorMismatchError as error:
                        raise _explained(self, bucket, error) from None
            # Sparse gradients: every rank's indices and values allgathered, all at once.
            sparse = []
            for param in self._hvd_sparse:
                assert param.grad is not None
                name = self._hvd_names[param]
                handle = ops.submit_sparse_allreduce(param.grad, self.op, self.process_set, name)
                sparse.append((param, handle))
            for param, handle in sparse:
                param.grad = handle.wait()
            _resparsify(self._hvd_densified)
        finally:
            self._hvd_reset()
        # Parameters that were frozen before and require gradients now get their hook.
        if len(self._hvd_hooked) < len(self._hvd_params):
            self._hvd_attach_hooks()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context step() does not reduce gradients (after an explicit
        synchronize(), e.g. to clip the averaged gradients)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def _hvd_sync_for_step(self) -> None:
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn(STEP_AFTER_SYNCHRONIZE, stacklevel=3)
            else:
                self.synchronize()
        self._hvd_synchronized = False

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Waits for the gradients' reductions (unless already done), then steps; the
        gradients a closure computes are reduced each time the step calls it."""
        base: Any = super()
        if closure is None:
            self._hvd_sync_for_step()
            return base.step()
        if _agreed(self, None)[1]:  # (a backward on any rank before the step: reduced first)
            self._hvd_sync_for_step()
        try:
            return base.step(functools.partial(_reduced, self, closure))
        finally:
            self._hvd_synchronized = False

    # The wrapped class's own step already runs the step hooks and the profiler; marking this
    # one as hooked keeps Optimizer._patch_step_function (run by load_state_dict) from
    # wrapping it a second time, which would run every step hook twice.
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients, as the wrapped optimizer does; an error while gradients of
        a backward pass wait for step() or synchronize()."""
        if self._hvd_backward and not self._hvd_discard_failed():
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients are being "
                "reduced across ranks (or accumulate over backward_passes_per_step="
                f"{self.backward_passes_per_step} passes) and clearing them now would race "
                "with that; call zero_grad() before the backward pass"
            )
        self._hvd_synchronized = False
        super().zero_grad(set_to_none)

    def _hvd_discard_failed(self) -> bool:
        """Forgets the step's reductions if one of them failed (a peer died, the job is
        being reset): their gradients are lost anyway, and the next step starts afresh."""
        failed = any(
            bucket.handle is not None and bucket.handle.error is not None
            for bucket in self._hvd_buckets
        )
        if failed:
            self._hvd_reset()
        return failed

    def _hvd_reset(self) -> None:
        for bucket in self._hvd_buckets:
            bucket.reset()
        self._hvd_sparse = []
        self._hvd_densified.clear()
        self._hvd_delay.clear()
        self._hvd_backward = False
        self._hvd_synchronized = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's method; the new group's parameters are reduced too (see _add_params)."""
        super().add_param_group(param_group)
        if "_hvd_buckets" in self.__dict__:
            _add_params(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the wrapped optimizer's state; pending reductions are forgotten (as after
        an elastic reset, which restores state this way)."""
        self._hvd_reset()
        super().load_state_dict(state_dict)


def _explained(
    optimizer: DistributedOptimizerBase, bucket: Bucket, error: TensorMismatchError
) -> TensorMismatchError:
    """The mismatch of a bucket (ranks whose models differ), which names the bucket's fused
    buffer (``bias+1``, a flat tensor of all its gradients), again naming the bucket's
    parameters that differ between ranks and how: one more collective, only once the bucket
    has failed, on every rank alike (see ``explain_mismatch``)."""
    named = [(repr(optimizer._hvd_names[param]), param) for param in bucket.params]
    carried = "The op is a bucket of DistributedOptimizer"
    if len(named) > 1:
        carried += f": the gradients of {len(named)} parameters reduced together"
    name = "DistributedOptimizer.mismatch"
    return explain_mismatch(error, named, carried, optimizer.process_set, name, gradients=True)


def _reduced(optimizer: DistributedOptimizerBase, closure: Callable[[], Any]) -> Any:
    """A closure given to ``step()``, then the reduction of the gradients it computed
    (unless within ``skip_synchronize()``): the wrapped step uses them as soon as the
    closure returns, and LBFGS calls it again, clearing them, within the same step. It
    returns the loss averaged over the ranks, so that LBFGS's line search and stop tests,
    which read it, take the same branches (and call the closure as often) on every rank."""
    loss, backward = _agreed(optimizer, closure())
    # (where no rank's closure ran a backward, the gradients are as they were: reduced)
    if optimizer._hvd_should_synchronize and backward:
        optimizer.synchronize()
    return loss


_AGREEMENT = "DistributedOptimizer.closure"


def _agreed(optimizer: DistributedOptimizerBase, loss: Any) -> tuple[Any, bool]:
    """``loss`` averaged over the process set, and whether any rank ran a backward since its
    gradients were last reduced: decided alike on every rank, since each decision is
    whether to run a collective (one small allreduce)."""
    if not optimizer._hvd_reduces:
        return loss, optimizer._hvd_backward
    if isinstance(loss, torch.Tensor):
        loss = loss.detach()  # (float() of a tensor that requires grad warns)
    value = 0.0 if loss is None else float(loss)
    mine = torch.tensor([value, float(optimizer._hvd_backward)], dtype=torch.float64)
    process_set = optimizer.process_set
    ops.allreduce_([mine], ReduceOp.SUM, process_set=process_set, name=_AGREEMENT)
    mean = mine[0].item() / process_set.size()
    if isinstance(loss, torch.Tensor):
        loss = torch.full_like(loss, mean)
    elif loss is not None:
        loss = mean
    return loss, mine[1].item() > 0


def _densify(
    densified: dict[torch.Tensor, int], param: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """``sparse_as_dense``: the gradient travels dense, and becomes sparse again after the
    reduction (``_resparsify``)."""
    densified[param] = grad.sparse_dim()
    return grad.to_dense()


def _resparsify(densified: dict[torch.Tensor, int]) -> None:
    """Gives the gradients that ``sparse_as_dense`` reduced dense their sparse layout back,
    as Horovod does: optimizers such as ``SparseAdam`` accept nothing else. Rows whose
    reduced gradient is all zeros are left out."""
    for param, sparse_dim in densified.items():
        grad = param.grad
        if grad is not None and not grad.is_sparse:
            param.grad = grad.to_sparse(sparse_dim)


def _add_params(optimizer: DistributedOptimizerBase) -> None:
    """Takes in the parameters of the group that ``add_param_group()`` just added (Horovod
    leaves them out: they would train on each rank's own gradient, and the ranks drift
    apart). Each is named as ``named_parameters`` named it, else ``noname.<group>.<index>``,
    and they get buckets of their own, planned alike on every rank (the script adds the
    group on every rank), so the existing buckets stay as they are."""
    index = len(optimizer.param_groups) - 1
    added: dict[torch.Tensor, None] = {}  # (a dict: tensors compare by value in a list)
    for position, param in enumerate(optimizer.param_groups[index]["params"]):
        if param not in optimizer._hvd_bucket_of and param not in added:
            optimizer._hvd_names.setdefault(param, f"noname.{index}.{position}")
            added[param] = None
    if not added:
        return
    optimizer._hvd_params.extend(added)
    buckets = optimizer._hvd_plan(None, list(added))
    optimizer._hvd_buckets.extend(buckets)
    optimizer._hvd_bucket_of.update((p, bucket) for bucket in buckets for p in bucket.params)
    if optimizer._hvd_reduces:
        optimizer._hvd_attach_hooks()


_classes: dict[tuple[type, type], type] = {}


def _wrapper_class(mixin: type, base: type) -> type:
    # The optimizer's class stays the last base: hvd.broadcast_optimizer_state's dummy step
    # calls its step directly (collectives.torch.functions cannot import this module).
    cls = _classes.get((mixin, base))
    if cls is None:
        cls = type(base.__name__, (mixin, base), {"__module__": base.__module__})
        cls.__qualname__ = base.__qualname__
        _classes[(mixin, base)] = cls
    return cls


def wrap(
    mixin: type[DistributedOptimizerBase],
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
    compression: type[Compressor] | Compressor,
    backward_passes_per_step: int,
    op: ReduceOp,
    gradient_predivide_factor: float,
    groups: Any,
    sparse_as_dense: bool,
    process_set: ProcessSet,
) -> Any:
    """The optimizer wrapped with ``mixin`` in front of its class (arguments checked by
    ``DistributedOptimizer``): an instance of the optimizer's class with its state."""
    cls: Any = _wrapper_class(mixin, type(optimizer))
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    # An LR scheduler made before wrapping replaced step() on the optimizer instance (to
    # count calls); copied over, it would bypass the wrapper's step and its reduction.
    wrapped.__dict__.pop("step", None)
    wrapped._hvd_setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
    return wrapped
