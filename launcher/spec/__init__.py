"""What to run: the job description the CLI builds and the launcher consumes.

* :mod:`launcher.spec.job` - :class:`~launcher.spec.job.JobSpec`, the whole job
* :mod:`launcher.spec.options` - how hosts are reached (SSH, timeouts) and elastic settings
* :mod:`launcher.spec.hosts` - host lists and hostfiles, and which hosts are this machine
* :mod:`launcher.spec.environment` - which environment variables travel to the workers

Plain data and parsing only, free of paramiko, grpc and torch: the CLI imports it at start,
and the agent uses the environment rules on every host.
"""
