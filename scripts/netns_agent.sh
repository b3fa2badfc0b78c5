#!/bin/sh
# mpirun's launch agent for emulated hosts (tests/netns.py): called like ssh, "netns_agent.sh HOST COMMAND...",
# it runs COMMAND in the network namespace named HOST, under its own hostname (a UTS namespace), so that
# mpirun's daemons and the ranks see HOST as their machine. Use it with `network: {launch_agent: ...}`.
host="$1"; shift
exec ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"
