#!/bin/sh
# As the official image's: arguments that start with a flag go to nats-server.
set -e
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
	set -- nats-server "$@"
fi
exec "$@"
