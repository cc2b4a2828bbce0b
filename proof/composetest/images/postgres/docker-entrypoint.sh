#!/bin/bash
# The parts of the official postgres image's entrypoint docker-compose.yml
# uses: initialise PGDATA once from POSTGRES_USER, POSTGRES_PASSWORD and
# POSTGRES_DB (initdb's trust for local and loopback connections, password
# authentication for every other host, listen_addresses '*', a temporary
# server on the Unix socket only while it sets up), then run the command as
# the postgres user.
set -Eeuo pipefail

if [[ "${1:0:1}" == - ]]; then
	set -- postgres "$@"
fi

if [[ "$1" == postgres && "$(id -u)" == 0 ]]; then
	mkdir -p "$PGDATA"
	chown postgres:postgres "$PGDATA"
	chmod 700 "$PGDATA"
	exec runuser -u postgres -- "$0" "$@"
fi

if [[ "$1" == postgres && ! -s "$PGDATA/PG_VERSION" ]]; then
	if [[ -z "${POSTGRES_PASSWORD:-}" ]]; then
		echo "Error: Database is uninitialized and superuser password is not specified. Set POSTGRES_PASSWORD." >&2
		exit 1
	fi
	user=${POSTGRES_USER:-postgres}
	db=${POSTGRES_DB:-$user}
	initdb --username="$user" --pwfile=<(printf '%s\n' "$POSTGRES_PASSWORD") ${POSTGRES_INITDB_ARGS:-}
	printf '\nhost all all all %s\n' "${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}" >> "$PGDATA/pg_hba.conf"
	pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -p ${PGPORT:-5432}" -w start
	if [[ "$db" != postgres ]]; then
		psql -v ON_ERROR_STOP=1 --username "$user" --dbname postgres --set db="$db" <<<'CREATE DATABASE :"db";'
	fi
	pg_ctl -D "$PGDATA" -m fast -w stop
	echo "PostgreSQL init process complete; ready for start up."
fi

exec "$@"
