#!/usr/bin/env bash
# make compose-test: bring docker-compose.yml up for real and prove it works,
# on a Debian machine where nothing was installed by hand, no registry is
# reachable and containers may only use the host's network (docs/compose.md).
#
#  1. install what is missing: docker.io and debootstrap through apt, the
#     compose v2 plugin built from the Go module proxy (cached);
#  2. start a dockerd of its own (socket, data-root, exec-root and pidfile
#     of its own, no iptables, no bridge) and stop it at the end, whatever
#     happens; a system dockerd is never used or touched;
#  3. build every image without a registry: a Debian base from debootstrap
#     (cached), stand-ins for postgres:15, nats:<version>-alpine, golang and
#     distroless, and then the project's own Dockerfiles through compose,
#     with Go modules served from the host's module cache on loopback;
#  4. docker compose -f docker-compose.yml -f <override> up -d --build, where
#     the override (outbox-compose-test override, derived from the file)
#     changes only host networking, loopback endpoints and image sources;
#  5. with the example producer and consumer: a row reaches the consumer
#     once; SIGKILL of the relay, a NATS restart and a PostgreSQL restart
#     lose nothing and apply nothing twice (counted in the database and the
#     stream); /readyz answers; `migrate status` prints the slot; `down -v`
#     leaves no container, volume or process.
#
# Exits non-zero naming the failing step. Prints each step's time and the
# images' sizes at the end.
#
# Cache (reused by later runs): $OUTBOX_RELAY_COMPOSE_CACHE, else
# /var/cache/outbox-relay-compose as root. Must run as root (dockerd).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)
export PATH="/usr/local/go/bin:${PATH}"

COMPOSE_VERSION=v2.40.3
project=outbox-relay
prefix=outbox-relay-compose-test
# Where the servers listen here: loopback, away from the PostgreSQL (5432)
# and NATS (4222) these machines run. 8222 is NATS's monitoring port, which
# docker-compose.yml's healthcheck polls; it stays.
pg_addr=127.0.0.1:15432
nats_addr=127.0.0.1:14222
nats_monitor=127.0.0.1:8222
http_addr=127.0.0.1:18080
db_url="postgres://postgres:postgres@${pg_addr}/postgres?sslmode=disable"
nats_url="nats://${nats_addr}"

started=$(date +%s)
step_name=""
step_start=0
timings=()
run=""
dockerd_pid=""
modproxy_pid=""

say() { echo "compose-test: $*"; }

step() {
	step_end
	step_name=$1
	step_start=$(date +%s)
	echo
	echo "=== compose-test: ${step_name}"
}

step_end() {
	if [[ -n "${step_name}" ]]; then
		local d=$(($(date +%s) - step_start))
		timings+=("$(printf '%5ds  %s' "${d}" "${step_name}")")
		echo "--- ${step_name}: ${d}s"
	fi
	step_name=""
}

fail() {
	echo "compose-test: FAILED in step \"${step_name:-?}\": $*" >&2
	exit 1
}

dc() {
	docker compose -f "${repo}/docker-compose.yml" -f "${run}/override.yml" "$@"
}

# build_image NAME ARGS...: docker build -q, its output shown only on failure
# (the CLI's notice that the legacy builder is deprecated is noise here).
build_image() {
	local what=$1
	shift
	docker build -q --network host "$@" >"${run}/build.log" 2>&1 || {
		cat "${run}/build.log" >&2
		fail "docker build of the ${what} failed"
	}
}

oct() {
	"${run}/outbox-compose-test" "$@"
}

stop_dockerd() {
	[[ -n "${dockerd_pid}" ]] || return 0
	if kill -0 "${dockerd_pid}" 2>/dev/null; then
		kill -TERM "${dockerd_pid}" 2>/dev/null || true
		for _ in $(seq 1 60); do
			kill -0 "${dockerd_pid}" 2>/dev/null || break
			sleep 0.5
		done
		if kill -0 "${dockerd_pid}" 2>/dev/null; then
			echo "compose-test: dockerd ${dockerd_pid} did not stop in 30s; killing it" >&2
			kill -KILL "${dockerd_pid}" 2>/dev/null || true
		fi
	fi
	dockerd_pid=""
}

