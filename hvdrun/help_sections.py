"""``hvdrun --help`` in sections, like horovodrun's argument groups.

A flag's section is looked up by its parameter name; a flag no section names (one added
later) is listed under "Other options", so nothing is ever left out of the help.
"""

from __future__ import annotations

import click

SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Processes and hosts", ("num_proc", "hosts", "hostfile", "launcher")),
    (
        "SSH",
        ("ssh_port", "identity_files", "ssh_config_file", "ssh_host_key_policy"),
    ),
    (
        "Starting and supervising",
        (
            "start_timeout",
            "agent_timeout",
            "heartbeat_timeout",
            "term_grace",
            "rendezvous_addr",
            "skip_version_check",
        ),
    ),
    ("Environment and network", ("exports", "network_interface", "network_interfaces")),
    ("Output", ("output_filename", "prefix_timestamp", "no_report", "report_file")),
    ("Logging", ("verbose", "log_level", "log_without_timestamp", "log_hide_timestamp")),
    (
        "Elastic jobs",
        (
            "min_np",
            "max_np",
            "host_discovery_script",
            "slots_per_host",
            "elastic_timeout",
            "reset_limit",
            "blacklist_cooldown_range",
        ),
    ),
    (
        "Tuning (passed to the workers)",
        (
            "fusion_threshold_mb",
            "cycle_time_ms",
            "cuda_backend",
            "cache_capacity",
            "disable_cache",
            "hierarchical_allreduce",
            "hierarchical_allgather",
            "torus_allreduce",
            "timeline_filename",
            "timeline_mark_cycles",
            "timeline_all_ranks",
            "no_stall_check",
            "stall_check_warning_time_seconds",
            "stall_check_shutdown_time_seconds",
            "gloo_timeout_seconds",
            "num_nccl_streams",
            "thread_affinity",
            "mpi_threads_disable",
        ),
    ),
    ("Horovod compatibility", ("gloo", "mpi", "jsrun", "mpi_args", "tcp", "binding_args")),
    (
        "Planning and information",
        (
            "config_file",
            "dry_run",
            "check_hosts",
            "check_build",
            "merge_timelines",
            "version",
            "help",
        ),
    ),
)

_PREFIX_SECTIONS = (("autotune", "Tuning (passed to the workers)"),)


def section_of(name: str) -> str:
    for title, names in SECTIONS:
        if name in names:
            return title
    for prefix, title in _PREFIX_SECTIONS:
        if name.startswith(prefix):
            return title
    return "Other options"


class SectionedCommand(click.Command):
    """A click command whose options are listed in :data:`SECTIONS`."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        grouped: dict[str, list[tuple[str, str]]] = {}
        help_option = self.get_help_option(ctx)
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):
                continue
            record = param.get_help_record(ctx)
            if record is None:
                continue
            title = (
                "Planning and information" if param is help_option else section_of(param.name or "")
            )
            grouped.setdefault(title, []).append(record)
        order = [title for title, _ in SECTIONS] + ["Other options"]
        for title in order:
            if title in grouped:
                with formatter.section(title):
                    formatter.write_dl(grouped[title])
