#
# outbox-relay container image.
#
#   docker build --build-arg VERSION=$(git describe --tags --always) -t outbox-relay .
#   docker run --rm outbox-relay version
#
# The image holds only the static binary; `outbox-relay demo` needs local
# PostgreSQL and nats-server binaries and is not meant to run in it.
#
# It builds with the legacy builder as well as BuildKit, and needs no
# registry when its base images are given as build args (GO_IMAGE,
# RUNTIME_IMAGE) and Go modules come from another proxy (GOPROXY):
# `make compose-test` builds it so on machines that reach no registry
# (docs/compose.md). So: no `# syntax=` line (BuildKit would pull that
# frontend) and no RUN --mount caches.

ARG GO_VERSION=1.26
ARG GO_IMAGE=golang:${GO_VERSION}-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/static-debian12:nonroot

FROM ${GO_IMAGE} AS build
# go.mod names the exact Go release; fetch it if this image's Go is older.
ENV GOTOOLCHAIN=auto
# Empty: Go's defaults (proxy.golang.org and its checksum database).
ARG GOPROXY
ARG GOSUMDB
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -buildvcs=false \
      -ldflags "-s -w -X main.version=${VERSION}" \
      -o /out/outbox-relay ./cmd/outbox-relay \
 && /out/outbox-relay version

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/outbox-relay /outbox-relay
# /metrics, /healthz and /readyz when run with --http-addr :8080
# (OUTBOX_RELAY_HTTP_ADDR=:8080).
EXPOSE 8080
USER nonroot:nonroot
ENTRYPOINT ["/outbox-relay"]
CMD ["run"]