cleanup() {
	local rc=$?
	set +e
	if [[ ${rc} -ne 0 ]]; then
		echo "--- compose-test: FAILED in step \"${step_name:-?}\" after $(($(date +%s) - started))s" >&2
		if [[ -n "${dockerd_pid}" && -s "${run}/override.yml" ]]; then
			echo "--- compose-test: containers and their last log lines" >&2
			dc ps -a >&2
			dc logs --no-color --tail 30 >&2
			dc down -v --remove-orphans --timeout 10 >/dev/null 2>&1
		fi
	fi
	[[ -n "${modproxy_pid}" ]] && kill "${modproxy_pid}" 2>/dev/null
	stop_dockerd
	if [[ ${rc} -ne 0 && -s "${run}/dockerd.log" ]]; then
		echo "--- compose-test: dockerd's last log lines" >&2
		tail -n 15 "${run}/dockerd.log" >&2
	fi
	if [[ -n "${run}" ]]; then
		# dockerd leaves its bind mount of the host's network namespace.
		awk -v r="${run}/" 'index($2, r) == 1 {print $2}' /proc/self/mounts | sort -r | while read -r m; do
			umount "${m}" || echo "compose-test: could not unmount ${m}" >&2
		done
		rm -rf "${run}"
	fi
	exit "${rc}"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[[ $(id -u) -eq 0 ]] || { echo "compose-test: must run as root (it starts dockerd)" >&2; exit 1; }
cache=${OUTBOX_RELAY_COMPOSE_CACHE:-/var/cache/outbox-relay-compose}
mkdir -p "${cache}"
# One run at a time per cache: they would share the data-root.
exec 9>"${cache}/lock"
flock -w 1800 9 || { echo "compose-test: another compose-test holds ${cache}/lock" >&2; exit 1; }
run=$(mktemp -d /tmp/orct.XXXXXX)

step "install what is missing (docker.io, debootstrap, compose ${COMPOSE_VERSION})"
pkgs=()
command -v dockerd >/dev/null 2>&1 || pkgs+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || pkgs+=(debootstrap)
if ((${#pkgs[@]} > 0)); then
	say "installing ${pkgs[*]} (apt-get)"
	# Nothing may start a system dockerd (it would make a bridge network
	# with private-range addresses): policy-rc.d refuses service starts
	# during the install.
	policy_added=""
	if [[ ! -e /usr/sbin/policy-rc.d ]]; then
		printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
		chmod +x /usr/sbin/policy-rc.d
		policy_added=1
	fi
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" ||
		{ [[ -n "${policy_added}" ]] && rm -f /usr/sbin/policy-rc.d; fail "apt-get install ${pkgs[*]} failed"; }
	[[ -n "${policy_added}" ]] && rm -f /usr/sbin/policy-rc.d
	if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
		systemctl disable --now docker.service docker.socket >/dev/null 2>&1 || true
	fi
fi
command -v dockerd >/dev/null 2>&1 || fail "no dockerd after installing docker.io"
command -v debootstrap >/dev/null 2>&1 || fail "no debootstrap after installing it"
if ! docker compose version >/dev/null 2>&1; then
	plugin="${cache}/compose-${COMPOSE_VERSION}/docker-compose"
	if [[ ! -x "${plugin}" ]]; then
		say "building compose ${COMPOSE_VERSION} from the Go module proxy (a few minutes)"
		gomod="${cache}/gomod"
		dir=$(GOMODCACHE="${gomod}" GOFLAGS=-mod=mod go mod download -json "github.com/docker/compose/v2@${COMPOSE_VERSION}" |
			sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
		[[ -n "${dir}" && -d "${dir}" ]] || fail "go mod download github.com/docker/compose/v2@${COMPOSE_VERSION} printed no Dir"
		mkdir -p "${plugin%/*}"
		# go install refuses this module (its go.mod has exclude
		# directives); inside its own module directory the build works.
		(cd "${dir}" && GOMODCACHE="${gomod}" GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0 \
			go build -trimpath -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=${COMPOSE_VERSION}" \
			-o "${plugin}.tmp" ./cmd) || fail "go build of compose ${COMPOSE_VERSION} failed"
		mv "${plugin}.tmp" "${plugin}"
	fi
	mkdir -p "${HOME}/.docker/cli-plugins"
	cp "${plugin}" "${HOME}/.docker/cli-plugins/docker-compose"
fi
docker --version
dockerd --version
docker compose version || fail "docker compose version fails after installing the plugin"

step "start a dockerd of its own"
datadir="${cache}/docker"
pidfile="${cache}/dockerd.pid"
# A dockerd an earlier, killed run left behind holds the data-root: stop it
# (only if it is one of ours: its command line names our data-root).
if [[ -s "${pidfile}" ]]; then
	old=$(cat "${pidfile}")
	if [[ -r "/proc/${old}/cmdline" ]] && tr '\0' ' ' <"/proc/${old}/cmdline" | grep -q -- "--data-root ${datadir} "; then
		say "stopping dockerd ${old} left by an earlier run"
		dockerd_pid=${old}
		stop_dockerd
	fi
	rm -f "${pidfile}"
fi
mkdir -p "${datadir}"
sock="${run}/docker.sock"
# Separate containerd namespaces keep it apart from any other dockerd on a
# shared containerd.
dockerd --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false --bridge=none \
	--data-root "${datadir}" --exec-root "${run}/exec" --pidfile "${pidfile}" \
	-H "unix://${sock}" --containerd-namespace "${prefix}" --containerd-plugins-namespace "${prefix}-plugins" \
	>"${run}/dockerd.log" 2>&1 9>&- &
dockerd_pid=$!
export DOCKER_HOST="unix://${sock}"
# The legacy builder: BuildKit would fetch a frontend for `# syntax=` and
# compose's bake needs buildx; neither is here.
export DOCKER_BUILDKIT=0
for _ in $(seq 1 120); do
	docker info >/dev/null 2>&1 && break
	kill -0 "${dockerd_pid}" 2>/dev/null || fail "dockerd exited: $(tail -n 5 "${run}/dockerd.log")"
	sleep 0.5
done
docker info >/dev/null 2>&1 || fail "dockerd did not answer on ${sock} within 60s"
docker version --format 'engine {{.Server.Version}} (API {{.Server.APIVersion}}), pid '"${dockerd_pid}"
# Nothing left from an earlier, interrupted run.
leftover=$(docker ps -aq)
if [[ -n "${leftover}" ]]; then
	say "removing containers an earlier run left"
	docker rm -f ${leftover} >/dev/null
fi
leftover=$(docker volume ls -q)
[[ -z "${leftover}" ]] || docker volume rm ${leftover} >/dev/null

step "base image: Debian bookworm (debootstrap, cached)"
base_pkgs=wget,ca-certificates,tzdata
base_image="${prefix}/debian:bookworm"
base_tar="${cache}/debian-bookworm-minbase.tar"
if ! docker image inspect "${base_image}" >/dev/null 2>&1; then
	if [[ ! -s "${base_tar}" ]]; then
		say "debootstrap bookworm (minbase, ${base_pkgs})"
		rootfs="${cache}/rootfs.tmp"
		rm -rf "${rootfs}"
		debootstrap --variant=minbase --include="${base_pkgs}" bookworm "${rootfs}" http://deb.debian.org/debian >"${run}/debootstrap.log" 2>&1 ||
			fail "debootstrap failed: $(tail -n 5 "${run}/debootstrap.log")"
		rm -rf "${rootfs}"/var/cache/apt/archives/*.deb "${rootfs}"/var/lib/apt/lists/*
		tar -C "${rootfs}" -c . >"${base_tar}.tmp"
		mv "${base_tar}.tmp" "${base_tar}"
		rm -rf "${rootfs}"
	fi
	docker import "${base_tar}" "${base_image}" >/dev/null
fi

images="${repo}/proof/composetest/images"
step "stand-in images: postgres:15, distroless, golang, nats"
build_image "postgres:15 stand-in" --build-arg BASE_IMAGE="${base_image}" -t "${prefix}/postgres:15" "${images}/postgres"
build_image "distroless stand-in" --build-arg BASE_IMAGE="${base_image}" -t "${prefix}/distroless-static:nonroot" "${images}/distroless"
go_version=$(go env GOVERSION)
go_image="${prefix}/golang:${go_version#go}-bookworm"
if ! docker image inspect "${go_image}" >/dev/null 2>&1; then
	build_image "golang stand-in" --build-arg BASE_IMAGE="${base_image}" -t "${go_image}" -f "${images}/golang/Dockerfile" "$(go env GOROOT)"
fi
nats_version=$(go list -m -f '{{.Version}}' github.com/nats-io/nats-server/v2)
nats_bin="${cache}/nats-server-${nats_version}/nats-server"
if [[ ! -x "${nats_bin}" ]]; then
	mkdir -p "${nats_bin%/*}"
	CGO_ENABLED=0 go build -trimpath -o "${nats_bin}.tmp" github.com/nats-io/nats-server/v2 || fail "go build of nats-server ${nats_version} failed"
	mv "${nats_bin}.tmp" "${nats_bin}"
fi
mkdir -p "${run}/nats"
cp "${nats_bin}" "${images}/nats/Dockerfile" "${images}/nats/docker-entrypoint.sh" "${run}/nats/"
nats_image="${prefix}/nats:${nats_version#v}"
build_image "nats stand-in" --build-arg BASE_IMAGE="${base_image}" -t "${nats_image}" "${run}/nats"

step "module proxy on loopback"
# Every module the builds need is in the host's cache after this.
go mod download
(cd proof && go build -o "${run}/outbox-compose-test" ./cmd/outbox-compose-test) || fail "go build of proof/cmd/outbox-compose-test failed"
# The binary itself in the background (not through the oct function, whose
# subshell a kill would leave it behind), without the lock's descriptor.
# A fixed port: the proxy's URL is a build arg, and a new one each run would
# void the builder's layer cache.
"${run}/outbox-compose-test" modproxy -dir "$(go env GOMODCACHE)/cache/download" \
	-addr "127.0.0.1:${OUTBOX_RELAY_COMPOSE_MODPROXY_PORT:-15380}" -port-file "${run}/modproxy.port" 9>&- &
modproxy_pid=$!
for _ in $(seq 1 40); do
	[[ -s "${run}/modproxy.port" ]] && break
	kill -0 "${modproxy_pid}" 2>/dev/null || fail "the module proxy exited (port ${OUTBOX_RELAY_COMPOSE_MODPROXY_PORT:-15380} in use? set OUTBOX_RELAY_COMPOSE_MODPROXY_PORT)"
	sleep 0.25
done
[[ -s "${run}/modproxy.port" ]] || fail "the module proxy did not start"
goproxy="http://127.0.0.1:$(cat "${run}/modproxy.port")"
step "golang stand-in with the dependencies compiled (cached)"
mkdir -p "${run}/warm"
cp go.mod go.sum "${run}/warm/"
cp "${images}/golang-warm/Dockerfile" "${run}/warm/"
go list -deps -f '{{if and .Module (not .Module.Main)}}{{.ImportPath}}{{end}}' ./cmd/outbox-relay ./examples/producer ./examples/consumer |
	sort >"${run}/warm/pkgs.txt"
[[ -s "${run}/warm/pkgs.txt" ]] || fail "go list found no dependencies to compile"
# Tagged by what goes into it, and built only when that changed.
warm_key=$( (cat "${run}/warm/go.mod" "${run}/warm/go.sum" "${run}/warm/pkgs.txt" "${run}/warm/Dockerfile"; echo "${go_image}") | sha256sum | cut -c1-12)
warm_image="${prefix}/golang-warm:${go_version#go}-${warm_key}"
if ! docker image inspect "${warm_image}" >/dev/null 2>&1; then
	build_image "golang stand-in with a warm build cache" --build-arg GO_IMAGE="${go_image}" \
		--build-arg GOPROXY="${goproxy}" --build-arg GOSUMDB=off -t "${warm_image}" "${run}/warm"
fi

step "the compose override"
oct override -base "${repo}/docker-compose.yml" -o "${run}/override.yml" \
	-pg "${pg_addr}" -nats "${nats_addr}" -http "${http_addr}" \
	-pg-image "${prefix}/postgres:15" -nats-image "${nats_image}" \
	-build-arg GO_IMAGE="${warm_image}" -build-arg RUNTIME_IMAGE="${prefix}/distroless-static:nonroot" \
	-build-arg GOPROXY="${goproxy}" -build-arg GOSUMDB=off || fail "could not write the override"
dc config -q || fail "docker compose config rejects docker-compose.yml with the override"
dc down -v --remove-orphans >/dev/null 2>&1 || true

step "docker compose build (Dockerfile, examples/Dockerfile)"
dc build || fail "docker compose build failed"

step "docker compose up -d --build"
dc up -d --build || fail "docker compose up failed"
dc ps

counts() { oct counts -db "${db_url}" -nats "${nats_url}"; }
orders() { counts | sed -n 's/^orders=\([0-9]*\) .*/\1/p'; }
wait_caught_up() { oct wait -db "${db_url}" -nats "${nats_url}" -min "$1" -timeout "${2:-180s}"; }
wait_healthy() {
	local id status
	id=$(dc ps -q "$1")
	[[ -n "${id}" ]] || fail "no $1 container"
	for _ in $(seq 1 240); do
		status=$(docker inspect --format '{{.State.Health.Status}}' "${id}")
		[[ "${status}" == healthy ]] && return 0
		sleep 0.5
	done
	fail "$1 not healthy after 120s (${status})"
}
burst() { dc run --rm --no-deps producer -orders "$1" -interval "${2:-20ms}" >/dev/null; }

step "a committed row reaches the consumer once, through the relay"
wait_caught_up 1 || fail "the producer's first order did not reach the consumer once"

step "kill -s KILL relay, then start: nothing lost, nothing applied twice"
dc kill -s KILL relay || fail "docker compose kill -s KILL relay failed"
burst 20 || fail "the producer could not place orders while the relay was down"
c=$(counts) || fail "counting while the relay was down"
echo "relay down: ${c}"
n=$(orders)
[[ "${c}" == *" missing_from_stream=0 "* ]] && fail "every order reached the stream while the relay was killed: it was not down (${c})"
dc start relay
wait_caught_up "${n}" || fail "after the relay's SIGKILL and start"

step "restart nats: nothing lost, nothing applied twice"
burst 40 50ms &
burst_pid=$!
dc restart nats
wait "${burst_pid}" || fail "the producer failed while NATS restarted"
wait_healthy nats
n=$(orders)
wait_caught_up "${n}" || fail "after NATS restarted"

step "restart postgres: nothing lost, nothing applied twice"
dc restart postgres
wait_healthy postgres
burst 20 || fail "the producer could not place orders after PostgreSQL restarted"
n=$(orders)
wait_caught_up "${n}" || fail "after PostgreSQL restarted"

step "the relay's /readyz answers"
oct get "http://${http_addr}/readyz" || fail "/readyz did not answer 200"

step "docker compose run --rm migrate status prints the slot"
status=$(dc run --rm --no-deps migrate status) || fail "migrate status failed"
echo "${status}"
grep -q "outbox_relay" <<<"${status}" || fail "migrate status does not name the slot outbox_relay"

step "docker compose down -v leaves no container, volume or process"
final=$(counts) || fail "final counts"
dc down -v --remove-orphans || fail "docker compose down -v failed"
left=$(docker ps -aq --filter "label=com.docker.compose.project=${project}")
[[ -z "${left}" ]] || fail "containers left after down -v: ${left}"
left=$(docker volume ls -q --filter "label=com.docker.compose.project=${project}")
[[ -z "${left}" ]] || fail "volumes left after down -v: ${left}"
left=$(pgrep -f "containerd-shim.*-namespace ${prefix} " || true)
[[ -z "${left}" ]] || fail "container processes left after down -v (shims ${left})"
oct closed "${pg_addr}" "${nats_addr}" "${nats_monitor}" "${http_addr}" || fail "a server still listens after down -v"

step "image sizes"
docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E "^(${prefix}|outbox-relay)" | sort

step "stop dockerd"
kill "${modproxy_pid}" 2>/dev/null || true
modproxy_pid=""
stop_dockerd
step_end

echo
echo "=== compose-test passed in $(($(date +%s) - started))s; final counts: ${final}"
printf '%s\n' "${timings[@]}"
