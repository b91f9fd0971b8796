"""Starts and supervises a job's workers; owns the rendezvous server's lifetime.

The map of the package, from what a job is to how it is watched::

    errors.py        LauncherError, the base of every user-facing launcher error
    output.py        worker output: line splitting (in the agent), prefixes and files (here)
    spec/            what to run: JobSpec, options, host lists, environment rules
    transport/       how hosts are reached: the wire protocol, AgentConnection and its local
                     and SSH variants, starting every host's agent, host facts
    agent/           what runs on every host: ``python -m launcher.agent`` and its workers
    supervision/     how a running job is watched: the shared core, the fixed supervisor,
                     the elastic driver (membership, discovery), the failure report
    run.py           run_job(): a fixed or an elastic job
    check_hosts.py   ``hvdrun --check-hosts``

Imports point one way: ``supervision`` and ``check_hosts`` may import ``transport``,
``spec``, ``output`` and ``errors``; ``transport`` imports ``spec`` and ``errors``; ``spec``
imports only ``errors``. ``agent`` stays light (no paramiko, grpc or torch) and takes from the
rest only the leaf modules both ends share: ``transport.protocol``, ``transport.hostinfo``,
``spec.environment`` and ``output``. Nothing imports ``agent`` (hosts run it by module path)
or ``run`` (the CLI's entry point). ``launcher`` imports ``rendezvous``, never
``collectives``, and never imports torch.
"""
