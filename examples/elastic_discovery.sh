#!/bin/sh
# Host discovery for hvdrun's elastic mode: prints one 'host' or 'host:slots' per line.
#
# This one prints the file named by $ELASTIC_HOSTS (default: elastic_hosts.txt in the
# current directory), so that hosts can be added to or removed from a running job by
# editing that file; without the file it offers this machine with two slots. A real one
# would ask the cluster's scheduler or cloud API which machines are up.
hosts_file="${ELASTIC_HOSTS:-elastic_hosts.txt}"
if [ -f "$hosts_file" ]; then
    exec cat "$hosts_file"
fi
echo "localhost:2"
