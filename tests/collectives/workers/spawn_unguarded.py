"""A script without ``if __name__ == "__main__":`` that starts a child by multiprocessing's
spawn start method (as a DataLoader with ``multiprocessing_context="spawn"`` does): the child
imports the script again, and its top-level ``hvd.init()`` is refused, saying so."""

import multiprocessing

import collectives.torch as hvd

hvd.init()


def child() -> None:
    pass


if multiprocessing.parent_process() is None:  # (the child's import stops at its init)
    process = multiprocessing.get_context("spawn").Process(target=child)
    process.start()
    process.join(timeout=120)
    print(f"spawned child exit code {process.exitcode}", flush=True)
